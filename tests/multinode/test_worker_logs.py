"""`--log-format json` reaches the worker actors: each worker process logs one
JSON object per line, and records about a request carry its id.

Reads the prefill worker's own stderr log file in the Ray session directory (found by its pid).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
import ray

from pdcluster.deploy.config import ServeConfig
from pdcluster.engine.protocol import SamplingParams

pytestmark = pytest.mark.slow


def worker_log(pid: int) -> Path:
    logs = Path(ray._private.worker.global_worker.node.get_logs_dir_path())
    [path] = logs.glob(f"worker-*-{pid}.err")
    return path


def json_records(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))  # every line the formatter wrote must parse
    return out


def test_worker_records_are_json_with_request_ids(local_cluster):
    config = ServeConfig(pd_decider="always",
                         ray_namespace="pdc-logs", log_format="json", log_level="debug")
    with local_cluster(config) as cluster:
        async def run():
            params = SamplingParams(max_tokens=3, temperature=0)
            return [d async for d in cluster.pipeline.generate("logs-req-1", [1, 403, 407, 8],
                                                               params)]

        assert asyncio.run(run())[-1].finish_reason is not None
        pid = ray.get(cluster.prefill[0].handle.info.remote())["pid"]
        path = worker_log(pid)
        deadline = time.monotonic() + 15
        while True:
            mine = [r for r in json_records(path) if r.get("request_id") == "logs-req-1"]
            if mine or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert mine, path.read_text()[-2000:]
        record = mine[0]
        assert record["logger"] == "pdcluster.engine.core.engine_core" and record["level"] == "DEBUG"
        assert "prefill of 4 tokens" in record["message"]
        assert record["timestamp"].endswith("Z")
