"""The engine core: the loop that steps the engine for a server. Between steps it runs the
commands that came (add, abort, a call); it steps while requests exist and sleeps on its
commands when none do; each step's events go out at once. AsyncLLM runs the loop on a thread
of its own process (``EngineThread``) or, as vLLM's engine core and by default for
``pagoda serve``, in a spawned process of its own (``EngineCoreProc``): the server's event loop
and the engine loop then hold a GIL each, and neither waits for the other's Python.

Commands, plain tuples:  ("add", request_id, prompt, params, priority) | ("abort", [request_ids]) |
                         ("call", call_id, name, args) | ("shutdown", ())
Events, a list a step:   ("out", request_id, RequestOutput, first) | ("fail", request_id, error) |
                         ("aborted", request_id) | ("reply", call_id, ok, value) |
                         ("itl", [seconds]) | ("stats", EngineStats) | ("dead", error)

Across the process boundary an output travels as a tuple of plain values (``pack_output``):
pickling a step's 256 RequestOutput dataclasses took 1.2 ms and unpickling 1.9 (this CPU),
their tuples 0.06 and 0.11. A request's prompt (its token ids) goes with its first output only."""
import logging
import pickle
import queue
import signal
import threading
from dataclasses import astuple

from pagoda.distributed.child_procs import SPAWN_HINT, ChildProcs, picklable
from pagoda.outputs import CompletionOutput, PoolingRequestOutput, RequestMetrics, RequestOutput

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    pass


# What a "call" command may run on the engine.
CALLS = {"prompt_token_ids": lambda engine, prompts: [engine.prompt_token_ids(p) for p in prompts]}


def run_engine_loop(engine, next_command, emit) -> None:
    """Serve ``engine`` until a "shutdown" command. ``next_command(block)`` returns the next
    command, or None when ``block`` is False and none is waiting; ``emit(events)`` hands out what
    one round made."""
    live: dict[str, bool] = {}        # request id -> whether it has had an output
    while True:
        # Idle: block until a command comes. Busy: take what has come, then step.
        events, block = [], not engine.has_unfinished_requests()
        while (cmd := next_command(block)) is not None:
            if cmd[0] == "shutdown":
                return
            try:
                events += _command(engine, cmd, live)
            except Exception:             # noqa: BLE001 - a failed abort must not end the loop
                logger.exception("An engine command failed.")
            block = False
        if engine.has_unfinished_requests():
            events += _step(engine, live)
            if latencies := engine.take_inter_token_latencies():
                events.append(("itl", latencies))
        events.append(("stats", engine.stats))     # (after an abort too: its blocks are free)
        emit(events)


def _command(engine, cmd: tuple, live: dict[str, bool]) -> list:
    kind = cmd[0]
    if kind == "add":
        _, request_id, prompt, params, priority = cmd
        try:
            engine.add_request(request_id, prompt, params, priority=priority)
        except Exception as e:            # noqa: BLE001 - a bad request: its caller's error
            return [("fail", request_id, picklable(e))]
        live[request_id] = False
    elif kind == "abort":
        ids = [r for r in cmd[1] if live.pop(r, None) is not None]
        if ids:
            engine.abort_request(ids)
            return [("aborted", r) for r in ids]
    elif kind == "call":
        _, call_id, name, args = cmd
        try:
            return [("reply", call_id, True, CALLS[name](engine, *args))]
        except Exception as e:            # noqa: BLE001 - raised by the caller
            return [("reply", call_id, False, picklable(e))]
    else:
        raise ValueError(f"Unknown engine command {kind!r}.")
    return []


def _step(engine, live: dict[str, bool]) -> list:
    try:
        outputs = engine.step()
    except Exception as e:                # noqa: BLE001 - fail the requests, keep serving
        logger.exception("Engine step failed; aborting %d requests.", len(live))
        engine.abort_request(list(live))
        error = EngineDeadError(f"The engine step failed: {e}")
        events = [("fail", request_id, error) for request_id in live]
        live.clear()
        return events
    events = []
    for out in outputs:
        first = live.get(out.request_id) is False
        if out.finished:
            live.pop(out.request_id, None)
        elif first:
            live[out.request_id] = True
        events.append(("out", out.request_id, out, first))
    return events


# ---------------------------------------------------------------------- one process
class EngineThread:
    """The loop on a thread of this process (the engine object lives here)."""

    def __init__(self, engine, dispatch):
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=run_engine_loop, args=(engine, self._next, dispatch),
                                        name="pagoda-engine", daemon=True)
        self._thread.start()

    def _next(self, block: bool):
        try:
            return self._commands.get(block=block)
        except queue.Empty:
            return None

    def send(self, cmd: tuple) -> None:
        self._commands.put(cmd)

    def shutdown(self) -> None:
        self.send(("shutdown", ()))
        self._thread.join(timeout=30)


# ---------------------------------------------------------------------- a process of its own
def pack_output(out: RequestOutput | PoolingRequestOutput, first: bool) -> tuple | PoolingRequestOutput:
    """``out`` as plain values; the prompt only with a request's first output, the metrics only
    with its last (what the server reads of them). A pooling request's one output goes as it is."""
    if isinstance(out, PoolingRequestOutput):
        return out
    completions = tuple((c.index, c.text, c.token_ids, c.cumulative_logprob, c.logprobs, c.finish_reason,
                         c.stop_reason) for c in out.outputs)
    prompt = (out.prompt, out.prompt_token_ids, out.prompt_logprobs) if first or out.finished else None
    metrics = astuple(out.metrics) if out.finished and out.metrics is not None else None
    return out.request_id, out.finished, completions, prompt, metrics, out.num_cached_tokens


def unpack_output(packed: tuple, prompts: dict) -> RequestOutput:
    """The RequestOutput ``pack_output`` packed; ``prompts`` keeps each live request's prompt."""
    if isinstance(packed, PoolingRequestOutput):
        return packed
    request_id, finished, completions, prompt, metrics, num_cached = packed
    if prompt is None:
        prompt = prompts.get(request_id, (None, [], None))
    elif not finished:
        prompts[request_id] = prompt
    if finished:
        prompts.pop(request_id, None)
    return RequestOutput(request_id, prompt[0], prompt[1], prompt[2], [CompletionOutput(*c) for c in completions],
                         finished, RequestMetrics(*metrics) if metrics is not None else None, num_cached)


def _core_main(make_engine, conn) -> None:
    """The engine core process: build the engine, then run the loop over the pipe until told
    to stop or the server's process is gone."""
    # Ctrl-C reaches the whole process group: the server shuts this process down itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn.send(("started", None))
    try:
        engine = make_engine()
        conn.send(("ok", (engine.config.model, engine.config.scheduler.max_model_len, engine.stats)))
    except Exception as e:                # noqa: BLE001 - raised by the server's AsyncLLM(...)
        conn.send(("raise", picklable(e)))
        conn.close()
        return

    def next_command(block: bool):
        if not block and not conn.poll():
            return None
        try:
            return pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):       # the server's process has exited
            return ("shutdown", ())

    def emit(events: list) -> None:
        packed = [("out", e[1], pack_output(e[2], e[3])) if e[0] == "out" else e for e in events]
        conn.send_bytes(pickle.dumps(packed, protocol=pickle.HIGHEST_PROTOCOL))

    run_engine_loop(engine, next_command, emit)
    del engine                            # (stops its own workers or replicas now)
    conn.close()


class EngineCoreProc(ChildProcs):
    """The loop in a spawned process (the engine, its model and its GPU live there), started
    here; ``wait_ready()`` waits for its engine, then a thread here reads its events. Not
    daemonic: a data-parallel engine spawns its replicas from it."""
    child_name = "engine core"
    daemon = False

    def __init__(self, make_engine, dispatch, index: int = 0, env: dict[str, str] | None = None):
        self.first_id = index
        self._dispatch = dispatch
        self._start_children(_core_main, lambda i: (make_engine,), 1, (lambda i: env) if env else None)

    def wait_ready(self) -> tuple:
        """The engine's (model config, max_model_len, stats) once it has started (its tokenizer
        is not sent: the server loads its own); its start-up error raises here."""
        self._replies(SPAWN_HINT)
        (info,) = self._replies()
        self._conn = self.conns[0]
        self._lock = threading.Lock()             # sends come from the event loop and the reader
        self._prompts: dict[str, tuple] = {}
        threading.Thread(target=self._read_events, name=f"pagoda-engine-reader{self.first_id}", daemon=True).start()
        return info

    def send(self, cmd: tuple) -> None:
        data = pickle.dumps(cmd, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            with self._lock:
                self._conn.send_bytes(data)
        except (OSError, ValueError) as e:
            raise EngineDeadError(f"The engine core process has stopped ({e}).") from e

    def _read_events(self) -> None:
        while True:
            try:
                events = pickle.loads(self._conn.recv_bytes())
            except (EOFError, OSError):
                code = self.procs[0].exitcode
                self._dispatch([("dead", EngineDeadError(f"The engine core process has stopped (exit code {code})."))])
                return
            for e in events:
                if e[0] in ("aborted", "fail"):   # (nothing of it comes after this on the pipe)
                    self._prompts.pop(e[1], None)
            self._dispatch([("out", e[1], unpack_output(e[2], self._prompts), False) if e[0] == "out" else e
                            for e in events])
