"""`pdcluster serve`: the cluster plus the gateway in this process; `pdcluster gateway`: the
gateway alone, attached to a running cluster (deploy/cluster_cli.py).

Shutdown (SIGTERM, or a first Ctrl-C) drains:

1. the gateway stops admitting: new requests get 503 + Retry-After (reason "draining") and
   /health answers 503 {"status": "draining"}, while the listening socket stays open;
2. requests in flight get `drain_timeout_s` to finish;
3. those still running then end with an explicit error event (SSE `data: {"error": …}` then
   `[DONE]`; a non-streamed request gets a 503 body), which aborts them on their workers;
4. uvicorn closes its connections, every actor is killed and, when this process started the
   local Ray, Ray's processes with it, so no descendant survives and the port is free (an
   attached gateway only leaves the cluster: its workers serve on).

A second signal during the drain stops at once (step 4).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from types import FrameType

import uvicorn
from fastapi import FastAPI

from pdcluster.deploy.autoscaler import Autoscaler
from pdcluster.deploy.config import ServeConfig
from pdcluster.deploy.http_protocol import gateway_protocol
from pdcluster.deploy.launcher import Cluster
from pdcluster.deploy.ray_session import RaySession
from pdcluster.engine.model_config import ModelConfig
from pdcluster.engine.tokenizer import Tokenizer
from pdcluster.router.auth import APIKeyAuth, load_api_keys
from pdcluster.router.chat_template import ChatTemplate
from pdcluster.router.gateway import build_app
from pdcluster.router.inflight import InflightGate
from pdcluster.router.reasoning import ReasoningParser
from pdcluster.router.serving import GenerationService
from pdcluster.router.tool_calls import ToolCalling

log = logging.getLogger(__name__)

#: After the drain deadline: how long the error events get to reach their clients.
ABORT_FLUSH_S = 5.0
#: uvicorn's own bound on closing connections once the drain is over.
CLOSE_CONNECTIONS_S = 5.0


def gateway_app(config: ServeConfig, cluster: Cluster) -> FastAPI:
    """The OpenAI gateway over a started cluster, as `pdcluster serve` runs it."""
    model_dir = config.engine.model
    model = ModelConfig.from_pretrained(model_dir)
    max_model_len = config.engine.resolved_max_model_len(model)
    app = build_app(cluster.pipeline, Tokenizer.from_pretrained(model_dir), config.model_name(),
                    max_model_len, ChatTemplate.from_model_dir(model_dir),
                    config.max_request_body_bytes,
                    InflightGate(config.max_inflight_requests,
                                 config.resolved_max_queued_sequences()),
                    config.resolved_max_seqs_per_request(),
                    ToolCalling(config.tool_call_parser, config.enable_auto_tool_choice),
                    lambda: _health(cluster, app), frozenset(model.eos_token_ids),
                    ReasoningParser(config.reasoning_parser) if config.reasoning_parser else None,
                    priority_scheduling=config.engine.scheduling_policy == "priority",
                    lora_modules=config.engine.lora_modules)
    keys = load_api_keys([k.get_secret_value() for k in config.api_keys], config.api_key_file)
    if keys:
        app.add_middleware(APIKeyAuth, keys=keys)
    return app


def _health(cluster: Cluster, app: FastAPI) -> dict:
    """/health's worker part, with the autoscaler's state when one runs."""
    out = cluster.worker_health()
    autoscaler = getattr(app.state, "autoscaler", None)
    if autoscaler is not None:
        out["autoscale"] = autoscaler.state()
    return out


async def drain(service: GenerationService, timeout_s: float) -> None:
    """Steps 1-3 above: refuse new requests, wait up to `timeout_s` for the in-flight ones,
    then end the rest with an error event and wait (at most ABORT_FLUSH_S) for them to go."""
    gate = service.gate
    gate.start_draining()
    log.info("draining: %d sequence(s) in flight, %.1f s to finish", gate.inflight, timeout_s)
    if await gate.wait_idle(timeout_s):
        log.info("drained: every in-flight request finished")
        return
    aborted = service.abort_all(f"the server shut down; the request did not finish within "
                                f"the {timeout_s:g} s drain timeout")
    log.warning("drain timeout: ended %d stream(s) with an error event", aborted)
    await gate.wait_idle(ABORT_FLUSH_S)


class DrainingServer(uvicorn.Server):
    """uvicorn, with its exit signals turned into a drain of `service` first."""

    def __init__(self, config: uvicorn.Config, service: GenerationService,
                 drain_timeout_s: float) -> None:
        super().__init__(config)
        self.service = service
        self.drain_timeout_s = drain_timeout_s
        self._drain_requested = False
        self._drain_task: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_requested:  # a second signal: stop now
            super().handle_exit(sig, frame)
            self.force_exit = True
            return
        self._drain_requested = True
        self._captured_signals.append(sig)  # re-raised by uvicorn once the server is down

    async def on_tick(self, counter: int) -> bool:
        if self._drain_requested and self._drain_task is None:
            self._drain_task = asyncio.create_task(self._drain_then_exit())
        return await super().on_tick(counter)

    async def _drain_then_exit(self) -> None:
        try:
            await drain(self.service, self.drain_timeout_s)
        finally:
            self.should_exit = True


def serve(config: ServeConfig, ray_session: RaySession | None = None) -> int:
    """Run the deployment of `config` until SIGINT/SIGTERM; 0 after a graceful stop.
    `ray_session`: the Ray to run on, opened already (closed at the end); None: opened here."""
    cluster = Cluster(config, ray_session)
    try:
        cluster.start()
    except BaseException:
        cluster.shutdown()
        raise
    return serve_gateway(config, cluster)


def serve_gateway(config: ServeConfig, cluster: Cluster) -> int:
    """Serve the gateway over `cluster` (started, or attached: `pdcluster gateway`) until
    SIGINT/SIGTERM, then drain and shut `cluster` down (an attached one leaves its workers
    running); 0 after a graceful stop. With --autoscale, this gateway runs the autoscaler
    (deploy.autoscaler): one gateway of a cluster should."""
    autoscaler = None
    try:
        app = gateway_app(config, cluster)
        if config.autoscale is not None:
            autoscaler = app.state.autoscaler = Autoscaler(cluster,
                                                           app.state.service.metrics).start()
        # text: uvicorn's own log config; json: uvicorn's loggers go through the root handler
        log_config = uvicorn.config.LOGGING_CONFIG if config.log_format == "text" else None
        server = DrainingServer(
            uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                           lifespan="off", log_config=log_config,
                           timeout_graceful_shutdown=CLOSE_CONNECTIONS_S,
                           timeout_keep_alive=config.keep_alive_timeout_s,
                           http=gateway_protocol(config.header_timeout_s,
                                                 config.body_timeout_s,
                                                 config.resolved_max_connections())),
            app.state.service, config.drain_timeout_s)
        log.info("serving %s at http://%s:%d/v1", config.model_name(), config.host, config.port)
        try:
            server.run()
        except SystemExit as exc:
            # uvicorn re-raises the SIGINT/SIGTERM it stopped on; Ray's handler (ray.init)
            # turns SIGTERM into exit(15). Either is a graceful stop: exit 0 after cleanup.
            if exc.code not in (signal.SIGTERM, signal.SIGINT):
                raise
        except KeyboardInterrupt:  # the same SIGINT, re-raised where Python's default handler
            pass                   # is in place: Ctrl-C after a drain is a graceful stop too
    finally:
        if autoscaler is not None:
            autoscaler.stop()
        cluster.shutdown()
    return 0
