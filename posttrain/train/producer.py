"""The producer: the online source's batches made ahead of the trainer, in a thread (`rollout.placement=separate`).

The thread runs the source's whole pipeline (row draws, sampling on the rollout workers, the judge, the stages:
pass rates, overlong penalty, dynamic sampling, elite replay, step rewards, temperature), and under
`rollout.reference_on=workers` has the workers score the finished batch under the frozen models they hold (the reference,
the distillation teacher), so the training loop only scores what is left and updates. It makes batch j (the batch step j trains on) once the trainer has asked for batch j − k, k being
`rollout.max_staleness`: then the weights the workers hold are at least version j − 1 − k, the bound the trainer
checks on every fresh row. At k = 0 it makes each batch when the trainer asks for it: the synchronous algorithm.

A checkpoint takes its snapshot between two batches (`paused`), once the producer has made every batch it may make
so far: the controllers as the producer left them, and the batches made but not yet trained on, which a resumed run
trains first. No prompt is in flight at that moment, so a run killed at any point and resumed trains on every drawn
prompt exactly once; and every training process's snapshot holds the same batches, which processes that share the
workers need (their calls pair up in order).
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable, Iterator

from posttrain.core.batch import Batch


class Producer:
    """Batches of `source`, made ahead by at most `k`, for steps up to `steps`.

    Args:
        source: the online source (its `next` draws, samples, judges and runs the stages).
        draws: the row draws (moved to each batch's step before it is made).
        pool: the rollout workers (their idle time and restarts enter each batch's metrics).
        autocast: the backend's autocast context for the source's own forwards (a reward model).
        frozen: the workers score each batch under the frozen models they hold (rollout.reference_on=workers): its
            reference log-probs, its teacher's, or both.
    """

    def __init__(self, source, draws, pool, k: int, steps: int, autocast: Callable, frozen: bool = False):
        self.source, self.draws, self.pool, self.k, self.steps, self.autocast = source, draws, pool, k, steps, autocast
        self.frozen = frozen
        self.cond = threading.Condition()
        self.lock = threading.Lock()  # held while a batch is made
        self.ready: collections.deque[tuple[int, Batch, dict]] = collections.deque()  # made, not yet trained
        self.requested = self.made = 0  # the newest batch the trainer asked for, and made
        self.error: BaseException | None = None
        self.stopping, self.thread = False, None
        self.zero = time.perf_counter()  # the clock of the `clock/*` stamps, shared with the training loop's

    def next(self, step: int) -> tuple[Batch, dict]:
        """Step `step`'s batch, with its metrics and how long the trainer waited for it (`time/wait_batch`)."""
        if self.thread is None:
            self.made = max(self.made, step - 1)
            self.thread = threading.Thread(target=self._run, daemon=True, name="posttrain-producer")
            self.thread.start()
        t0 = time.perf_counter()
        with self.cond:
            self.requested = step
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.ready or self.error is not None)
            if self.error is not None:
                raise self.error
            made_for, batch, stats = self.ready.popleft()
        if made_for != step:
            raise RuntimeError(f"producer: batch {made_for} handed to step {step}")
        return batch, {**stats, "time/wait_batch": time.perf_counter() - t0}

    def _run(self) -> None:
        try:
            while True:
                with self.cond:
                    self.cond.wait_for(lambda: self.stopping or self.made < self.bound())
                    if self.stopping:
                        return
                with self.lock:
                    step, start = self.made + 1, self.clock()
                    self.draws.at(step - 1)  # the curriculum's pool of the step that trains on it
                    with self.autocast():
                        batch, stats = self.source.next()
                    if self.frozen:
                        t0 = time.perf_counter()
                        for field, logp in self.pool.score_frozen(batch).items():  # ref_logp, teacher_logp
                            setattr(batch, field, logp)  # [B, R]
                        stats["time/reference"] = time.perf_counter() - t0
                    stats.update({"time/worker_idle": self.pool.take_idle(),
                                  "rollout/worker_restarts": float(self.pool.restarts),
                                  "clock/batch_start": start, "clock/batch_end": self.clock()})
                    with self.cond:
                        self.ready.append((step, batch, stats))
                        self.made = step
                        self.cond.notify_all()
        except BaseException as err:  # noqa: BLE001 - raised in the training loop, which owns the run
            with self.cond:
                self.error = err
                self.cond.notify_all()

    def bound(self) -> int:
        """The newest batch it may make now: k past the one the trainer asked for last, at most the last step's."""
        return min(self.steps, self.requested + self.k)

    def clock(self) -> float:
        """Seconds since the producer was made: the clock of the timeline stamps (docs/async.md)."""
        return time.perf_counter() - self.zero

    @contextlib.contextmanager
    def paused(self) -> Iterator[dict]:
        """Holds the producer between two batches, once it has made every batch it may (`bound`); yields what a
        checkpoint keeps of it."""
        if self.thread is not None:
            with self.cond:
                self.cond.wait_for(lambda: self.made >= self.bound() or self.error is not None)
                if self.error is not None:
                    raise self.error
        with self.lock:
            yield {"ready": list(self.ready), "made": self.made, "pool": self.pool.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """The batches a checkpoint kept, trained first; before the thread starts."""
        self.ready = collections.deque(state["ready"])
        self.made = state["made"]
        self.pool.load_state_dict(state["pool"])

    def stop(self) -> None:
        """Asks the thread to stop after the batch it is making (the pool's closing ends a request it waits on)."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join(timeout=30)
