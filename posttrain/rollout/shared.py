"""Rollout workers shared by several training processes (`rollout.placement=separate` under ddp, fsdp2 or zero*).

The first training process starts the workers and holds them (a `WorkerPool`); every process, the first included,
samples through a `SharedPool`. A `generate` call is collective, as sampling already is where weights are sharded:
each process hands its prompts (and, at max_staleness 0 with one worker, its random generator's state) to the first,
which makes one call of the workers for all of them and hands each process back its own rows. Weight pushes go from
the first process alone; the others take part only in gathering each weight where the backend shards them.

The calls travel over two gloo groups of the training processes (`Lanes`), one for the producer thread, which makes
the training batches, and one for every other call (evaluation, the sets RFT and DPO sample once). Each thread makes
the same calls in the same order on every process, and the two threads never wait on each other's collectives, so
neither can pair its call with the other's. Both ship with torch, like the workers' own channels.
"""

from __future__ import annotations

import datetime
import threading

import torch
import torch.distributed as dist

from posttrain.core.batch import Batch
from posttrain.core.errors import TrainingError
from posttrain.rollout.base import RolloutEngine
from posttrain.rollout.workers import WorkerPool, one_line, scoring_rows

PRODUCER_THREAD = "posttrain-producer"  # the name of the thread that makes training batches (posttrain.train.producer)


class Lanes:
    """Two gloo groups over every training process: the producer thread's, and the one for other threads' calls.
    Made at the same point on every process (a collective call)."""

    def __init__(self, timeout_s: float):
        timeout = datetime.timedelta(seconds=timeout_s)
        self.main = dist.new_group(backend="gloo", timeout=timeout)
        self.producer = dist.new_group(backend="gloo", timeout=timeout)
        self.world = dist.get_world_size()

    def group(self):
        """The calling thread's group."""
        return self.producer if threading.current_thread().name == PRODUCER_THREAD else self.main

    def reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        """`op` ("sum", "mean", "max" or "min") over every process, on the calling thread's group (the stages'
        reductions run in the producer thread, beside the trainer's own collectives)."""
        out = tensor.detach().to("cpu", copy=True)
        dist.all_reduce(out, getattr(dist.ReduceOp, "SUM" if op == "mean" else op.upper()), group=self.group())
        return (out / self.world if op == "mean" else out).to(tensor.device)

    def agree(self, flag: bool) -> bool:
        """True when `flag` is true on every process: a stage's sampling rounds end together, as the calls must."""
        return bool(self.reduce(torch.tensor(float(flag)), "min"))


class SharedPool(RolloutEngine):
    """The rollout engine each training process sees when several share the workers.

    Args:
        pool: the workers, on the first process; None on the others.
        lanes: the groups the calls travel on.
        shared_rng: each process's part is sampled from its own generator's state (one worker, max_staleness 0).
        name: the workers' engine.
        takes_adapter: the workers take the LoRA adapter alone.
    """

    colocated = False
    collective = True  # every process makes the same calls

    def __init__(self, pool: WorkerPool | None, lanes: Lanes, *, shared_rng: bool, name: str, takes_adapter: bool):
        self.pool, self.lanes, self.shared_rng = pool, lanes, shared_rng
        self.name, self.takes_adapter = name, takes_adapter
        self.rank = dist.get_rank()
        self._version = 0
        self._restarts = 0  # the first process's count, as the last call reported it

    @property
    def version(self) -> int:
        return self.pool.version if self.pool is not None else self._version

    @version.setter
    def version(self, value: int) -> None:
        if self.pool is not None:
            self.pool.version = value
        self._version = value

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

    def score_reference(self, batch: Batch) -> torch.Tensor:
        """The reference log-probs of this process's batch ([B, R]), scored by the workers in one call for every
        process (rollout.reference_on=workers)."""
        return self._through_first(scoring_rows(batch), self.pool.score_references if self.pool is not None else None)

    def _through_first(self, mine, serve):
        """A collective call: every process hands `mine` to the first, which answers them all with `serve(parts)`
        (one answer a process, in rank order) and hands each process its own. Every process raises the first's
        error, so that none waits for an answer that will not come."""
        group = self.lanes.group()
        parts = [None] * self.lanes.world if self.rank == 0 else None
        dist.gather_object(mine, parts, dst=0, group=group)
        failure, answers = None, None
        if self.rank == 0:
            try:
                answers = [("answer", answer, self.pool.restarts) for answer in serve(parts)]
            except Exception as err:  # every process stops with the first's error, none waits for a batch
                failure = err
                answers = [("error", one_line(err))] * self.lanes.world
        out = [None]
        dist.scatter_object_list(out, answers, src=0, group=group)
        if failure is not None:
            raise failure
        if out[0][0] == "error":
            raise TrainingError(f"rollout workers (on training process 0): {out[0][1]}")
        _, answer, self._restarts = out[0]
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
        return self.pool.restarts if self.pool is not None else self._restarts

    @property
    def calls(self) -> int:
        return self.pool.calls if self.pool is not None else 0

    @property
    def workers(self) -> list:
        return self.pool.workers if self.pool is not None else []

    def pids(self) -> list[int]:
        return self.pool.pids() if self.pool is not None else []

    def attentions(self) -> list[str]:
        return self.pool.attentions() if self.pool is not None else []

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
