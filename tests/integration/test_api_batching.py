"""Batching invariance: concurrent requests return exactly what each returns alone."""

from __future__ import annotations

import asyncio

import pytest
import ray
from openai import AsyncOpenAI

pytestmark = pytest.mark.slow

MODEL = "stories260K"
PROMPTS = ["Once upon a time", "The cat sat", "Lily and Ben", "One day, a big dog",
           "Tom had a red ball", "The sun was hot", "Sue liked to sing", "A little bird"]


def request(i: int) -> dict:
    """16 different requests: prompts, lengths, temperatures, top_p/top_k, penalties, seeds."""
    return dict(prompt=PROMPTS[i % 8] + (" and" if i >= 8 else ""), max_tokens=40 + 7 * i,
                temperature=[0.0, 0.7, 1.0, 1.3][i % 4], top_p=[1.0, 0.9][i % 2], seed=1000 + i,
                extra_body={"top_k": [0, 20, 50, 0][i % 4], "ignore_eos": True,
                            "repetition_penalty": [1.0, 1.1][i // 8], "return_token_ids": True})


async def stream_ids(client: AsyncOpenAI, i: int) -> list[int]:
    ids: list[int] = []
    async for chunk in await client.completions.create(model=MODEL, stream=True, **request(i)):
        ids += chunk.choices[0].model_extra["token_ids"]
    return ids


def test_sixteen_concurrent_streams_equal_their_solo_runs(api_base, cluster):
    async def run():
        client = AsyncOpenAI(base_url=api_base, api_key="unused", max_retries=0)
        solo = [await stream_ids(client, i) for i in range(16)]
        decode = cluster.decode[0].handle
        steps_before = ray.get(decode.stats.remote()).num_steps_total
        together = await asyncio.gather(*(stream_ids(client, i) for i in range(16)))
        return solo, together, steps_before

    solo, together, steps_before = asyncio.run(run())
    for i in range(16):
        assert len(solo[i]) == 40 + 7 * i
        assert together[i] == solo[i], f"request {i} changed when batched"

    log = [ids for step, ids in ray.get(cluster.decode[0].handle.step_log.remote())
           if step > steps_before]
    assert max(len(ids) for ids in log) >= 8
    joined_mid_flight = [cur for prev, cur in zip(log, log[1:])
                         if set(prev) & set(cur) and set(cur) - set(prev)]
    assert joined_mid_flight, "no request joined a running batch"
