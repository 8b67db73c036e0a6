"""`pdcluster serve`: the cluster plus the gateway in this process.

Shutdown: uvicorn turns SIGINT/SIGTERM into a graceful stop of the HTTP server; then every
actor is killed and, when this process started the local Ray, Ray's processes with it, so no
descendant survives and the port is free.
"""

from __future__ import annotations

import logging

import uvicorn

from deploy.config import ServeConfig
from deploy.launcher import Cluster
from engine.config import ModelConfig
from engine.tokenizer import Tokenizer
from router.gateway import build_app

log = logging.getLogger(__name__)


def serve(config: ServeConfig) -> int:
    model_config = ModelConfig.from_pretrained(config.engine.model)
    tokenizer = Tokenizer.from_pretrained(config.engine.model)
    max_model_len = config.engine.resolved_max_model_len(model_config)
    cluster = Cluster(config)
    try:
        cluster.start()
        app = build_app(cluster.pipeline, tokenizer, config.model_name(), max_model_len)
        server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port,
                                               log_level=config.log_level, lifespan="off"))
        log.info("serving %s at http://%s:%d/v1", config.model_name(), config.host, config.port)
        server.run()
    finally:
        cluster.shutdown()
    return 0
