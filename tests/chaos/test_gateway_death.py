"""A cluster outlives its gateways: `pdcluster cluster up`, two `pdcluster gateway` processes
under 16 streaming requests (8 each, through the `openai` client), and kill -9 of one gateway
mid-stream.

Only the dead gateway's streams end (its clients see a connection error); the other gateway's
complete with the outputs of a fault-free run; the workers keep their pids, and none of the
dead gateway's requests stays on them; a gateway
restarted on the same port serves an earlier prompt as a prefix hit (the workers kept their
caches); `cluster down` stops the local Ray `cluster up` started. All real processes.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.markers import starts
from tests.serve_process import free_port

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
NUM_REQUESTS = 16
MAX_TOKENS = 128
PROMPT = "Once upon a time, there was a little girl named Lily. She liked to play in the {}"
PLACES = ["park", "garden", "house", "forest", "sea", "town", "yard", "snow"]


def pdcluster(env: dict, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "pdcluster"), *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


def status(env: dict, namespace: str) -> dict:
    done = pdcluster(env, "cluster", "status", "--json", "--ray-namespace", namespace,
                     timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


class Gateway:
    def __init__(self, env: dict, namespace: str, port: int, log: Path,
                 flags: tuple[str, ...] = ()) -> None:
        self.port, self.log = port, log
        with log.open("a") as out:
            self.proc = subprocess.Popen(
                [str(BIN / "pdcluster"), "gateway", "--port", str(port), "--ray-namespace",
                 namespace, *flags], env=env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True)
        deadline = time.monotonic() + 120
        while True:
            assert self.proc.poll() is None, f"gateway exited:\n{log.read_text()[-3000:]}"
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"gateway not healthy:\n{log.read_text()[-3000:]}"
            time.sleep(0.3)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
@starts("ray", "server")
def cluster(tmp_path_factory):
    """`pdcluster cluster up` on a local Ray of its own: 2 prefill + 2 decode; down at the end."""
    state = tmp_path_factory.mktemp("state")
    env = {**os.environ, "PDCLUSTER_STATE_DIR": str(state)}
    env.pop("RAY_ADDRESS", None)
    namespace = f"pdcluster-gateways-{os.getpid()}"
    up = pdcluster(env, "cluster", "up", "--prefill-instances", "2", "--decode-instances", "2",
                   "--pd-decider", "always", "--ray-namespace", namespace, "--num-kv-blocks",
                   "256", timeout=240)
    assert up.returncode == 0, up.stdout[-2000:] + up.stderr[-3000:]
    head_pid = json.loads((state / f"{namespace}.json").read_text())["pid"]
    try:
        yield env, namespace
    finally:
        down = pdcluster(env, "cluster", "down", "--ray-namespace", namespace, timeout=120)
        assert down.returncode == 0, down.stderr[-3000:]
        assert not psutil.pid_exists(head_pid)  # the local Ray went with it


async def _stream(client, index: int, outcome: dict) -> None:
    import openai

    try:
        stream = await client.completions.create(
            model="stories260K", prompt=PROMPT.format(PLACES[index % len(PLACES)]),
            max_tokens=MAX_TOKENS, temperature=0.0 if index % 2 == 0 else 1.0,
            seed=500 + index, stream=True, extra_body={"ignore_eos": True})
        async for chunk in stream:
            outcome["text"] += chunk.choices[0].text
            outcome["chunks"] += 1
            outcome["finish"] = chunk.choices[0].finish_reason or outcome["finish"]
    except openai.APIError as exc:
        outcome["error"] = type(exc).__name__


def run_load(gateways: list[Gateway], kill: Gateway | None = None) -> list[dict]:
    """16 streams, request i through gateways[i % 2]; with `kill` (gateways[0]), kill -9 it
    once each of its streams has begun or one is half way. Each outcome notes whether it had
    finished by then."""
    import openai

    outcomes = [{"text": "", "chunks": 0, "finish": None, "error": None, "done_at_kill": False}
                for _ in range(NUM_REQUESTS)]

    async def main() -> None:
        clients = [openai.AsyncOpenAI(base_url=f"{g.url}/v1", api_key="unused",
                                      max_retries=0, timeout=120) for g in gateways]

        async def killer() -> None:
            victims = outcomes[::len(gateways)]
            # once each has begun, or one is half way (the first can end before the last
            # begins): either way one stream at least is cut mid-way
            while not (all(o["chunks"] for o in victims)
                       or any(o["chunks"] >= MAX_TOKENS // 2 for o in victims)):
                await asyncio.sleep(0.002)
            os.killpg(kill.proc.pid, signal.SIGKILL)
            for o in victims:
                o["done_at_kill"] = o["finish"] is not None

        try:
            await asyncio.gather(*(_stream(clients[i % len(clients)], i, outcomes[i])
                                   for i in range(NUM_REQUESTS)),
                                 *([killer()] if kill is not None else []))
        finally:
            for client in clients:
                await client.close()

    asyncio.run(main())
    return outcomes


def test_a_killed_gateway_costs_only_its_own_streams(cluster, tmp_path):
    env, namespace = cluster
    ports = [free_port(), free_port()]
    gateways = [Gateway(env, namespace, port, tmp_path / f"gateway-{i}.log")
                for i, port in enumerate(ports)]
    try:
        before = {w["instance"]: w["pid"] for w in status(env, namespace)["workers"]}
        assert len(before) == 4 and all(before.values())
        reference = run_load(gateways)
        assert all(o["finish"] == "length" and o["error"] is None for o in reference), reference

        faulted = run_load(gateways, kill=gateways[0])
        cut = [o for o in faulted[::2] if not o["done_at_kill"]]
        assert cut  # the kill came mid-stream
        for i, (got, want) in enumerate(zip(faulted, reference)):
            if i % 2 == 0 and not got["done_at_kill"]:  # cut: a connection error, no hang
                assert got["error"] is not None and got["finish"] is None, (i, got)
            else:
                assert (got["error"], got["finish"], got["text"]) == \
                    (None, "length", want["text"]), (i, got)

        # the workers kept their processes, and no request of the dead gateway stays on them
        deadline = time.monotonic() + 60
        while True:
            workers = status(env, namespace)["workers"]
            assert {w["instance"]: w["pid"] for w in workers} == before
            if all(w["state"] == "alive" and w["running"] == 0 and w["waiting"] == 0
                   for w in workers):
                break
            assert time.monotonic() < deadline, workers
            time.sleep(0.5)

        # a restarted gateway on the same port: an earlier prompt is a prefix hit
        gateways[0] = Gateway(env, namespace, ports[0], tmp_path / "gateway-0.log")
        response = httpx.post(f"{gateways[0].url}/v1/completions", timeout=60, json={
            "model": "stories260K", "prompt": PROMPT.format(PLACES[0]), "max_tokens": 4})
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    finally:
        for gateway in gateways:
            gateway.stop()


def prefill_requests(env: dict, namespace: str) -> dict[str, int]:
    return {w["instance"]: w["requests_total"] for w in status(env, namespace)["workers"]
            if w["role"] == "prefill"}


def burst(urls: list[str], size: int, tag: str = "") -> None:
    """`size` different prompts at once, request i through urls[i % len(urls)]. Each prompt
    opens with its index and `tag`, so that no two prompts, of one burst or of two, share a
    block: the Conductor routes them by load alone."""
    async def main() -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            responses = await asyncio.gather(*(client.post(f"{urls[i % len(urls)]}/v1/completions", json={
                "model": "stories260K", "max_tokens": 2,
                "prompt": f"{i} {tag} burst of {size}: " + PROMPT.format(PLACES[i % len(PLACES)])})
                for i in range(size)))
        assert all(r.status_code == 200 for r in responses), [r.text for r in responses]

    asyncio.run(main())


def settled(env: dict, namespace: str, gateways: list) -> None:
    """Once no prefill runs or queues a request, and every gateway answers, wait a few of the
    Conductors' report intervals (0.25 s): each burst then starts from idle reports in every
    gateway, not from what the one before left in flight."""
    deadline = time.monotonic() + 60
    while any(w["running"] or w["waiting"] for w in status(env, namespace)["workers"]
              if w["role"] == "prefill"):
        assert time.monotonic() < deadline, status(env, namespace)
        time.sleep(0.2)
    for gateway in gateways:
        assert httpx.get(f"{gateway.url}/health", timeout=30).status_code == 200
    time.sleep(2.0)


def test_two_gateways_split_a_burst_over_the_prefills_as_evenly_as_one(cluster, tmp_path):
    """Each gateway's Conductor sees the other's routing decisions as they are made
    (router.decision_board) and the prefill workers' own queue reports."""
    env, namespace = cluster
    gateways = [Gateway(env, namespace, free_port(), tmp_path / f"burst-{i}.log")
                for i in range(2)]
    try:
        spreads = {}
        for name, urls in (("one", [gateways[0].url]), ("two", [g.url for g in gateways])):
            settled(env, namespace, gateways)
            before = prefill_requests(env, namespace)
            burst(urls, 8, tag=name)  # the bursts' prompts differ: routed by load, not cache
            after = prefill_requests(env, namespace)
            counts = sorted(after[p] - before[p] for p in after)
            assert sum(counts) == 8, counts
            spreads[name] = counts[-1] - counts[0]
        assert spreads["two"] <= max(spreads["one"], 2), spreads
    finally:
        for gateway in gateways:
            gateway.stop()
