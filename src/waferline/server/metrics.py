"""Prometheus metrics of one server: requests, tokens, TTFT and inter-token latency, cache pages, queue length."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

if TYPE_CHECKING:
    from waferline.engine.loop import EngineLoop

# The status a request is counted under when its client went away before the response (nginx's 499): neither a
# success nor a server error.
DISCONNECTED = 499

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# a whole request: a long reply on a CPU takes minutes (the TTFT buckets' 60 s top left them all in +Inf)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 3600.0, 7200.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5, 5.0)


class Metrics:
    """One registry per server (several servers can live in one process, e.g. in tests)."""

    def __init__(self, engine: EngineLoop):
        self.engine = engine
        r = self.registry = CollectorRegistry()
        self.requests = Counter("waferline_requests", "HTTP requests to the API, by endpoint and status code (499: "
                                "the client disconnected first)",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("waferline_prompt_tokens", "prompt tokens of finished requests (each prompt once, "
                                     "whatever n, as usage counts them)", registry=r)
        self.generation_tokens = Counter("waferline_generation_tokens", "tokens generated", registry=r)
        self.finished = Counter(
            "waferline_request_finished", "finished choices (n per prompt) by finish reason", ["reason"], registry=r
        )
        self.ttft = Histogram("waferline_time_to_first_token_seconds", "arrival to first token", buckets=_TTFT_BUCKETS,
                              registry=r)
        self.itl = Histogram("waferline_inter_token_latency_seconds", "time between consecutive tokens of a request",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("waferline_e2e_request_latency_seconds", "arrival to last token", buckets=_E2E_BUCKETS,
                             registry=r)
        self.pages = Gauge("waferline_cache_pages_in_use", "cache pages held by live sequences, per cache kind "
                           "(mamba2: state slots; draft_*: a draft model's; mtp_*: the MTP head's)", ["kind"],
                           registry=r)
        self.cache_bytes = Gauge("waferline_cache_bytes_in_use", "cache bytes held (ModelSpec accounting)", registry=r)
        self.cache_budget = Gauge("waferline_cache_bytes_budget", "cache byte budget", registry=r)
        self.waiting = Gauge("waferline_num_requests_waiting", "requests in the queue, not yet admitted", registry=r)
        self.running = Gauge("waferline_num_requests_running", "requests being prefilled or decoded", registry=r)
        self.prefix_pages = Gauge(
            "waferline_prefix_cache_pages", "pages kept by the prefix cache (evictable)", registry=r
        )
        self.speculates = "spec_drafted" in engine.scheduler.stats  # (--speculative: the spec_* series exist only then)
        if self.speculates:
            self.spec_rate = Gauge("waferline_spec_acceptance_rate",
                                   "accepted / drafted speculative tokens since start", registry=r)
        r.register(_Totals(engine))  # (the scheduler's running totals, as counters: rate() works on them)

    def render(self) -> bytes:
        sch = self.engine.scheduler
        for kind, n in sch.cache.pages_in_use().items():
            self.pages.labels(kind).set(n)
        self.cache_bytes.set(sch.cache.used_bytes)
        self.cache_budget.set(sch.cache.budget)
        self.waiting.set(self.engine.num_waiting)
        self.running.set(self.engine.num_running)
        if sch.prefix is not None:
            self.prefix_pages.set(sch.prefix.num_pages)
        if self.speculates:
            self.spec_rate.set(sch.stats["spec_acceptance_rate"])
        return generate_latest(self.registry)


class _Totals:
    """Counts the scheduler keeps since the server started, read at each scrape: ``waferline_preemptions_total``,
    ``waferline_prefix_cache_hit_tokens_total`` and, with speculation, ``waferline_spec_draft_tokens_total`` and
    ``waferline_spec_accepted_tokens_total``."""

    def __init__(self, engine: EngineLoop):
        self.engine = engine

    def collect(self) -> Iterator[CounterMetricFamily]:
        sch = self.engine.scheduler
        rows = [("waferline_preemptions", "sequences preempted (recompute)", sch.stats["preemptions"])]
        if sch.prefix is not None:
            rows.append(("waferline_prefix_cache_hit_tokens", "prompt tokens served from the prefix cache",
                         sch.prefix.hit_tokens))
        if "spec_drafted" in sch.stats:
            rows += [("waferline_spec_draft_tokens", "speculative draft tokens verified", sch.stats["spec_drafted"]),
                     ("waferline_spec_accepted_tokens", "speculative draft tokens accepted",
                      sch.stats["spec_accepted"])]
        for name, doc, value in rows:
            yield CounterMetricFamily(name, doc, value=float(value))
