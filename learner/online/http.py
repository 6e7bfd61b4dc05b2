"""The learner's own small HTTP endpoint: GET /health and GET /metrics (Prometheus).

Bound to 127.0.0.1 by default; served by uvicorn in a background thread so the training loop
stays in the main thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import uvicorn
from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


def build_app(registry: CollectorRegistry, health: Callable[[], dict]) -> FastAPI:
    app = FastAPI(title="codraft learner", docs_url=None, redoc_url=None)

    @app.get("/health")
    def _health() -> dict:
        return health()

    @app.get("/metrics")
    def _metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


class HttpThread:
    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 9100) -> None:
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="codraft-http", daemon=True)

    def start(self) -> HttpThread:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)
