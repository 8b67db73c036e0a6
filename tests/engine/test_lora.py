"""LoRA adapters (engine.lora) against PEFT, the library that wrote them: base and adapted
sequences batched in the same steps, prefilled in chunks then decoded, give each the logits
of its own PEFT model (fp32, max abs diff <= 1e-4); what cannot be served is refused by name.
"""

from __future__ import annotations

import json

import pydantic
import pytest
import torch

from pdcluster.engine.config import EngineConfig
from pdcluster.engine.core.hashing import make_namespace
from pdcluster.engine.lora import AdapterError
from pdcluster.engine.runner import ModelRunner, SequenceChunk
from tests.engine.test_paged_logits import ATOL, _max_diff, _prompt, _shuffled_tables
from tests.models.factory import BASE, build, build_lora

BLOCK = 4
NUM_DECODES = 8
#: name -> (targets, rank, rsLoRA): attention only; every linear at another rank, rsLoRA
ADAPTERS = {"attn": (("q_proj", "v_proj", "o_proj"), 4, False),
            "all": (("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                     "down_proj"), 8, True)}


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def served(request, tmp_path_factory):
    """(base transformers model, {adapter: its PEFT model}, a runner serving them)."""
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    hf = build(request.param, root / "base")
    peft = {name: build_lora(hf, root / name, targets, rank, seed, rslora)
            for seed, (name, (targets, rank, rslora)) in enumerate(ADAPTERS.items())}
    runner = ModelRunner(EngineConfig(
        model=str(root / "base"), block_size=BLOCK, num_kv_blocks=64, enable_lora=True,
        lora_modules={name: str(root / name) for name in ADAPTERS}))
    return hf, peft, runner


def _logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def test_base_and_adapted_sequences_in_one_batch_match_their_models(served):
    """Three sequences (base, "attn", "all") run side by side: two prefill chunks each, then
    decode steps; each one's logits are its own model's."""
    hf, peft, runner = served
    models = [hf, peft["attn"], peft["all"]]
    slots = [-1, runner.lora_slot("attn"), runner.lora_slot("all")]
    tokens = [_prompt(60 + i, 11, BASE["vocab_size"]) for i in range(3)]
    tables = _shuffled_tables(6, *[-(-(11 + NUM_DECODES) // BLOCK)] * 3)
    got: list[list[torch.Tensor]] = [[], [], []]
    for start, end in ((0, 5), (5, 11)):
        step = runner.execute([SequenceChunk(t[start:end], start, table, slot)
                               for t, table, slot in zip(tokens, tables, slots)],
                              all_logits=True)
        for i in range(3):
            got[i].append(step[i * (end - start):(i + 1) * (end - start)])
    for _ in range(NUM_DECODES):
        for i in range(3):
            tokens[i].append(int(got[i][-1][-1].argmax()))
        step = runner.execute([SequenceChunk(t[-1:], len(t) - 1, table, slot)
                               for t, table, slot in zip(tokens, tables, slots)])
        for i in range(3):
            got[i].append(step[i:i + 1])
    for i, model in enumerate(models):
        diff = _max_diff(torch.cat(got[i]), _logits(model, tokens[i]))
        print(f"sequence {i}: max abs diff {diff:.2e}")
        assert diff <= ATOL
    # the adapters change the output: a base run of an adapted sequence does not match
    assert _max_diff(_logits(hf, tokens[2]), _logits(peft["all"], tokens[2])) > 100 * ATOL


def test_a_step_without_adapters_runs_the_base_model(served):
    hf, _, runner = served
    tokens = _prompt(70, 9, BASE["vocab_size"])
    (table,) = _shuffled_tables(7, -(-9 // BLOCK))
    got = runner.execute([SequenceChunk(tokens, 0, table)], all_logits=True)
    assert _max_diff(got, _logits(hf, tokens)) <= ATOL


def test_an_unknown_adapter_is_refused_by_name(served):
    _, _, runner = served
    with pytest.raises(ValueError, match="'nope' is not loaded; loaded: attn, all"):
        runner.lora_slot("nope")


def _adapter(tmp_path, hf, **config):
    build_lora(hf, tmp_path / "adapter", ("q_proj",), 4, 0)
    path = tmp_path / "adapter" / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return tmp_path / "adapter"


@pytest.mark.parametrize(("config", "message"), [
    ({"use_dora": True}, "sets use_dora"),
    ({"modules_to_save": ["lm_head"]}, "sets modules_to_save"),
    ({"r": 32}, "rank 32; --max-lora-rank is 16"),
    ({"r": 2}, "q_proj has A \\(4, 64\\)"),
])
def test_what_cannot_be_served_is_refused(tmp_path, config, message):
    hf = build("llama", tmp_path / "base")
    adapter = _adapter(tmp_path, hf, **config)
    with pytest.raises(AdapterError, match=message):
        ModelRunner(EngineConfig(model=str(tmp_path / "base"), block_size=BLOCK,
                                 num_kv_blocks=16, enable_lora=True,
                                 lora_modules={"a": str(adapter)}))


@pytest.mark.parametrize(("family", "target", "message"), [
    ("llama", "lm_head", "lm_head"),  # PEFT saves the head's base weight too
    ("deepseek_v2", "kv_b_proj", "kv_b_proj, which this engine cannot adapt"),  # absorbed
])
def test_an_adapter_on_a_module_without_lora_support_is_refused(tmp_path, family, target,
                                                                 message):
    hf = build(family, tmp_path / "base")
    build_lora(hf, tmp_path / "adapter", (target,), 4, 0)
    with pytest.raises(AdapterError, match=message):
        ModelRunner(EngineConfig(model=str(tmp_path / "base"), block_size=BLOCK,
                                 num_kv_blocks=16, enable_lora=True,
                                 lora_modules={"a": str(tmp_path / "adapter")}))


def test_lora_flags_are_checked():
    with pytest.raises(pydantic.ValidationError, match="needs --enable-lora"):
        EngineConfig(lora_modules={"a": "/x"})
    assert EngineConfig(enable_lora=True, lora_modules={"a": "/x"}, device="cuda").eager()


def test_adapters_key_their_blocks_apart():
    """vLLM keys the adapter into its block hashes: an adapter's KV is never a base hit."""
    base = make_namespace("m", None)
    assert base == make_namespace("m", None, None)
    spaces = {base, make_namespace("m", None, "a"), make_namespace("m", None, "b"),
              make_namespace("m", "a"), make_namespace("m", "a", "a")}
    assert len(spaces) == 5
