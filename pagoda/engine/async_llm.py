"""AsyncLLM: the engine behind an asyncio server. The engine is not thread-safe, so one
background thread owns it: it runs the requests' commands (add, abort) and steps the engine
while requests exist, and sleeps on its command queue when there are none. Outputs go back to
each caller's event loop; ``generate`` is an async iterator of RequestOutputs."""
import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable

from pagoda.engine.arg_utils import EngineArgs
from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine.stats import EngineStats
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    pass


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
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_config = engine.config.model
        self.max_model_len = engine.config.scheduler.max_model_len
        self.stats: EngineStats = engine.stats     # a snapshot, replaced after every step
        self._commands: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}      # touched only by the engine thread
        self._thread = threading.Thread(target=self._run, name="pagoda-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "AsyncLLM":
        return cls(LLMEngine.from_engine_args(args))

    # ------------------------------------------------------------------ the caller's side
    async def generate(self, prompt, sampling_params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Add the request (a bad one raises ValueError here, before any output), then yield
        its outputs as the engine makes them. Leaving the loop early (the client went away, the
        task was cancelled) aborts the request, which frees its KV blocks."""
        stream = _Stream(asyncio.get_running_loop())
        try:
            await self._call(lambda: self._add(request_id, prompt, sampling_params, stream))
        except asyncio.CancelledError:
            self.abort(request_id)      # queued after the add: it runs whether or not the add did
            raise
        finished = False
        try:
            while not finished:
                out = await stream.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort(request_id)

    async def prompt_token_ids(self, prompts: list) -> list[list[int]]:
        """Each prompt's token ids as the engine reads it (on the engine's thread: a
        data-parallel front asks a replica, over a pipe only that thread uses)."""
        return await self._call(lambda: [self.engine.prompt_token_ids(p) for p in prompts])

    def abort(self, request_id: str) -> None:
        self._commands.put(lambda: self._abort(request_id))

    def shutdown(self) -> None:
        self._commands.put(None)
        self._thread.join(timeout=30)

    async def _call(self, fn):
        """Run ``fn`` on the engine thread; its result or exception comes back here."""
        fut = asyncio.get_running_loop().create_future()

        def run():
            try:
                result = fn()
            except BaseException as e:       # noqa: BLE001 - handed to the caller
                fut.get_loop().call_soon_threadsafe(_set_exception, fut, e)
            else:
                fut.get_loop().call_soon_threadsafe(_set_result, fut, result)
        self._commands.put(run)
        return await fut

    # ------------------------------------------------------------------ the engine thread
    def _add(self, request_id: str, prompt, params: SamplingParams, stream: _Stream) -> None:
        self.engine.add_request(request_id, prompt, params)
        self._streams[request_id] = stream

    def _abort(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None:
            self.engine.abort_request(request_id)
            self.stats = self.engine.stats

    def _run(self) -> None:
        while True:
            # Idle: block until a command comes. Busy: take what has come, then step.
            block = not self.engine.has_unfinished_requests()
            try:
                while True:
                    cmd = self._commands.get(block=block)
                    if cmd is None:
                        return
                    try:
                        cmd()
                    except Exception:             # noqa: BLE001 - an abort that failed must not end the thread
                        logger.exception("An engine command failed.")
                    block = False
            except queue.Empty:
                pass
            if self.engine.has_unfinished_requests():
                self._step()

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:                    # noqa: BLE001 - fail the requests, keep serving
            logger.exception("Engine step failed; aborting %d requests.", len(self._streams))
            self.engine.abort_request(list(self._streams))
            error = EngineDeadError(f"The engine step failed: {e}")
            _hand_over([(stream, error) for stream in self._streams.values()])
            self._streams.clear()
            return
        items = [(self._streams[out.request_id], out) for out in outputs if out.request_id in self._streams]
        closed = _hand_over(items)
        for stream, out in items:
            if stream.loop in closed:
                self._abort(out.request_id)
            elif out.finished:
                del self._streams[out.request_id]
        self.stats = self.engine.stats


def _set_result(fut: asyncio.Future, result) -> None:
    if not fut.done():
        fut.set_result(result)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
