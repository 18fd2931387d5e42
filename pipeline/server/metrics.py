"""The server's Prometheus metrics (``GET /metrics``), in a registry of its own.

Padding efficiency of live traffic, per bucket:
    real / (real + padding)  from  inf2_serve_bucket_tokens_total{bucket, kind}
where a batch in bucket (B, S) holds B × S token positions and its real tokens are the
positions its requests used (prompt + generated tokens, as ``tokens_needed`` counts them).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pipeline.plan.buckets import Bucket

# Seconds: tiny cpu models answer in milliseconds, big ones on a slow device in minutes.
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_PER_TOKEN = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "inf2_serve_requests",
            "Completion requests by outcome (ok, invalid, too_long, queue_full, not_ready, "
            "disconnected, error)",
            ["outcome"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "inf2_serve_prompt_tokens", "Prompt tokens of admitted requests", registry=r
        )
        self.completion_tokens = Counter(
            "inf2_serve_completion_tokens", "Tokens sent back to clients", registry=r
        )
        self.batches = Counter(
            "inf2_serve_batches", "Batches run, by bucket", ["bucket"], registry=r
        )
        self.batch_rows = Counter(
            "inf2_serve_batch_rows", "Requests run, by bucket (rows used)", ["bucket"], registry=r
        )
        self.bucket_tokens = Counter(
            "inf2_serve_bucket_tokens",
            "Token positions of the buckets run: kind=real (used by requests) or padding",
            ["bucket", "kind"],
            registry=r,
        )
        self.queue_depth = Gauge(
            "inf2_serve_queue_depth", "Requests waiting to be batched", registry=r
        )
        self.in_flight = Gauge(
            "inf2_serve_in_flight", "Requests admitted and not yet answered", registry=r
        )
        self.ready = Gauge("inf2_serve_ready", "1 once the release is loaded and warm", registry=r)
        self.ttft = Histogram(
            "inf2_serve_time_to_first_token_seconds",
            "Arrival to first token",
            buckets=_LATENCY,
            registry=r,
        )
        self.tpot = Histogram(
            "inf2_serve_time_per_output_token_seconds",
            "After the first token, seconds per further output token",
            buckets=_PER_TOKEN,
            registry=r,
        )
        self.latency = Histogram(
            "inf2_serve_request_duration_seconds",
            "Arrival to the last token",
            buckets=_LATENCY,
            registry=r,
        )

    def batch(self, bucket: Bucket, rows: int, real: int) -> None:
        self.batches.labels(bucket.name).inc()
        self.batch_rows.labels(bucket.name).inc(rows)
        self.bucket_tokens.labels(bucket.name, "real").inc(real)
        self.bucket_tokens.labels(bucket.name, "padding").inc(bucket.tokens - real)

    def finished(self, arrival: float, first: float | None, end: float, tokens: int) -> None:
        self.latency.observe(end - arrival)
        if first is not None:
            self.ttft.observe(first - arrival)
            if tokens > 1:
                self.tpot.observe((end - first) / (tokens - 1))
