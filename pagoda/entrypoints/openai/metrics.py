"""GET /metrics in Prometheus' text format. The names are vLLM's (``vllm:`` prefix), so the
dashboards and benchmark scripts written for a vLLM server read this one unchanged. Engine
figures are read from the engine's latest stats snapshot at each scrape; latencies come from the
engine core, which measures them for every request (streamed or not): the inter-token latency a
step at a time, the others when a request finishes. Every API server gets them all, so with
several (``--api-server-count``) whichever answers a scrape describes the whole engine."""
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pagoda.engine.async_llm import AsyncLLM

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0)

# (vLLM's name, help, EngineStats field or property)
_GAUGES = [
    ("vllm:num_requests_running", "Sequences being generated (one per sample).", "num_running"),
    ("vllm:num_requests_waiting", "Sequences waiting to be scheduled.", "num_waiting"),
    ("vllm:kv_cache_usage_perc", "KV-cache usage: 1 means every block in use.", "kv_cache_usage"),
]
_COUNTERS = [
    ("vllm:prompt_tokens", "Prompt tokens admitted (n samples count n times).", "num_prompt_tokens"),
    ("vllm:generation_tokens", "Tokens generated.", "num_generation_tokens"),
    ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "prefix_cache_queries"),
    ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
    ("vllm:num_preemptions", "Preemptions (requests recomputed for lack of KV blocks).", "num_preemptions"),
    ("vllm:spec_decode_num_drafts", "Speculative decoding: a request's steps with drafts.", "num_drafts"),
    ("vllm:spec_decode_num_draft_tokens", "Speculative decoding: draft tokens checked.", "num_draft_tokens"),
    ("vllm:spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens kept.", "num_accepted_tokens"),
]


class _EngineCollector:
    def __init__(self, engine: AsyncLLM, model_name: str):
        self.engine = engine
        self.model_name = model_name

    def collect(self):
        stats = self.engine.stats
        for name, doc, attr in _GAUGES:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([self.model_name], getattr(stats, attr))
            yield g
        for name, doc, attr in _COUNTERS:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([self.model_name], getattr(stats, attr))
            yield c


class ServerMetrics:
    def __init__(self, engine: AsyncLLM, model_name: str):
        # One registry per server, not the global one, so several apps can live in one process.
        self.registry = CollectorRegistry()
        self.model_name = model_name
        label = ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", label,
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("vllm:request_time_per_output_token_seconds",
                              "Mean time between a request's output tokens.", label,
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to last token.", label,
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("vllm:inter_token_latency_seconds",
                             "Time between a request's consecutive tokens (a step's, as the engine gave them).", label,
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        engine.itl_observers.append(self.itl.labels(model_name).observe)
        engine.done_observers.append(self.observe_finished)
        self.success = Counter("vllm:request_success", "Finished requests.", label + ["finished_reason"],
                               registry=self.registry)
        self.registry.register(_EngineCollector(engine, model_name))

    def observe_finished(self, finished: tuple) -> None:
        """A finished request's (arrival, first token, last token times, its longest sample's
        tokens, each sample's finish reason), from the engine core."""
        arrival, first_token, last_token, num_tokens, reasons = finished
        if first_token is not None:
            self.ttft.labels(self.model_name).observe(first_token - arrival)
            self.e2e.labels(self.model_name).observe(last_token - arrival)
            if num_tokens > 1:
                self.tpot.labels(self.model_name).observe((last_token - first_token) / (num_tokens - 1))
        for reason in reasons:
            self.success.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
