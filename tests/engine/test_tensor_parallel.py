"""Acceptance: tensor parallelism on CPU (gloo) equals TP=1.

Three models: the bundled stories260K (8 heads, 4 KV heads, tied embeddings), a random GQA
checkpoint written here (8 heads, 4 KV heads, biases on q/k/v/o and the MLP, untied, saved in
several safetensors shards), and the factory's Qwen3-MoE (tests/models/factory.py: each
expert's intermediate dimension split over the ranks; Mixtral's experts are the same layer).
Each runs as TP=1 and as a real 2-process TP instance
(_tp_child.py): chunked + batched prefill, batched greedy decode, then the prompt's blocks read
in the KV pool's layout (gathered from the ranks, as a TP prefill publishes them) and written
into other blocks (scattered, as a TP decode receives them) and decoded again. Checked: greedy
tokens identical, pool-layout blocks equal to TP=1's, each rank holding ~1/2 of the layer
weights and KV heads, 2 all-reduces per layer per step; a dead rank fails rank 0 fast.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers

from pdcluster.engine.config import BUNDLED_MODEL
from pdcluster.engine.model_config import ModelConfig
from pdcluster.engine.models.base import check_tensor_parallel
from pdcluster.engine.parallel import TPGroup
from tests.models.factory import build

CHILD = Path(__file__).with_name("_tp_child.py")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def random_gqa_checkpoint(tmp_path_factory) -> str:
    torch.manual_seed(1)
    config = transformers.LlamaConfig(
        vocab_size=640, hidden_size=96, intermediate_size=160, num_hidden_layers=3,
        num_attention_heads=8, num_key_value_heads=4, head_dim=12, tie_word_embeddings=False,
        attention_bias=True, mlp_bias=True, max_position_embeddings=256, initializer_range=0.2,
        bos_token_id=1, eos_token_id=2,
    )
    path = tmp_path_factory.mktemp("random_gqa")
    transformers.LlamaForCausalLM(config).save_pretrained(path, max_shard_size="200KB")
    assert (path / "model.safetensors.index.json").is_file()
    return str(path)


def _spawn(rank: int, world: int, model: str, block_size: int, out: Path, mode: str,
           port: int | None = None) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    args = [sys.executable, str(CHILD), str(rank), str(world), model, str(block_size), str(out),
            mode] + ([str(port)] if port is not None else [])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _wait(procs: list[subprocess.Popen], timeout_s: float = 120) -> None:
    for proc in procs:
        output, _ = proc.communicate(timeout=timeout_s)
        assert proc.returncode in (0, 3), f"child failed ({proc.returncode}):\n{output[-4000:]}"


def _start_tp2(model: str, block_size: int, out: Path, mode: str) -> list[subprocess.Popen]:
    rank0 = _spawn(0, 2, model, block_size, out, mode)
    deadline = time.monotonic() + 60
    while not (out / "port").exists():
        assert rank0.poll() is None, rank0.communicate()[0][-4000:]
        assert time.monotonic() < deadline, "rank 0 never published its store port"
        time.sleep(0.05)
    return [rank0, _spawn(1, 2, model, block_size, out, mode, int((out / "port").read_text()))]


def _tp1_and_tp2_agree(path: str, block_size: int, tmp_path: Path) -> tuple[dict, dict, Path]:
    """Run the model as TP=1 and as a 2-process TP instance; assert greedy tokens (prefill's
    first, batched decode, migrated decode), first logits, and the KV pool's block layout and
    blocks equal. Returns (TP=1 result, TP=2 result, TP=2 output directory)."""
    tp1_out, tp2_out = tmp_path / "tp1", tmp_path / "tp2"
    procs = [_spawn(0, 1, path, block_size, tp1_out, "serve"),
             *_start_tp2(path, block_size, tp2_out, "serve")]
    _wait(procs)
    tp1 = json.loads((tp1_out / "result.json").read_text())
    tp2 = json.loads((tp2_out / "result.json").read_text())
    assert tp2["outputs"] == tp1["outputs"]
    assert tp2["migrated"] == tp1["migrated"] == tp1["outputs"][0][:len(tp1["migrated"])]
    torch.testing.assert_close(torch.tensor(tp2["first_logits"]),
                               torch.tensor(tp1["first_logits"]), atol=1e-4, rtol=0)
    assert tp2["wire_spec"] == tp1["wire_spec"]
    # (fp32 sums in another order: K/V values reach ~25, so a relative tolerance too)
    # (the blocks' bytes, read as the float32 the child's one-dtype spec holds)
    torch.testing.assert_close(torch.load(tp2_out / "wire.pt").view(torch.float32),
                               torch.load(tp1_out / "wire.pt").view(torch.float32),
                               atol=1e-5, rtol=1e-5)
    return tp1, tp2, tp2_out


@pytest.mark.parametrize("model", ["stories260K", "random_gqa", "qwen3_moe"])
def test_tp2_matches_tp1(model, request, tmp_path):
    if model == "stories260K":
        path, block_size = str(BUNDLED_MODEL), 16
    elif model == "random_gqa":
        path, block_size = request.getfixturevalue("random_gqa_checkpoint"), 4
    else:
        build(model, tmp_path / "checkpoint")
        path, block_size = str(tmp_path / "checkpoint"), 4
    config = ModelConfig.from_pretrained(path)
    tp1, tp2, tp2_out = _tp1_and_tp2_agree(path, block_size, tmp_path)
    # the KV pool's block layout has every KV head
    assert tp1["wire_spec"][0][1][1] == config.num_key_value_heads  # k: [block_size, heads, dim]
    # a forward issues 2 all-reduces per layer (after o_proj, after down_proj); none at TP=1
    layers = config.num_hidden_layers
    assert tp2["prefill_all_reduces"] == 2 * layers
    assert tp2["step_all_reduces"] == [2 * layers] * len(tp2["step_all_reduces"])
    assert tp1["prefill_all_reduces"] == 0 and set(tp1["step_all_reduces"]) == {0}
    # each rank holds ~1/2 of the layer weights (norms and the row-parallel biases replicated)
    full = json.loads((tp2_out.parent / "tp1" / "rank0.json").read_text())
    for rank in (0, 1):
        shard = json.loads((tp2_out / f"rank{rank}.json").read_text())
        assert abs(shard["layer_param_bytes"] / full["layer_param_bytes"] - 0.5) < 0.02
        assert shard["kv_heads"] == config.num_key_value_heads // 2
        assert shard["num_attention_heads"] == config.num_attention_heads // 2


def test_dead_rank_fails_rank0_fast(tmp_path):
    out = tmp_path / "die"
    procs = _start_tp2(str(BUNDLED_MODEL), 16, out, "die")
    _wait(procs)
    errors = json.loads((out / "result.json").read_text())["errors"]
    assert all(message != "no error" for message, _ in errors), errors
    assert errors[1][0].startswith("TP instance unusable")
    assert all(seconds < 30 for _, seconds in errors)


def test_tp1_group_is_a_no_op_and_tp_sizes_are_checked():
    group = TPGroup()
    x = torch.ones(3)
    assert group.all_reduce(x) is x and group.broadcast(x) is x and group.num_all_reduces == 0
    assert group.gather(x) == [x] and group.shard(8, "heads") == (0, 8)
    config = ModelConfig.from_pretrained(BUNDLED_MODEL)  # 8 heads, 4 KV heads, intermediate 172
    check_tensor_parallel(config, 4)
    with pytest.raises(ValueError, match="num_key_value_heads 4"):
        check_tensor_parallel(config, 8)
    with pytest.raises(ValueError, match="num_attention_heads 8"):
        check_tensor_parallel(config, 3)


def test_mla_tp2_matches_tp1_with_the_latent_whole_on_every_rank(tmp_path):
    """DeepSeek-V2 (tests/models/factory.py): heads and experts split, the latent cache not.
    Greedy tokens, first logits and the pool-layout blocks equal TP=1's; each rank holds the
    whole latent (one cache entry of latent + rope per token) and half the heads."""
    build("deepseek_v2", tmp_path / "checkpoint")
    path = str(tmp_path / "checkpoint")
    config = ModelConfig.from_pretrained(path)
    tp1, _, tp2_out = _tp1_and_tp2_agree(path, 4, tmp_path)
    assert tp1["wire_spec"][0] == ["latent", [4, 1, config.kv_latent_dim]]
    for rank in (0, 1):
        shard = json.loads((tp2_out / f"rank{rank}.json").read_text())
        assert shard["kv_heads"] == 1
        assert shard["num_attention_heads"] == config.num_attention_heads // 2
