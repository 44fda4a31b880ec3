"""AsyncLLM: the engine behind an asyncio server. The engine core's loop (``engine_core.py``)
steps the engine while requests exist, on a thread of this process (``AsyncLLM(engine)``) or,
for a server (``AsyncLLM.from_engine_args``), in a process of its own. Its events come back on
that thread (or on the thread reading the process's pipe) and go to each caller's event loop,
one wake-up of each loop a step; ``generate`` is an async iterator of RequestOutputs."""
import asyncio
import itertools
import os
from collections.abc import AsyncIterator
from functools import partial

from pagoda.engine.arg_utils import EngineArgs
from pagoda.engine.engine_core import EngineCoreProc, EngineDeadError, EngineThread
from pagoda.engine.llm_engine import LLMEngine, load_tokenizer
from pagoda.engine.stats import EngineStats
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams

__all__ = ["AsyncLLM", "EngineDeadError"]
class _Stream:
    """Where one request's outputs land, on the caller's event loop. Outputs the reader has not
    taken yet are merged into one (``RequestOutput.add``): a reader that falls behind the engine
    (hundreds of streams on a small model) catches up in one chunk instead of queueing a
    chunk per step."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.pending: RequestOutput | BaseException | None = None
        self.ready = asyncio.Event()

    def push(self, item) -> None:
        """On the loop's thread."""
        if isinstance(self.pending, RequestOutput) and isinstance(item, RequestOutput):
            self.pending.add(item)
        elif not isinstance(self.pending, BaseException):
            self.pending = item
        self.ready.set()

    async def get(self):
        await self.ready.wait()
        self.ready.clear()
        item, self.pending = self.pending, None
        return item


def _deliver(batch: list) -> None:
    for stream, item in batch:
        stream.push(item)


def _hand_over(items: list[tuple[_Stream, object]]) -> set[asyncio.AbstractEventLoop]:
    """One step's outputs to their streams: one wake-up of each event loop per step, not one
    per output. Returns the loops that have closed (nobody reads their streams)."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for stream, item in items:
        by_loop.setdefault(stream.loop, []).append((stream, item))
    closed = set()
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_deliver, batch)
        except RuntimeError:
            closed.add(loop)
    return closed


class AsyncLLM:
    def __init__(self, engine: LLMEngine):
        """``engine`` stepped by a thread of this process (it shares the interpreter, and its
        GIL, with the caller's event loop)."""
        self._setup(engine.tokenizer, engine.config.model, engine.config.scheduler.max_model_len, engine.stats)
        self._core = EngineThread(engine, self._dispatch)

    @classmethod
    def in_engine_process(cls, make_engine, make_tokenizer=None) -> "AsyncLLM":
        """The engine ``make_engine()`` builds (a picklable callable) in a spawned process of its
        own, as vLLM's engine core; ``make_tokenizer(model_config)`` loads the tokenizer here."""
        self = cls.__new__(cls)
        core = EngineCoreProc(make_engine, self._dispatch)
        model_config, max_model_len, stats = core.info
        try:
            tokenizer = make_tokenizer(model_config) if make_tokenizer is not None else None
        except BaseException:
            core.shutdown()
            raise
        self._setup(tokenizer, model_config, max_model_len, stats)
        self._core = core
        return self

    @classmethod
    def from_engine_args(cls, args: EngineArgs, engine_process: bool | None = None) -> "AsyncLLM":
        """The engine ``args`` describe, in a process of its own unless ``engine_process`` is
        False (by default, unless the environment sets PAGODA_ENGINE_PROCESS=0)."""
        if engine_process is None:
            engine_process = os.environ.get("PAGODA_ENGINE_PROCESS", "1") != "0"
        if not engine_process:
            return cls(LLMEngine.from_engine_args(args))
        return cls.in_engine_process(partial(LLMEngine.from_engine_args, args),
                                     lambda model_config: load_tokenizer(args, model_config.path))

    def _setup(self, tokenizer, model_config, max_model_len: int, stats: EngineStats) -> None:
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.max_model_len = max_model_len
        self.stats = stats                        # a snapshot, replaced after every step
        self.dead: EngineDeadError | None = None
        self._streams: dict[str, _Stream] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()

    # ------------------------------------------------------------------ the caller's side
    async def generate(self, prompt, sampling_params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Add the request, then yield its outputs as the engine makes them (a bad request
        raises its ValueError at the first). Leaving the loop early (the client went away, the
        task was cancelled) aborts the request, which frees its KV blocks."""
        if request_id in self._streams:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        self._check_alive()
        stream = _Stream(asyncio.get_running_loop())
        self._streams[request_id] = stream
        finished = False
        try:
            self._core.send(("add", request_id, prompt, sampling_params))
            while not finished:
                out = await stream.get()
                if isinstance(out, BaseException):
                    finished = True               # (the engine has let go of it)
                    raise out
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort(request_id)

    async def prompt_token_ids(self, prompts: list) -> list[list[int]]:
        """Each prompt's token ids as the engine reads them (tokenized by the engine)."""
        return await self._call("prompt_token_ids", prompts)

    def abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        if self.dead is None:
            self._core.send(("abort", [request_id]))

    def shutdown(self) -> None:
        self._core.shutdown()

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise self.dead

    async def _call(self, name: str, *args):
        self._check_alive()
        call_id = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        try:
            self._core.send(("call", call_id, name, args))
            return await fut
        finally:
            self._calls.pop(call_id, None)

    # ------------------------------------------------------------------ the engine's side
    def _dispatch(self, events: list) -> None:
        """One round of the engine loop's events (on the engine's thread, or the pipe reader's)."""
        items = []
        for event in events:
            kind = event[0]
            if kind == "out":
                _, request_id, out, _ = event
                stream = self._streams.get(request_id)
                if stream is not None:
                    items.append((request_id, stream, out))
                    if out.finished:
                        self._streams.pop(request_id, None)
            elif kind == "fail":
                stream = self._streams.pop(event[1], None)
                if stream is not None:
                    items.append((event[1], stream, event[2]))
            elif kind == "reply":
                _, call_id, ok, value = event
                fut = self._calls.get(call_id)
                if fut is not None:
                    fut.get_loop().call_soon_threadsafe(_set_result if ok else _set_exception, fut, value)
            elif kind == "stats":
                self.stats = event[1]
            elif kind == "dead":
                self.dead = event[1]
                items += [(rid, stream, event[1]) for rid, stream in list(self._streams.items())]
                self._streams.clear()
                for fut in list(self._calls.values()):
                    fut.get_loop().call_soon_threadsafe(_set_exception, fut, event[1])
        closed = _hand_over([(stream, item) for _, stream, item in items])
        for request_id, stream, _ in items:
            if stream.loop in closed:             # nobody reads it any more
                self.abort(request_id)


def _set_result(fut: asyncio.Future, result) -> None:
    if not fut.done():
        fut.set_result(result)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
