"""The gateway's Prometheus metrics, per endpoint, served on its own ``/metrics``.

Measured as ASGI middleware around the whole app: a request's status is the
one it was answered with, and its duration runs until its last byte left (a
streamed answer's included), which is what a client waits for. With several
worker processes (``--workers``), each writes its values under
``$PROMETHEUS_MULTIPROC_DIR`` and ``/metrics`` adds them up, whichever worker
answers it.
"""

from __future__ import annotations

import os
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

ENDPOINTS = ("/v1/images/generations", "/v1/images/edits", "/v1/chat/completions", "/v1/completions", "/v1/responses",
             "/v1/models", "/v1/videos", "/v1/audio/speech", "/health")
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class GatewayMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter("omni_gateway_requests", "Requests answered by the OpenAI gateway, by endpoint "
                                "and HTTP status", ["endpoint", "status"], registry=self.registry)
        self.errors = Counter("omni_gateway_errors", "Requests the OpenAI gateway answered with an error "
                              "(4xx or 5xx), by endpoint and OpenAI error type", ["endpoint", "type"],
                              registry=self.registry)
        self.duration = Histogram("omni_gateway_request_duration_seconds", "From a request's arrival to its "
                                  "answer's last byte, by endpoint", ["endpoint"], buckets=BUCKETS,
                                  registry=self.registry)
        self.in_flight = Gauge("omni_gateway_requests_in_flight", "Requests the OpenAI gateway is answering",
                               ["endpoint"], registry=self.registry, multiprocess_mode="livesum")

    def exposition(self) -> bytes:
        """The text ``/metrics`` serves: every worker's values, added up."""
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            registry = CollectorRegistry()
            MultiProcessCollector(registry)
            return generate_latest(registry)
        return generate_latest(self.registry)

    def middleware(self, app):
        async def measured(scope, receive, send):
            if scope["type"] != "http":
                return await app(scope, receive, send)
            endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"
            for collection in ("/v1/models", "/v1/videos"):  # one label for a collection and its members
                if scope["path"].startswith(collection + "/"):
                    endpoint = collection
            started, status = time.monotonic(), [500]

            async def send_and_note(message):
                if message["type"] == "http.response.start":
                    status[0] = message["status"]
                await send(message)

            self.in_flight.labels(endpoint).inc()
            try:
                await app(scope, receive, send_and_note)
            finally:
                # counted before it leaves the in-flight gauge: a scrape never sees it in neither
                self.requests.labels(endpoint, str(status[0])).inc()
                self.duration.labels(endpoint).observe(time.monotonic() - started)
                self.in_flight.labels(endpoint).dec()
        return measured

    def error(self, endpoint: str, error_type: str) -> None:
        self.errors.labels(endpoint if endpoint in ENDPOINTS else "other", error_type).inc()
