"""GET /metrics in Prometheus' text format. The names are vLLM's (``vllm:`` prefix), so the
dashboards and benchmark scripts written for a vLLM server read this one unchanged. Engine
figures are read from the engine's latest stats snapshot at each scrape; latencies are observed
when a request finishes, but the inter-token latency, which the engine measures a step at a time
for every request (streamed or not) and sends with the step's outputs."""
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pagoda.engine.async_llm import AsyncLLM
from pagoda.outputs import RequestOutput

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
        self.success = Counter("vllm:request_success", "Finished requests.", label + ["finished_reason"],
                               registry=self.registry)
        self.registry.register(_EngineCollector(engine, model_name))

    def observe_finished(self, out: RequestOutput, num_tokens: int) -> None:
        """``num_tokens``: the longest sample's length (a streamed output holds only the last delta)."""
        m = out.metrics
        if m is not None and m.first_token_time is not None:
            self.ttft.labels(self.model_name).observe(m.first_token_time - m.arrival_time)
            self.e2e.labels(self.model_name).observe(m.last_token_time - m.arrival_time)
            if num_tokens > 1:
                self.tpot.labels(self.model_name).observe(
                    (m.last_token_time - m.first_token_time) / (num_tokens - 1))
        for c in out.outputs:
            self.success.labels(self.model_name, c.finish_reason or "abort").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
