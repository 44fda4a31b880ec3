"""The OpenAI server's whole stack (uvicorn, the routes, AsyncLLM and its engine loop) over a
stand-in engine whose step sleeps ``step_ms`` (a GPU step: the GIL is free meanwhile) and gives
every running request one more token. What W3 measures against it is the server's own cost per
streamed token, on any machine:

  python benchmarks/serve.py --fake-step-ms 6 --num-prompts 256 --prompt-len 10 20 --output-len 200 300 \\
      --request-rates inf

(started by serve.py; ``python benchmarks/fake_engine.py PORT STEP_MS`` serves it alone)."""
import os
import sys

import common  # before pagoda: puts the checkout to benchmark (PAGODA_ROOT) on sys.path
from pagoda.outputs import CompletionOutput, RequestOutput
from tests.stub_engine import StubEngine

del common  # (imported for its sys.path entry alone)


class WordTokenizer:
    def decode(self, ids: list[int]) -> str:
        return " ".join(f"w{i}" for i in ids)


class FakeEngine(StubEngine):
    """The tests' stand-in engine (delta outputs of one token a step) with steps of ``step_ms``,
    text prompts read as words, and text as WordTokenizer decodes it."""

    def __init__(self, step_ms: float, max_model_len: int = 1 << 20):
        super().__init__(step_s=step_ms / 1e3, tokenizer=WordTokenizer(), max_model_len=max_model_len)

    def prompt_token_ids(self, prompt) -> list[int]:
        return prompt["prompt_token_ids"] if isinstance(prompt, dict) else [1] * len(prompt.split())

    def _output(self, rid: str, prompt, params, n: int) -> RequestOutput:
        done = n >= params.max_tokens
        return RequestOutput(rid, None, self.prompt_token_ids(prompt), None, [CompletionOutput(
            0, f" w{n}", [n], None, None, "length" if done else None)], done)


def main(port: int, step_ms: float, served_model_name: str = "bench") -> None:
    """The engine in a process of its own, as ``pagoda serve`` runs it (PAGODA_ENGINE_PROCESS=0:
    on a thread of the server's process)."""
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
