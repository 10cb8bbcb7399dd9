"""Prometheus metrics of one engine (own registry, so several engines - e.g. in tests - never collide)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class EngineMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("moebox_requests", "Requests received by the HTTP server", ["endpoint"], registry=r)
        self.finished = Counter("moebox_requests_finished", "Requests finished, by reason", ["reason"], registry=r)
        self.rejected = Counter("moebox_requests_rejected", "Requests refused because the queue was full",
                                registry=r)
        self.prompt_tokens = Counter("moebox_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generation_tokens = Counter("moebox_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("moebox_time_to_first_token_seconds", "Arrival to first generated token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("moebox_inter_token_latency_seconds", "Time between two tokens of a request",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.waiting = Gauge("moebox_requests_waiting", "Requests queued for a cache slot", registry=r)
        self.running = Gauge("moebox_requests_running", "Requests holding a cache slot", registry=r)
        self.spec_steps = Counter("moebox_spec_verify_steps", "Decode steps that verified MTP drafts", registry=r)
        self.spec_drafted = Counter("moebox_spec_draft_tokens", "MTP draft tokens verified", registry=r)
        self.spec_accepted = Counter("moebox_spec_accepted_tokens", "MTP draft tokens accepted", registry=r)
        self.spec_accepted_at = Counter("moebox_spec_accepted_at_position", "Drafts accepted, by draft position",
                                        ["position"], registry=r)
        self.cache_usage = Gauge("moebox_cache_usage", "Fraction of cache slots in use", registry=r)

    def spec_counts(self) -> tuple[float, float, float]:
        """(verify steps, drafted tokens, accepted tokens) so far."""
        return tuple(c._value.get() for c in (self.spec_steps, self.spec_drafted, self.spec_accepted))  # type: ignore

    def render(self) -> bytes:
        return generate_latest(self.registry)
