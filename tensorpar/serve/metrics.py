"""Prometheus metrics of the server, in their own registry (no process-global state)."""
from __future__ import annotations


class ServeMetrics:
    """Counters, gauges and histograms exposed at ``GET /metrics`` (Prometheus text format).

    ``tensorpar_requests_total{finish_reason}``, ``tensorpar_prompt_tokens_total``,
    ``tensorpar_generation_tokens_total``, ``tensorpar_time_to_first_token_seconds`` (arrival to first token),
    ``tensorpar_inter_token_latency_seconds``, ``tensorpar_num_requests_running``,
    ``tensorpar_num_requests_waiting``, ``tensorpar_batch_size`` (rows per step, histogram).
    """

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.requests = Counter("tensorpar_requests", "Finished requests", ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("tensorpar_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.gen_tokens = Counter("tensorpar_generation_tokens", "Tokens generated", registry=r)
        lat = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48)
        self.ttft = Histogram("tensorpar_time_to_first_token_seconds", "Request arrival to first token",
                              buckets=lat, registry=r)
        self.itl = Histogram("tensorpar_inter_token_latency_seconds", "Time between a request's tokens",
                             buckets=lat, registry=r)
        self.running = Gauge("tensorpar_num_requests_running", "Requests holding a slot", registry=r)
        self.waiting = Gauge("tensorpar_num_requests_waiting", "Requests waiting for a slot", registry=r)
        self.batch = Histogram("tensorpar_batch_size", "Rows per model step",
                               buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r)

    def queue(self, running: int, waiting: int, rows: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        if rows:
            self.batch.observe(rows)

    def token(self, req, now: float) -> None:
        self.gen_tokens.inc()
        if not req.out:
            self.prompt_tokens.inc(len(req.prompt))
            self.ttft.observe(now - req.arrived)
        else:
            self.itl.observe(now - req.last_t)

    def finished(self, req, reason: str) -> None:
        self.requests.labels(finish_reason=reason).inc()

    def render(self) -> bytes:
        from prometheus_client import generate_latest
        return generate_latest(self.registry)
