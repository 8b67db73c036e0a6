"""Migration's resume rule (router.pipeline.resumed_request + SamplingParams.output_offset):
a request resumed after k tokens, with prompt + those k tokens as its prompt, samples exactly
the tokens the uninterrupted request samples after them — greedy, seeded, with penalties and
min_tokens — and the registry's dead-marking brings a restarted Ray actor back."""

from __future__ import annotations

import hashlib
import os
import signal
import time
from dataclasses import replace

import pytest
import torch

from pdcluster.engine.protocol import SamplingParams
from pdcluster.engine.sampler import SampleInput, sample
from pdcluster.router.pipeline import resumed_request

VOCAB = 48
EOS = frozenset({2})


def toy_logits(tokens: list[int]) -> torch.Tensor:
    """[1, VOCAB] logits that depend on the whole history (a stand-in for a model forward)."""
    digest = hashlib.sha256(repr(tokens).encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
    return torch.randn(1, VOCAB, generator=gen) * 3


def generate(prompt: list[int], params: SamplingParams, seed: int) -> list[int]:
    """The engines' loop: sample until EOS / a stop id / max_tokens (of this run's tokens)."""
    out: list[int] = []
    while len(out) < params.max_tokens:
        [(token, _)] = sample(toy_logits(prompt + out), [SampleInput(params, seed, prompt, out)],
                              EOS)
        out.append(token)
        if token in EOS or token in params.stop_token_ids:
            break
    return out


PARAMS = {
    "greedy": SamplingParams(max_tokens=24, temperature=0),
    "greedy_penalties": SamplingParams(max_tokens=24, temperature=0, presence_penalty=1.5,
                                       frequency_penalty=0.7, repetition_penalty=1.3),
    "seeded": SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, top_k=20),
    "seeded_penalties_min_tokens": SamplingParams(max_tokens=24, temperature=0.8, min_tokens=10,
                                                  frequency_penalty=1.0, presence_penalty=0.5),
}


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_resumed_request_continues_the_same_output(name):
    params, prompt, seed = PARAMS[name], [1, 7, 9, 30, 4], 1234
    full = generate(prompt, params, seed)
    assert len(full) >= 3
    for k in range(1, len(full)):
        resumed_prompt, resumed_params = resumed_request(tuple(prompt), params, full[:k])
        assert resumed_params.output_offset == k
        assert resumed_params.max_tokens == params.max_tokens - k
        assert generate(list(resumed_prompt), resumed_params, seed) == full[k:], k


def test_the_offset_is_what_keeps_seeded_sampling_on_its_stream():
    """Without output_offset the resumed request would draw from steps 0, 1, ... again."""
    params, prompt, seed = PARAMS["seeded"], [1, 7, 9, 30, 4], 99
    full = generate(prompt, params, seed)
    diverged = 0
    for k in range(1, len(full) - 1):
        resumed_prompt, resumed_params = resumed_request(tuple(prompt), params, full[:k])
        wrong = generate(list(resumed_prompt), replace(resumed_params, output_offset=0), seed)
        diverged += wrong != full[k:]
    assert diverged > 0


def test_min_tokens_and_offset_bounds():
    params = SamplingParams(max_tokens=8, min_tokens=5)
    _, resumed = resumed_request((1, 2), params, [3, 4, 5, 6, 7, 8])
    assert (resumed.max_tokens, resumed.min_tokens, resumed.output_offset) == (2, 0, 6)
    with pytest.raises(ValueError):
        SamplingParams(output_offset=-1)
    with pytest.raises(ValueError):  # more earlier output than prompt ids
        sample(toy_logits([1]), [SampleInput(replace(params, temperature=0.5, output_offset=3),
                                             1, [1, 2], [])])


@pytest.mark.slow
@pytest.mark.ray
def test_registry_marks_a_killed_actor_dead_and_takes_it_back_after_ray_restarts_it():
    from tests.real_parts import import_real_part

    ray = import_real_part("ray", "Ray")
    from pdcluster.router.registry import Instance, InstanceRegistry

    @ray.remote(max_restarts=-1, num_cpus=0)
    class Worker:
        def info(self) -> dict:
            return {"pid": os.getpid()}

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    registry = InstanceRegistry(probe_interval_s=0.1)
    try:
        handle = Worker.remote()
        pid = ray.get(handle.info.remote())["pid"]
        registry.add(Instance("decode-0", "decode", handle))
        os.kill(pid, signal.SIGKILL)
        assert registry.mark_dead("decode-0") and not registry.mark_dead("decode-0")
        assert registry.by_role("decode") == [] and registry.count("decode") == 1
        deadline = time.monotonic() + 60
        while not registry.by_role("decode"):
            assert time.monotonic() < deadline, "restarted actor did not rejoin"
            time.sleep(0.1)
        assert ray.get(handle.info.remote())["pid"] != pid
        assert (registry.deaths_total, registry.rejoins_total) == (1, 1)
        ray.kill(handle, no_restart=True)
    finally:
        registry.close()
        if started:
            ray.shutdown()
