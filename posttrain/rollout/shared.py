"""Rollout workers shared by several training processes (`rollout.placement=separate` under ddp, fsdp2 or zero*).

The first training process starts the workers and holds them (a `WorkerPool`); every process, the first included,
samples through a `SharedPool`. A `generate` call is collective, as sampling already is where weights are sharded:
each process hands its prompts (and, at max_staleness 0 with one worker, its random generator's state) to the first,
which makes one call of the workers for all of them and hands each process back its own rows. Weight pushes go from
the first process alone; the others take part only in gathering each weight where the backend shards them.

The calls travel over two gloo groups of the training processes (`Lanes`), one for the producer thread, which makes
the training batches, and one for every other call (evaluation, the sets RFT and DPO sample once). Each lane has its
own view of the pool (`SharedPool.on`), handed to the code that calls from that thread: the producer's source and its
reductions get the producer's lane, the engine the other, so the group a call uses is passed, never guessed. Each
thread makes the same calls in the same order on every process, and the two threads never wait on each other's
collectives, so neither can pair its call with the other's. Both ship with torch, like the workers' own channels.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from posttrain.core.batch import Batch
from posttrain.core.errors import TrainingError
from posttrain.rollout.base import Workers
from posttrain.rollout.workers import WorkerPool, one_line, scoring_rows


class Lane:
    """One gloo group over every training process, for the calls of one thread."""

    def __init__(self, timeout: datetime.timedelta):
        self.group = dist.new_group(backend="gloo", timeout=timeout)
        self.world = dist.get_world_size()

    def reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        """`op` ("sum", "mean", "max" or "min") over every process, on this lane (the stages' reductions run in the
        producer thread, beside the trainer's own collectives)."""
        out = tensor.detach().to("cpu", copy=True)
        dist.all_reduce(out, getattr(dist.ReduceOp, "SUM" if op == "mean" else op.upper()), group=self.group)
        return (out / self.world if op == "mean" else out).to(tensor.device)

    def agree(self, flag: bool) -> bool:
        """True when `flag` is true on every process: a stage's sampling rounds end together, as the calls must."""
        return bool(self.reduce(torch.tensor(float(flag)), "min"))


class Lanes:
    """The two lanes: the producer thread's, and the one for every other call. Made at the same point on every
    process (collective calls)."""

    def __init__(self, timeout_s: float):
        timeout = datetime.timedelta(seconds=timeout_s)
        self.main, self.producer = Lane(timeout), Lane(timeout)


class SharedPool(Workers):
    """The rollout engine each training process sees when several share the workers.

    Args:
        pool: the workers, on the first process; None on the others.
        lane: the group this view's calls travel on (`on` gives the same pool on another).
        shared_rng: each process's part is sampled from its own generator's state (one worker, max_staleness 0).
        name: the workers' engine.
        takes_adapter: the workers take the LoRA adapter alone.
    """

    colocated = False
    collective = True  # every process makes the same calls

    def __init__(self, pool: WorkerPool | None, lane: Lane, *, shared_rng: bool, name: str, takes_adapter: bool,
                 state: dict | None = None):
        self.pool, self.lane, self.shared_rng = pool, lane, shared_rng
        self.name, self.takes_adapter = name, takes_adapter
        self.rank = dist.get_rank()
        # every view's: the policy version, and the first process's restart count as the last call reported it
        self._state = state if state is not None else {"version": 0, "restarts": 0}

    def on(self, lane: Lane) -> SharedPool:
        """The same pool, its calls on `lane`: the view for the code that calls from another thread."""
        return SharedPool(self.pool, lane, shared_rng=self.shared_rng, name=self.name,
                          takes_adapter=self.takes_adapter, state=self._state)

    @property
    def version(self) -> int:
        return self.pool.version if self.pool is not None else self._state["version"]

    @version.setter
    def version(self, value: int) -> None:
        if self.pool is not None:
            self.pool.version = value
        self._state["version"] = value

    def generate(self, prompts: list[list[int]], n: int | list[int], *, max_new_tokens: int,
                 temperature: float = 1.0, top_p: float = 1.0, greedy: bool = False) -> Batch:
        sampling = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, greedy=greedy)

        def serve(parts: list[tuple]) -> list[tuple]:
            settings = {repr(p[3]) for p in parts}
            if len(settings) > 1:
                raise TrainingError(f"rollout workers: the training processes asked for different sampling "
                                    f"settings in one call: {sorted(settings)}")
            return self.pool.sample([p[:3] for p in parts], sampling)

        mine = (prompts, n, torch.get_rng_state() if self.shared_rng else None, sampling)
        batch, rng = self._through_first(mine, serve)
        if self.shared_rng:
            torch.set_rng_state(rng)
        return batch

    def score_frozen(self, batch: Batch) -> dict[str, torch.Tensor]:
        """This process's batch's log-probs under the workers' frozen models, by field ([B, R] each), scored in one
        call for every process (rollout.reference_on=workers)."""
        return self._through_first(scoring_rows(batch), self.pool.score_frozen_parts if self.pool is not None else None)

    def _through_first(self, mine, serve):
        """A collective call: every process hands `mine` to the first, which answers them all with `serve(parts)`
        (one answer a process, in rank order) and hands each process its own. Every process raises the first's
        error, so that none waits for an answer that will not come."""
        group = self.lane.group
        parts = [None] * self.lane.world if self.rank == 0 else None
        dist.gather_object(mine, parts, dst=0, group=group)
        failure, answers = None, None
        if self.rank == 0:
            try:
                answers = [("answer", answer, self.pool.restarts) for answer in serve(parts)]
            except Exception as err:  # every process stops with the first's error, none waits for a batch
                failure = err
                answers = [("error", one_line(err))] * self.lane.world
        out = [None]
        dist.scatter_object_list(out, answers, src=0, group=group)
        if failure is not None:
            raise failure
        if out[0][0] == "error":
            raise TrainingError(f"rollout workers (on training process 0): {out[0][1]}")
        _, answer, self._state["restarts"] = out[0]
        return answer

    def load_weights(self, weights) -> int:
        """The first process pushes; the others walk the weights too, since a sharding backend gathers each in a
        call every process makes."""
        if self.pool is not None:
            return self.pool.load_weights(weights)
        for _ in weights:
            pass
        return 0

    def release(self) -> None:
        pass

    def restore(self) -> None:
        pass

    # -- what the run reports (the first process's figures) --------------------------------------------------
    @property
    def restarts(self) -> int:
        return self.pool.restarts if self.pool is not None else self._state["restarts"]

    def report(self) -> dict:
        return self.pool.report() if self.pool is not None else {"workers": 0, "pids": [], "attention": [],
                                                                   "requests": 0, "restarts": self.restarts}

    def take_idle(self) -> float:
        return self.pool.take_idle() if self.pool is not None else 0.0

    def state_dict(self) -> dict:
        return self.pool.state_dict() if self.pool is not None else {"rng": None}

    def load_state_dict(self, state: dict) -> None:
        if self.pool is not None:
            self.pool.load_state_dict(state)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
