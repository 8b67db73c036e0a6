"""`pdcluster serve`: the cluster plus the gateway in this process.

Shutdown: uvicorn turns SIGINT/SIGTERM into a graceful stop of the HTTP server; then every
actor is killed and, when this process started the local Ray, Ray's processes with it, so no
descendant survives and the port is free.
"""

from __future__ import annotations

import logging
import signal

import uvicorn
from fastapi import FastAPI

from deploy.config import ServeConfig
from deploy.launcher import Cluster
from engine.config import ModelConfig
from engine.tokenizer import Tokenizer
from router.auth import APIKeyAuth, load_api_keys
from router.chat_template import ChatTemplate
from router.gateway import build_app

log = logging.getLogger(__name__)


def gateway_app(config: ServeConfig, cluster: Cluster) -> FastAPI:
    """The OpenAI gateway over a started cluster, as `pdcluster serve` runs it."""
    model_dir = config.engine.model
    max_model_len = config.engine.resolved_max_model_len(ModelConfig.from_pretrained(model_dir))
    app = build_app(cluster.pipeline, Tokenizer.from_pretrained(model_dir), config.model_name(),
                    max_model_len, ChatTemplate.from_model_dir(model_dir),
                    config.max_request_body_bytes)
    keys = load_api_keys([k.get_secret_value() for k in config.api_keys], config.api_key_file)
    if keys:
        app.add_middleware(APIKeyAuth, keys=keys)
    return app


def serve(config: ServeConfig) -> int:
    cluster = Cluster(config)
    try:
        cluster.start()
        server = uvicorn.Server(uvicorn.Config(gateway_app(config, cluster), host=config.host,
                                               port=config.port, log_level=config.log_level,
                                               lifespan="off"))
        log.info("serving %s at http://%s:%d/v1", config.model_name(), config.host, config.port)
        try:
            server.run()
        except SystemExit as exc:
            # uvicorn re-raises the SIGINT/SIGTERM it stopped on; Ray's handler (ray.init)
            # turns SIGTERM into exit(15). Either is a graceful stop: exit 0 after cleanup.
            if exc.code not in (signal.SIGTERM, signal.SIGINT):
                raise
    finally:
        cluster.shutdown()
    return 0
