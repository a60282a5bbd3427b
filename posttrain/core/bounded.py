"""A pool of worker processes that runs a function over a list of items, each item bounded in wall-clock time.

A check on untrusted text can run for minutes on one bad input (sympy evaluating `9^{9^{9^9}}`, say). SIGALRM
cannot always stop it: Python runs a signal handler only between bytecodes, so a C loop that never checks for
signals (`sum(range(10**12))`) runs to its end first. Killing the process always works. `BoundedPool` runs each item
in a worker process and, once the item passes its bound, kills that worker with SIGKILL and starts another, so a
hung item costs its bound and nothing more.

The contract of `BoundedPool.map(fn, items, timeout_s)`:

1. `fn` is a picklable callable of one item, in practice a module-level function: it is pickled by reference and
   imported in each worker. Items and return values must pickle too.
2. It returns one `Outcome` per item, in input order: the value, or the exception `fn` raised (as text), or that
   the item timed out. `map` itself raises only on the caller's mistakes: an `fn` or an item that does not pickle,
   or an `fn` a worker cannot import.
3. An item's bound runs from when it is handed to a worker until its result is back. Starting a worker and importing
   `fn`'s module happen before that, outside every item's bound (within `LOAD_TIMEOUT_S`).
4. Items run in parallel, one at a time per worker. Workers start on first use and persist across calls, so what
   `fn`'s module caches (a parsed reference, say) serves later calls, until the worker is killed.
5. Workers start with "forkserver": a plain fork of a process that holds torch's threads can deadlock, while the
   fork server is a fresh single-threaded process. Unlike a plain forkserver or spawn pool, they do not import the
   parent's `__main__` (`posttrain.core.launch.main_unimported`), so a script that calls posttrain needs no
   `if __name__ == "__main__":` guard; `fn` must then live in an importable module (rule 1). Workers
   ignore SIGINT (Ctrl-C is the parent's to handle) and stop when the parent's end of their pipe closes.
6. One `map` runs at a time (a lock); `close()` stops the workers, and a later `map` starts new ones. Every pool is
   closed at interpreter exit.
7. No pool inside a pool: `map` called in a worker (a reward run by one pool that checks answers with another) runs
   its items there, one after another, each still giving an `Outcome`, and the bound is the enclosing item's. A
   nested pool would start a fork server and workers inside each worker, and killing a worker at its bound would
   leave its own worker running the hung check.
"""

from __future__ import annotations

import atexit
import math
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any

from posttrain.core.launch import main_unimported
from posttrain.core.threads import usable_cores

LOAD_TIMEOUT_S = 60.0  # seconds a new worker may take to start and import `fn`'s module before `map` gives up
_in_worker = False  # set by `_serve`: this process is a worker, so `map` runs items directly (rule 7)


@dataclass(frozen=True)
class Outcome:
    """What became of one item: its value, or why there is none."""

    value: Any = None
    error: str | None = None  # "ValueError: ...", "timed out after 1 s" or "worker exited with code -9"
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        """Whether `fn` returned (its value is `value`)."""
        return self.error is None


def _serve(conn) -> None:
    """A worker's loop: load a function, then run it on one item per message until stopped or orphaned."""
    global _in_worker
    _in_worker = True
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # One compute thread: the workers run beside each other and the trainer, on cores they share (core/threads.py).
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)
    fn = None
    while True:
        try:
            kind, payload = conn.recv()
        except EOFError:  # the parent has gone
            return
        if kind == "stop":
            return
        try:
            if kind == "load":
                fn, reply = pickle.loads(payload), None  # imports fn's module; a failure is reported, not fatal
            else:
                reply = fn(payload)
            conn.send((True, reply))
        except Exception as e:  # a return value that does not pickle fails in send and lands here too
            conn.send((False, _describe(e)))


def _describe(error: Exception) -> str:
    return f"{type(error).__name__}: {error}"


def _direct(fn: Callable[[Any], Any], item: Any) -> Outcome:
    """`fn(item)` in this process, as an `Outcome` (rule 7)."""
    try:
        return Outcome(value=fn(item))
    except Exception as e:
        return Outcome(error=_describe(e))


class InProcess:
    """`BoundedPool`'s `map` run in this process, one item after another, without a bound: for code given from
    Python (an environment class defined in a notebook), which a worker process could not import. An item that
    raises still gives its `Outcome`; one that hangs hangs the caller."""

    def map(self, fn: Callable[[Any], Any], items: Iterable[Any], timeout_s: float) -> list[Outcome]:
        return [_direct(fn, item) for item in items]


class _Worker:
    """One worker process, the parent's end of its pipe, and what it is doing."""

    def __init__(self, context) -> None:
        self.conn, theirs = context.Pipe()
        self.process = context.Process(target=_serve, args=(theirs,), name="bounded-worker")
        with main_unimported():  # the worker runs fn, by reference: the caller's script stays unimported there
            self.process.start()
        theirs.close()
        self.fn = None  # the function it holds, or is loading
        self.index: int | None = None  # the item it is running; None while idle or loading
        self.deadline = math.inf  # when its item (or its load) runs out of time; inf while idle

    def stop(self, grace_s: float = 0.0) -> None:
        """Asks the worker to exit, waits up to `grace_s`, then kills it."""
        if grace_s > 0 and self.process.is_alive():
            try:
                self.conn.send(("stop", None))
                self.process.join(grace_s)
            except OSError:
                pass
        if self.process.is_alive():
            self.process.kill()  # SIGKILL: no signal handler in fn's code can delay it
        self.process.join()
        self.conn.close()


class BoundedPool:
    """Persistent worker processes that run `fn` over items, each item within `timeout_s` (see the module docstring).

    Args:
        workers: how many processes; default min(4, the cores this process may use).
        start_method: multiprocessing's start method, "forkserver" or "spawn" ("fork" is unsafe beside torch).
    """

    def __init__(self, workers: int | None = None, start_method: str = "forkserver") -> None:
        self.workers = workers or min(4, usable_cores())
        self._context = multiprocessing.get_context(start_method)
        self._slots: list[_Worker | None] = [None] * self.workers
        self._lock = threading.Lock()
        _POOLS.add(self)

    def map(self, fn: Callable[[Any], Any], items: Iterable[Any], timeout_s: float) -> list[Outcome]:
        """`fn(item)` for every item, in parallel, each within `timeout_s` seconds; one `Outcome` per item, in order.

        Raises:
            pickle.PicklingError, AttributeError, TypeError: `fn` or an item does not pickle.
            RuntimeError: a worker could not import `fn`, or took over `LOAD_TIMEOUT_S` to start.
        """
        items = list(items)
        blob = pickle.dumps(fn)  # fails here, in the caller, for a lambda or a nested function
        if _in_worker:  # rule 7: the enclosing item's bound covers these
            return [_direct(fn, item) for item in items]
        with self._lock:
            outcomes: list[Outcome | None] = [None] * len(items)
            try:
                self._run(fn, blob, items, timeout_s, outcomes)
            except BaseException:  # Ctrl-C, a failed load, an item that does not pickle: start afresh next time,
                self._stop_all(grace_s=0.0)  # as a worker may still hold a message or owe a reply
                raise
        return outcomes

    def _run(self, fn, blob: bytes, items: list, timeout_s: float, outcomes: list) -> None:
        """Hands items to idle workers and collects results until every item has an outcome and every worker is idle."""
        pending = deque(range(len(items)))
        used = range(min(self.workers, len(items)))
        while True:
            now = time.monotonic()
            for slot in used:
                worker = self._slots[slot]
                if not pending or (worker is not None and worker.deadline < math.inf):
                    continue
                if worker is None or not worker.process.is_alive():  # never started, or died while idle
                    worker = self._slots[slot] = _Worker(self._context)
                    _close_at_exit()
                if worker.fn is not fn:
                    worker.conn.send(("load", blob))
                    worker.fn, worker.deadline = fn, now + LOAD_TIMEOUT_S
                else:
                    worker.conn.send(("run", items[pending[0]]))
                    worker.index, worker.deadline = pending.popleft(), now + timeout_s
            waiting = {w.conn: (slot, w) for slot in used if (w := self._slots[slot]) and w.deadline < math.inf}
            if not waiting:
                return
            nearest = min(w.deadline for _, w in waiting.values())
            ready = set(wait(list(waiting), timeout=max(0.0, nearest - time.monotonic())))
            now = time.monotonic()
            for conn, (slot, worker) in waiting.items():
                if conn in ready:
                    self._receive(slot, worker, outcomes)
                elif now >= worker.deadline:
                    if worker.index is None:
                        raise RuntimeError(f"a worker took over {LOAD_TIMEOUT_S:g} s to start and import {fn!r}")
                    outcomes[worker.index] = Outcome(error=f"timed out after {timeout_s:g} s", timed_out=True)
                    worker.stop()
                    self._slots[slot] = None  # replaced on the next pass if items remain

    def _receive(self, slot: int, worker: _Worker, outcomes: list) -> None:
        """Reads `worker`'s reply: its item's outcome or its load's answer; replaces a worker that died."""
        try:
            ok, reply = worker.conn.recv()
        except (EOFError, OSError):  # it exited: os._exit in fn, a crash in C code, the OOM killer
            worker.stop()
            self._slots[slot] = None
            if worker.index is None:
                raise RuntimeError(f"a worker exited with code {worker.process.exitcode} while importing "
                                   f"{worker.fn!r}") from None
            outcomes[worker.index] = Outcome(error=f"worker exited with code {worker.process.exitcode}")
            return
        if worker.index is None and not ok:
            raise RuntimeError(f"a worker could not import {worker.fn!r}: {reply}")
        if worker.index is not None:
            outcomes[worker.index] = Outcome(value=reply) if ok else Outcome(error=reply)
        worker.index, worker.deadline = None, math.inf

    def close(self) -> None:
        """Stops the workers (each gets a second to exit, then is killed); a later `map` starts new ones."""
        with self._lock:
            self._stop_all(grace_s=1.0)

    def _stop_all(self, grace_s: float) -> None:
        for slot, worker in enumerate(self._slots):
            if worker is not None:
                worker.stop(grace_s)
                self._slots[slot] = None

    def __enter__(self) -> BoundedPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_POOLS: weakref.WeakSet[BoundedPool] = weakref.WeakSet()
_closing_registered = False


def _close_all() -> None:
    for pool in list(_POOLS):
        pool.close()


def _close_at_exit() -> None:
    """Registers `_close_all` at exit, once, when the first worker has started: after multiprocessing's own exit hook
    (which waits for every live child), so that it runs first, as atexit runs hooks last-in first-out."""
    global _closing_registered
    if not _closing_registered:
        atexit.register(_close_all)
        _closing_registered = True
