"""The compiled forward (engine.compilation): one graph for every batch shape, the KV
connector's layer hooks inside it, the eager fallback without a compiler, a warm start from
Inductor's cache, and the persistent input buffers it reads. Its logits against transformers
are checked in test_paged_logits.py, which runs every case compiled and eager."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from pdcluster.engine.config import EngineConfig
from pdcluster.engine.input_buffers import InputBuffers
from pdcluster.engine.runner import ModelRunner, SequenceChunk
from pdcluster.engine.core.kv_connector import StepCancelled
from tests.models.factory import build

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compiled() -> ModelRunner:
    runner = ModelRunner(EngineConfig(num_kv_blocks=64, enforce_eager=False))
    assert runner.forward_mode == "compiled"
    return runner


@pytest.fixture(scope="module")
def eager() -> ModelRunner:
    return ModelRunner(EngineConfig(num_kv_blocks=64, enforce_eager=True))


def _batches() -> list[list[SequenceChunk]]:
    prompt = list(range(5, 40))
    return [
        [SequenceChunk(prompt, 0, [0, 1, 2])],                                   # prefill
        [SequenceChunk([7], 35, [0, 1, 2])],                                      # decode, 1
        [SequenceChunk([8], 36, [0, 1, 2]), SequenceChunk(prompt[:17], 0, [9, 10])],  # mixed
        [SequenceChunk([9], 37, [0, 1, 2]), SequenceChunk([3], 17, [9, 10]),
         SequenceChunk(prompt[:1], 0, [20])],                                     # decode, 3
    ]


def test_one_graph_serves_every_batch_shape_with_the_eager_logits(compiled, eager):
    graphs = counters["stats"]["unique_graphs"]
    for batch in _batches():
        got, expected = compiled.execute(batch), eager.execute(batch)
        assert got.shape == expected.shape == (len(batch), compiled.model_config.vocab_size)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    assert counters["stats"]["unique_graphs"] == graphs  # warm-up compiled the only graph


class _Recorder:
    def __init__(self, cancel_at: int | None = None) -> None:
        self.calls: list[tuple[str, int]] = []
        self.cancel_at = cancel_at

    def wait_for_layer_load(self, layer: int) -> None:
        self.calls.append(("wait", layer))

    def save_kv_layer(self, layer: int) -> None:
        self.calls.append(("save", layer))
        if layer == self.cancel_at:
            raise StepCancelled("req-1")


@pytest.mark.parametrize("mode", ["compiled", "eager"])
def test_layer_hooks_run_around_each_layers_attention(mode, request):
    runner = request.getfixturevalue(mode)
    layers = runner.model_config.num_hidden_layers
    recorder = _Recorder()
    runner.layer_hooks = recorder
    try:
        runner.execute([SequenceChunk([5, 6, 7], 0, [30])])
        assert recorder.calls == [(kind, layer) for layer in range(layers)
                                  for kind in ("wait", "save")]
        # a connector's StepCancelled leaves the forward with its own type, mid-way
        runner.layer_hooks = cancelling = _Recorder(cancel_at=1)
        with pytest.raises(StepCancelled):
            runner.execute([SequenceChunk([5, 6, 7], 0, [31])])
        assert cancelling.calls == [("wait", 0), ("save", 0), ("wait", 1), ("save", 1)]
    finally:
        runner.layer_hooks = None


def test_without_a_cxx_compiler_the_engine_warns_and_runs_eager(monkeypatch, caplog):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with caplog.at_level(logging.WARNING, logger="pdcluster.engine.compilation"):
        runner = ModelRunner(EngineConfig(num_kv_blocks=8, enforce_eager=False))
    assert runner.forward_mode == "eager"
    assert any("no C++ compiler" in r.getMessage() for r in caplog.records)
    assert runner.execute([SequenceChunk([5, 6], 0, [0])]).shape[0] == 1


def test_a_process_that_compiled_other_models_still_compiles_the_next(compiled, tmp_path):
    """Dynamo caches graphs per code object, and every model shares one `forward`: even at a
    recompile limit of 1, a model of another shape after the fixture's must still compile."""
    build("llama", tmp_path, seed=0, num_hidden_layers=3)
    with torch._dynamo.config.patch(recompile_limit=1, accumulated_recompile_limit=1):
        runner = ModelRunner(EngineConfig(model=str(tmp_path), block_size=4, num_kv_blocks=16,
                                          enforce_eager=False))
        assert runner.forward_mode == "compiled"
        assert compiled.execute([SequenceChunk([5, 6], 0, [0])]).shape[0] == 1
        assert runner.execute([SequenceChunk([5, 6], 0, [0])]).shape[0] == 1


_CHILD = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
from torch._dynamo.utils import counters
from pdcluster.engine.config import EngineConfig
from pdcluster.engine.runner import ModelRunner
started = time.perf_counter()
runner = ModelRunner(EngineConfig(num_kv_blocks=8, enforce_eager=False))
print(json.dumps({"mode": runner.forward_mode, "seconds": time.perf_counter() - started,
                  **{k: counters["inductor"][k] for k in ("fxgraph_cache_hit", "fxgraph_cache_miss")}}))
"""


@pytest.mark.slow
def test_a_warm_start_reads_the_graph_from_inductors_cache(tmp_path):
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}

    def start() -> dict:
        out = subprocess.run([sys.executable, "-c", _CHILD, str(ROOT)], env=env, check=True,
                             capture_output=True, text=True, timeout=300).stdout
        return json.loads(out.strip().splitlines()[-1])

    cold, warm = start(), start()
    assert cold["mode"] == warm["mode"] == "compiled"
    assert cold["fxgraph_cache_miss"] >= 1 and cold["fxgraph_cache_hit"] == 0
    assert warm["fxgraph_cache_hit"] >= 1 and warm["fxgraph_cache_miss"] == 0


def test_input_buffers_are_written_in_place_with_the_slot_mapping_of_the_block_tables():
    buffers = InputBuffers(max_tokens=4, max_seqs=1, max_model_len=64, block_size=4,
                           device=torch.device("cpu"))
    first = buffers.prepare([SequenceChunk([1, 2, 3], 0, [7])])
    chunks = [SequenceChunk([11, 12, 13, 14, 15], 2, [5, 9]), SequenceChunk([21], 9, [3, 8, 6])]
    ids, positions, attn = buffers.prepare(chunks)  # grows: 6 tokens, 2 sequences
    assert ids.tolist() == [11, 12, 13, 14, 15, 21]
    assert positions.tolist() == [2, 3, 4, 5, 6, 9]
    # slot = block_table[p // block_size] * block_size + p % block_size, by hand
    assert attn.slot_mapping.tolist() == [5 * 4 + 2, 5 * 4 + 3, 9 * 4 + 0, 9 * 4 + 1, 9 * 4 + 2,
                                          6 * 4 + 1]
    assert attn.seq_lens.tolist() == [7, 10] and attn.query_start_loc.tolist() == [0, 5, 6]
    assert attn.block_tables[0, :2].tolist() == [5, 9] and attn.block_tables[1, :3].tolist() == [3, 8, 6]
    assert attn.max_seq_len == 10 and attn.block_tables.shape == (2, 16)
    # no growth: the next step's views sit at the same addresses
    again = buffers.prepare([SequenceChunk([4], 1, [2])])
    assert again[0].data_ptr() == ids.data_ptr() and again[2].slot_mapping.data_ptr() == \
        attn.slot_mapping.data_ptr()
    assert again[2].slot_mapping.tolist() == [2 * 4 + 1]
    assert first[0].data_ptr() != ids.data_ptr()  # the first buffers were outgrown


def test_padded_decode_batch_gives_the_real_rows_logits_and_stores_only_their_kv(eager):
    """The CUDA graphs' padding (engine.cuda_graphs), checked on CPU: a decode batch padded to
    more sequences yields the same hidden states for its real rows as unpadded, and the
    padding rows write nothing into the cache."""
    from pdcluster.engine.cuda_graphs import capture_sizes
    from pdcluster.engine.forward_context import ForwardContext, set_forward_context

    assert capture_sizes(0) == () and capture_sizes(3) == (1, 2, 3)
    assert capture_sizes(20) == (1, 2, 4, 8, 16, 20)
    prompts = [list(range(5, 40)), list(range(50, 67))]
    tables = [[0, 1, 2], [9, 10]]
    for prompt, table in zip(prompts, tables):
        eager.execute([SequenceChunk(prompt, 0, table)])
    decode = [SequenceChunk([7], 35, tables[0]), SequenceChunk([8], 17, tables[1])]
    buffers = InputBuffers(max_tokens=8, max_seqs=8, max_model_len=256, block_size=16,
                           device=torch.device("cpu"))

    def hidden(pad_to):
        ids, positions, attn = buffers.prepare(decode, pad_to=pad_to)
        with set_forward_context(ForwardContext(attn, eager.kv_cache)):
            return ids, attn, eager.forward(ids, positions).clone()

    def slots() -> torch.Tensor:  # [2 * layers, slots, heads * head_dim]
        return torch.stack([x.reshape(-1, x.shape[2] * x.shape[3])
                            for x in eager.kv_cache.k + eager.kv_cache.v])

    before = slots().clone()
    ids, attn, padded = hidden(5)
    assert ids.tolist() == [7, 8, 0, 0, 0] and attn.slot_mapping.tolist()[2:] == [-1] * 3
    assert attn.seq_lens.tolist() == [36, 18, 1, 1, 1]
    assert attn.query_start_loc.tolist() == [0, 1, 2, 3, 4, 5]
    assert attn.block_tables[2:, 0].tolist() == [0, 0, 0]
    after_padded = slots().clone()
    _, _, unpadded = hidden(None)
    # equal up to the GEMM's rounding at another row count, relative to the values' size
    torch.testing.assert_close(padded[:2], unpadded, rtol=1e-5, atol=1e-5)
    # the padded run wrote the real rows' slots only, what the unpadded run writes there
    torch.testing.assert_close(after_padded, slots(), rtol=1e-5, atol=1e-5)
    changed = (after_padded != before).any(-1).any(0).nonzero().flatten().tolist()
    assert changed == [tables[0][35 // 16] * 16 + 35 % 16, tables[1][17 // 16] * 16 + 17 % 16]
    with pytest.raises(ValueError, match="one-token chunks"):
        buffers.prepare(decode, pad_to=1)
