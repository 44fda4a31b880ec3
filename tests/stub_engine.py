"""A stand-in for LLMEngine: what the engine core, AsyncLLM and the server's routes ask of one,
with one token a step for each request and no model. Shared by the engine-core and tool-call
tests and by the server benchmark's stand-in (benchmarks/fake_engine.py)."""
import time
import types

from pagoda.engine.stats import EngineStats
from pagoda.outputs import CompletionOutput, RequestMetrics, RequestOutput


class StubEngine:
    """One token a step for each request (token = its count so far); ``fail_at``: the step
    number that raises; ``step_s``: how long a step takes. Subclasses answer otherwise
    (``_output``)."""

    def __init__(self, fail_at: int | None = None, step_s: float = 0.0, tokenizer=None, max_model_len: int = 64):
        self.fail_at, self.step_s = fail_at, step_s
        self.running: dict[str, list] = {}      # request id -> [prompt, params, steps run]
        self.times: dict[str, list] = {}        # request id -> [arrival, first token] (its metrics)
        self.aborted: list[str] = []
        self.steps = 0
        self.last_step_time: float | None = None
        self.latencies: list[float] = []       # inter-token latencies not taken yet
        self.tokenizer = tokenizer
        self.config = types.SimpleNamespace(
            model=types.SimpleNamespace(model="stub", path="stub", sampling_defaults={}),
            scheduler=types.SimpleNamespace(max_model_len=max_model_len))

    @property
    def stats(self) -> EngineStats:
        return EngineStats(num_steps=self.steps, num_running=len(self.running))

    def add_request(self, request_id, prompt, params, priority=0, lora_request=None):
        if not self.prompt_token_ids(prompt):
            raise ValueError("The prompt is empty.")
        self.running[request_id] = [prompt, params, 0]
        self.times[request_id] = [time.time(), None]

    def abort_request(self, request_ids):
        for r in request_ids:
            self.aborted.append(r)
            self.running.pop(r, None)
            self.times.pop(r, None)

    def has_unfinished_requests(self):
        return bool(self.running)

    def prompt_token_ids(self, prompt):
        return list(prompt["prompt_token_ids"] if isinstance(prompt, dict) else prompt)

    def step(self):
        self.steps += 1
        time.sleep(self.step_s)
        if self.steps == self.fail_at:
            raise RuntimeError("device lost")
        outs, now = [], time.monotonic()
        for rid, state in list(self.running.items()):
            if state[2]:
                self.latencies.append(now - self.last_step_time)
            state[2] += 1
            out = self._output(rid, *state)
            times = self.times[rid]
            times[1] = times[1] or time.time()
            if out is not None:
                outs.append(out)
                if out.finished:
                    del self.running[rid], self.times[rid]
                    out.metrics = out.metrics or RequestMetrics(times[0], first_token_time=times[1],
                                                                last_token_time=time.time())
        self.last_step_time = now
        return outs

    def take_inter_token_latencies(self) -> list[float]:
        latencies, self.latencies = self.latencies, []
        return latencies

    def _output(self, rid: str, prompt, params, n: int) -> RequestOutput | None:
        done = n >= params.max_tokens
        return RequestOutput(rid, None, self.prompt_token_ids(prompt), None, [CompletionOutput(
            0, f"t{n}", [n], None, None, "length" if done else None)], done)
