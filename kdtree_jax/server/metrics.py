"""Prometheus metrics of the server, named as vLLM names them (its "vllm:" prefix is "kdtree:" here).

Gauges read the serving front's engine statistics when scraped (where the engine runs in its own process, the
snapshot it sends with each step); counters and histograms are fed by the request handlers: tokens as they arrive,
the rest once a request's final record is in. No `_created` series: prometheus_client would add one per counter and
histogram (the time it was created, an OpenMetrics notion), a second series per counter that no query of these
metrics uses.
"""
from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily

PREFIX = "kdtree:"
# vLLM's buckets (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    """One registry per server (not the process-wide default), so several servers can live in one process."""

    def __init__(self, front, model_name: str, speculative: bool = True):
        disable_created_metrics()  # prometheus_client's switch is process-wide: it reads it at every scrape
        self.registry = CollectorRegistry()
        reg, labels = self.registry, {"model_name": model_name}

        def gauge(name, doc, read):
            Gauge(PREFIX + name, doc, labelnames=tuple(labels), registry=reg).labels(**labels).set_function(read)

        def counter(name, doc):
            return Counter(PREFIX + name, doc, labelnames=tuple(labels), registry=reg).labels(**labels)

        def histogram(name, doc, buckets):
            return Histogram(PREFIX + name, doc, labelnames=tuple(labels), buckets=buckets,
                             registry=reg).labels(**labels)

        slots = front.config.max_slots
        gauge("num_requests_running", "Requests prefilling or decoding.", lambda: front.n_running)
        gauge("num_requests_waiting", "Requests waiting for pages or a slot (preempted ones included).",
              lambda: front.n_waiting)
        gauge("num_slots_free", "Slots free for a waiting request.", lambda: slots - front.n_running)
        gauge("kv_cache_usage_perc", "Share of the page pool held by requests (1 = full).",
              lambda: front.stats().kv_cache_usage)
        gauge("num_free_pages", "Pages of the pool no request holds.", lambda: front.stats().free_pages)
        gauge("kv_cache_pool_bytes", "Bytes of the page pools on the device (every layer, target and drafter).",
              lambda: front.stats().pool_bytes)
        reg.register(_EngineCounter(PREFIX + "num_preemptions", "Requests preempted: pages given back, recomputed.",
                                    lambda: front.stats().num_preemptions, labels))
        reg.register(_EngineCounter(PREFIX + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache, "
                                    "once per request at its first admission (a preempted request's recomputation "
                                    "is not counted again).", lambda: front.stats().prefix_cache_queries, labels))
        reg.register(_EngineCounter(PREFIX + "prefix_cache_hits", "Prompt tokens found in the prefix cache at a "
                                    "request's first admission (not prefilled).",
                                    lambda: front.stats().prefix_cache_hits, labels))
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of the requests submitted.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        # Speculative counts exist only where rounds verify drafts: without speculation (mode ar) a step is not a
        # draft, so none are listed, as vLLM lists none without a speculative config.
        self.speculative = speculative
        if speculative:
            self.num_drafts = counter("spec_decode_num_drafts", "Speculative rounds (one draft verified each).")
            self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "Tokens drafted and verified.")
            self.num_accepted_tokens = counter("spec_decode_num_accepted_tokens",
                                               "Drafted tokens the target accepted.")
        self._success = Counter(PREFIX + "request_success", "Requests finished, by finish reason.",
                                labelnames=(*labels, "finished_reason"), registry=reg)
        self._labels = labels
        self.ttft = histogram("time_to_first_token_seconds", "Request arrival to its first token.", TTFT_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds", "Mean time per token after the first, per request.",
                              TPOT_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Request arrival to its last token.", LATENCY_BUCKETS)

    def finished(self, record, arrival: float, finish_reason: str) -> None:
        """A request's final record is in; `arrival` is when the server received it (perf_counter)."""
        if self.speculative:
            self.num_drafts.inc(record.rounds)
            self.num_draft_tokens.inc(record.num_draft_tokens)
            self.num_accepted_tokens.inc(record.num_accepted_tokens)
        self._success.labels(**self._labels, finished_reason=finish_reason).inc()
        if record.first_token_time is None:
            return
        self.ttft.observe(record.first_token_time - arrival)
        self.e2e.observe(record.finish_time - arrival)
        n = len(record.token_ids)
        if n > 1:
            self.tpot.observe((record.finish_time - record.first_token_time) / (n - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCounter:
    """A counter the serving engine keeps itself (it counts where it runs; a scrape reads the front's snapshot)."""

    def __init__(self, name: str, doc: str, read, labels: dict):
        self._name, self._doc, self._read, self._labels = name, doc, read, labels

    def collect(self):
        family = CounterMetricFamily(self._name, self._doc, labels=list(self._labels))
        family.add_metric(list(self._labels.values()), self._read())
        yield family
