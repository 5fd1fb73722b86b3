"""Prometheus metrics of the server, in their own registry (no process-global state)."""
from __future__ import annotations


class ServeMetrics:
    """Counters, gauges and histograms exposed at ``GET /metrics`` (Prometheus text format).

    ``tensorpar_requests_total{finish_reason}``, ``tensorpar_prompt_tokens_total``,
    ``tensorpar_generation_tokens_total``, ``tensorpar_time_to_first_token_seconds`` (arrival to first token),
    ``tensorpar_inter_token_latency_seconds``, ``tensorpar_num_requests_running``,
    ``tensorpar_num_requests_waiting``, ``tensorpar_batch_size`` (rows per step, histogram); the KV block pool:
    ``tensorpar_kv_blocks_total``, ``tensorpar_kv_blocks_used`` (held by requests), ``tensorpar_kv_cache_usage``
    (their fraction), ``tensorpar_kv_blocks_cached`` (prefix-cached, reusable, evictable),
    ``tensorpar_num_preemptions_total``; prefix caching: ``tensorpar_prefix_cache_queries_total`` (prompt tokens
    looked up), ``tensorpar_prefix_cache_hits_total`` (of them found cached), ``tensorpar_prefix_cache_hit_rate``.
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
        self.blocks_total = Gauge("tensorpar_kv_blocks_total", "KV cache blocks in the pool", registry=r)
        self.blocks_used = Gauge("tensorpar_kv_blocks_used", "KV cache blocks held by requests", registry=r)
        self.usage = Gauge("tensorpar_kv_cache_usage", "Fraction of the KV blocks held by requests", registry=r)
        self.blocks_cached = Gauge("tensorpar_kv_blocks_cached", "Prefix-cached KV blocks no request holds",
                                   registry=r)
        self.preemptions = Counter("tensorpar_num_preemptions", "Requests preempted (recomputed later)", registry=r)
        self.prefix_queries = Counter("tensorpar_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      registry=r)
        self.prefix_hits = Counter("tensorpar_prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                   registry=r)
        self.hit_rate = Gauge("tensorpar_prefix_cache_hit_rate", "Prefix cache hits / queries (prompt tokens)",
                              registry=r)
        self._seen = (0, 0)

    def queue(self, running: int, waiting: int, rows: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        if rows:
            self.batch.observe(rows)

    def blocks(self, alloc) -> None:
        """The pool's state from rank 0's :class:`~tensorpar.serve.blocks.BlockAllocator`."""
        self.blocks_total.set(alloc.num_blocks)
        self.blocks_used.set(alloc.used())
        self.usage.set(alloc.used() / alloc.num_blocks)
        self.blocks_cached.set(len(alloc.lru))
        q, h = alloc.queries, alloc.hits
        if (q, h) != self._seen:
            self.prefix_queries.inc(q - self._seen[0])
            self.prefix_hits.inc(h - self._seen[1])
            self._seen = (q, h)
        self.hit_rate.set(h / q if q else 0.0)

    def preempted(self) -> None:
        self.preemptions.inc()

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
