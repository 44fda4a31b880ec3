"""Spawned child processes, each behind a pipe: the tensor/pipeline-parallel workers of one
engine (multiproc_executor.py) and the data-parallel engine replicas (engine/dp_engine.py).
A child answers each call ``("ok", result)``, ``("raise", exception)`` (the call failed but the
child goes on) or ``("error", traceback)`` (the child has failed and exits). A failure or death
stops every child, and later calls raise instead of waiting on a child that will never answer."""
import contextlib
import faulthandler
import multiprocessing as mp
import os
import pickle
import signal
import traceback
import weakref
from multiprocessing.connection import wait

import torch

from pagoda.distributed.parallel_state import destroy_distributed

# A spawned process first imports the parent's main module: a script that starts an engine at
# import time would start one in every child.
SPAWN_HINT = (" It died before it started: workers are spawned processes that import the main script "
              "first, so a script must create its LLM under `if __name__ == \"__main__\":`.")
# How long the parent waits for a child's last words once it knows something went wrong.
ERROR_GRACE_S = 5.0


def run_call(target, method, args: tuple = (), kwargs: dict | None = None):
    """A call sent to a child (or run in place): ``method`` a method name of ``target`` (a worker,
    an engine), or a function taking it first."""
    if callable(method):
        return method(target, *args, **(kwargs or {}))
    return getattr(target, method)(*args, **(kwargs or {}))


def _shutdown(procs: list, conns: list, num_threads: int) -> None:
    """Stop the children (politely, then by force), leave the process group and give this process
    back the threads it gave up. A plain function over plain values: the finalizer that calls it
    must not keep the owner alive."""
    for conn in conns:
        try:
            conn.send(("shutdown", ()))
        except (OSError, ValueError):
            pass
    destroy_distributed()     # (first: a worker stuck in a collective then fails at once)
    for p in procs:
        p.join(timeout=ERROR_GRACE_S)
        if p.is_alive():
            p.kill()
            p.join()
    for conn in conns:
        conn.close()
    torch.set_num_threads(num_threads)


def _child_main(target, *args) -> None:
    """A child's entry: ``kill -USR1 <pid>`` prints its threads' stacks to stderr, to see where a
    child that seems hung (in a collective, a compile, a graph capture) is waiting."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    target(*args)


@contextlib.contextmanager
def _environ(env: dict[str, str]):
    """``env`` set in os.environ meanwhile: what a spawned child inherits from its first line,
    before its imports (and the main script's, which it runs again) can read it."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v


def picklable(e: BaseException) -> BaseException:
    """``e``, or its traceback's text in a RuntimeError when ``e`` cannot be pickled (to send it
    to another process)."""
    try:
        pickle.dumps(e)
        return e
    except Exception:       # noqa: BLE001 - any exception that cannot travel is told as text
        return RuntimeError("".join(traceback.format_exception(e)))


class StopsOnFailure:
    """An owner of ranks or replicas that stop together: after a failure that involves them,
    later calls raise at once instead of waiting on one that will never answer. A subclass
    defines ``shutdown()`` and ``_last_words()``."""
    dead: str | None = None

    def _check_running(self) -> None:
        if self.dead is not None:
            raise RuntimeError(f"The parallel engine has stopped ({self.dead}); create a new LLM.")

    def _fail(self, error: BaseException) -> BaseException:
        """After a failed call that involves the others, stop them all (a parallel group's
        collectives can no longer be matched). The error to raise is the other's (with its
        traceback) when one failed or died, else this process's own."""
        if not isinstance(error, WorkerFailed):
            reason = self._last_words()
            error = WorkerFailed(reason) if reason else error
        self.shutdown()
        self.dead = str(error).splitlines()[0] if str(error) else repr(error)
        return error


class ChildProcs(StopsOnFailure):
    """Base of an owner of spawned children; ``child_name`` and ``first_id`` name them in errors."""
    child_name = "child"
    first_id = 0
    daemon = True       # (multiprocessing ends daemonic children at exit, but forbids them children)

    def _start_children(self, target, args_of, count: int, env_of=None) -> None:
        """Spawn ``count`` processes running ``target(*args_of(i), conn)``, with the environment
        variables ``env_of(i)`` on top of this process's; each first sends ("started", None),
        read by the caller through ``_replies(SPAWN_HINT)``."""
        ctx = mp.get_context("spawn")
        self.procs, self.conns = [], []
        self.dead: str | None = None
        # Runs on `del llm`, garbage collection or interpreter exit, whichever comes first.
        self._finalizer = weakref.finalize(self, _shutdown, self.procs, self.conns, torch.get_num_threads())
        for i in range(self.first_id, self.first_id + count):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_child_main, args=(target, *args_of(i), child),
                            name=f"pagoda-{self.child_name.split()[-1]}{i}", daemon=self.daemon)
            with _environ(env_of(i) if env_of else {}):
                p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)

    def shutdown(self) -> None:
        self._finalizer()

    def _send(self, msg, only: list[int] | None = None) -> None:
        """``msg`` to every child (pickled once), or to those numbered in ``only``."""
        self._check_running()
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for _, conn, _ in self._children(only):
                conn.send_bytes(data)
        except OSError as e:
            raise self._fail(e) from e

    def _replies(self, hint: str = "", only: list[int] | None = None) -> list:
        """Each child's answer to the last call, waiting as long as it works; a child's failure,
        or its death, raises. A call that raised in a child raises here once all have answered."""
        results, raised = [], None
        for i, conn, p in self._children(only):
            wait([conn, p.sentinel])
            status, value = self._read(i, conn, p, hint)
            if status == "error":
                raise self._fail(WorkerFailed(value))
            if status == "raise":
                raised = raised or value
            results.append(value)
        if raised is not None:
            raise raised
        return results

    def _children(self, only: list[int] | None = None) -> list:
        """(number, pipe, process) of every child, or of those numbered in ``only``."""
        children = list(zip(range(self.first_id, self.first_id + len(self.procs)), self.conns, self.procs))
        return children if only is None else [children[i - self.first_id] for i in only]

    def _read(self, i: int, conn, p, hint: str = "") -> tuple[str, object]:
        """The message of a child whose pipe or process is ready: what it sent, or that it died."""
        try:
            return conn.recv()
        except (EOFError, OSError):
            p.join(ERROR_GRACE_S)
            return "error", f"{self.child_name} {i} died (exit code {p.exitcode}).{hint}"

    def _check_children(self) -> None:
        """A child that failed once its part of a call was over, or died since, is noticed
        here (a poll per child)."""
        for i, conn, p in self._children():
            if conn.poll():
                raise self._fail(WorkerFailed(self._read(i, conn, p)[1]))

    def _last_words(self) -> str | None:
        """The error of a child that failed or died around this process's failure, if any."""
        ready = wait(self.conns + [p.sentinel for p in self.procs], ERROR_GRACE_S / 5)
        for i, conn, p in self._children():
            if conn in ready or p.sentinel in ready:
                status, value = self._read(i, conn, p)
                if status == "error":
                    return value
        return None

class WorkerFailed(RuntimeError):
    pass
