"""`pdcluster serve --enable-lora --lora-modules NAME=PATH` through the real openai client, on
a tiny random Llama and two PEFT adapters, disaggregated (the prefill computes a request's
prompt with its adapter, the decode continues with it) and colocated at TP=2: greedy tokens equal PEFT's for each
adapter and transformers' for the base model, the same prompt alternating between them (an
adapter's KV blocks are never a prefix hit for the base model or another adapter, while a
model's own are), and the adapters are models of their own in /v1/models."""

from __future__ import annotations

import random
import signal

import openai
import pytest
from openai import OpenAI

from tests.models.factory import build, build_lora, reference_greedy

pytestmark = pytest.mark.slow

NEW_TOKENS = 16


@pytest.mark.parametrize("flags", [
    ["--pd-decider", "always"],
    # each rank's shard of the factors; the row-parallel layers' updates summed with theirs
    ["--colocated", "--tensor-parallel-size", "2"],
], ids=["disaggregated", "colocated-tp2"])
def test_each_adapter_serves_its_own_output(serve_process, tmp_path, flags):
    hf = build("llama", tmp_path / "base")
    models = {"base": hf,
              "attn": build_lora(hf, tmp_path / "attn", ("q_proj", "v_proj"), 4, 1),
              "mlp": build_lora(hf, tmp_path / "mlp", ("gate_proj", "up_proj", "down_proj",
                                                       "o_proj"), 8, 2)}
    proc, port, _ = serve_process(
        "--model", str(tmp_path / "base"), "--served-model-name", "base", "--num-kv-blocks",
        "256", *flags, "--enable-lora", "--lora-modules",
        f"attn={tmp_path / 'attn'}", f"mlp={tmp_path / 'mlp'}")
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        cards = {m.id: m.model_extra for m in client.models.list().data}
        assert set(cards) == {"base", "attn", "mlp"}
        assert cards["attn"]["parent"] == "base" and cards["attn"]["root"] == str(tmp_path / "attn")
        rng = random.Random(0)
        prompt = [1] + [rng.randrange(3, 512) for _ in range(44)]  # two full blocks and more
        outputs, cached = {}, []
        for name in ("base", "attn", "mlp", "base", "attn"):  # each after another's blocks
            out = client.completions.create(
                model=name, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                extra_body={"return_token_ids": True, "ignore_eos": True})
            outputs.setdefault(name, []).append(out.choices[0].model_extra["token_ids"])
            details = out.usage.prompt_tokens_details
            cached.append(details.cached_tokens if details else 0)
        # the first run of each model hits nothing of the others'; a second one its own blocks
        print("cached tokens per run:", cached)
        assert cached[:3] == [0, 0, 0] and min(cached[3:]) > 0
        for name, runs in outputs.items():
            expected = reference_greedy(models[name], prompt, NEW_TOKENS)
            assert all(run == expected for run in runs), name
        assert len({tuple(runs[0]) for runs in outputs.values()}) == 3
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="other", prompt=prompt, max_tokens=2)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
