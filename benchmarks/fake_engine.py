"""The OpenAI server's whole stack (uvicorn, the routes, AsyncLLM and its engine loop) over a
stand-in engine whose step sleeps ``step_ms`` (a GPU step: the GIL is free meanwhile) and gives
every running request one more token. What W3 measures against it is the server's own cost per
streamed token, on any machine:

  python benchmarks/serve.py --fake-step-ms 6 --num-prompts 256 --prompt-len 10 20 --output-len 200 300 \\
      --request-rates inf

(started by serve.py; ``python benchmarks/fake_engine.py PORT STEP_MS`` serves it alone)."""
import sys
import time
import types

from pagoda.engine.stats import EngineStats
from pagoda.outputs import CompletionOutput, RequestOutput


class WordTokenizer:
    def decode(self, ids: list[int]) -> str:
        return " ".join(f"w{i}" for i in ids)


class FakeEngine:
    """What AsyncLLM and the routes ask of an LLMEngine, with delta outputs of one token a step."""

    def __init__(self, step_ms: float, max_model_len: int = 1 << 20):
        self.step_s = step_ms / 1e3
        self.tokenizer = WordTokenizer()
        self.config = types.SimpleNamespace(model=types.SimpleNamespace(model="fake"),
                                            scheduler=types.SimpleNamespace(max_model_len=max_model_len))
        self.stats = EngineStats()
        self.running: dict[str, list] = {}       # request id -> [prompt ids, params, tokens so far]

    def prompt_token_ids(self, prompt) -> list[int]:
        return prompt["prompt_token_ids"] if isinstance(prompt, dict) else [1] * len(prompt.split())

    def add_request(self, request_id: str, prompt, params) -> None:
        self.running[request_id] = [self.prompt_token_ids(prompt), params, 0]

    def abort_request(self, request_ids) -> None:
        for r in [request_ids] if isinstance(request_ids, str) else request_ids:
            self.running.pop(r, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running)

    def step(self) -> list[RequestOutput]:
        time.sleep(self.step_s)
        outputs = []
        for request_id, state in list(self.running.items()):
            prompt_ids, params, n = state
            state[2] = n = n + 1
            done = n >= params.max_tokens
            c = CompletionOutput(0, f" w{n}", [n], None, None, "length" if done else None)
            outputs.append(RequestOutput(request_id, None, prompt_ids, None, [c], done))
            if done:
                del self.running[request_id]
        return outputs


def main(port: int, step_ms: float, served_model_name: str = "bench") -> None:
    """The engine in a process of its own, as ``pagoda serve`` runs it (PAGODA_ENGINE_PROCESS=0:
    on a thread of the server's process)."""
    import os
    from functools import partial

    import uvicorn
    from pagoda.engine.async_llm import AsyncLLM
    from pagoda.entrypoints.openai.api_server import build_app
    if os.environ.get("PAGODA_ENGINE_PROCESS", "1") == "0":
        engine = AsyncLLM(FakeEngine(step_ms))
    else:
        engine = AsyncLLM.in_engine_process([partial(FakeEngine, step_ms)], lambda model_config: WordTokenizer())
    app = build_app(engine, [served_model_name])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__":
    main(int(sys.argv[1]), float(sys.argv[2]), *sys.argv[3:4])
