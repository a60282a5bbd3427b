"""The trainer's side: the pool of worker processes as a rollout engine (`WorkerPool`), which starts, feeds, watches
and restarts them and pushes each numbered weight version in bounded buckets."""

from __future__ import annotations

import atexit
import contextlib
import datetime
import itertools
import os
import queue
import signal
import sys
import threading
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from posttrain.core.batch import Batch, concat
from posttrain.core.errors import TrainingError
from posttrain.core.faults import crash_point
from posttrain.core.launch import main_unimported
from posttrain.rollout.base import Workers, counts, get
from posttrain.rollout.workers.process import op_timeout, serve, unpack, weights_group
from posttrain.rollout.workers.spec import POLL_S, START_S, WorkerSpec, bounded, one_line, prefix, scoring_rows


@dataclass
class LocalWorker:
    """One worker process of the training process (rollout.launcher=local) and its channels, as the trainer holds
    them. Every launcher's worker answers the same calls (`hello`, `ready`, `send`, `announce`, `poll`, `gone`,
    `kill`, `stop`)."""

    index: int
    incarnation: int
    process: Any
    requests: Any  # sampling requests
    inbox: Any  # weight push headers
    replies: Any
    group: Any = None  # the gloo group of two, once connected
    pid: int | None = None
    attention: str | None = None  # what its engine samples with, as the worker reported it
    node: str | None = None  # the node it runs on, where a launcher places workers on several (Ray's node id)
    device: str | None = None  # where it samples (cpu, cuda:0 of its own CUDA_VISIBLE_DEVICES), as it reported

    @property
    def who(self) -> str:
        return f"rollout worker {self.index} (pid {self.pid or self.process.pid})"

    def _wait(self, kind: str, what: str, limit: float) -> tuple:
        """The worker's next message of `kind`; an error, its death or the time-out raise."""
        deadline = time.monotonic() + limit
        while True:
            try:
                message = self.replies.get(timeout=POLL_S)
            except queue.Empty:
                if not self.process.is_alive():
                    raise TrainingError(f"{self.who} exited (code {self.process.exitcode}) before {what}") from None
                if time.monotonic() > deadline:
                    raise TrainingError(f"{self.who} did not {what} within {limit:g} s") from None
                continue
            if message[0] == "error":
                raise TrainingError(f"{self.who} could not start: {message[2]}")
            if message[0] == kind:
                return message

    def hello(self, limit: float) -> int:
        """Waits for the process to start (imports); its pid."""
        self.pid = self._wait("hello", "start", limit)[1]
        return self.pid

    def ready(self, limit: float) -> str:
        """Waits for its engine to load; the attention it samples with."""
        _, _, self.attention, self.device = self._wait("ready", "load its engine", limit)
        return self.attention

    def send(self, message: tuple) -> None:
        self.requests.put(message)

    def announce(self, version: int, layout: list) -> None:
        self.inbox.put((version, layout))

    def poll(self, timeout: float) -> tuple | None:
        try:
            return self.replies.get(timeout=timeout)
        except queue.Empty:
            return None

    def gone(self) -> str | None:
        """Why it is no longer there (None: alive)."""
        return None if self.process.is_alive() else f"died (exit code {self.process.exitcode})"

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=10)

    def stop(self) -> None:
        self.requests.put(None)
        self.inbox.put(None)

    def join(self, timeout: float) -> None:
        self.process.join(timeout=timeout)


@contextlib.contextmanager
def visible_devices(devices: list[int] | None):
    """CUDA_VISIBLE_DEVICES set to `devices` (None: unchanged) while a worker process starts: it inherits it."""
    if devices is None:
        yield
        return
    old = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, devices))
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES")
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = old


class LocalLauncher:
    """rollout.launcher=local: each worker a process the training process spawns on its own machine (torch
    multiprocessing), on the cores the plan gives it."""

    name = "local"
    host = "127.0.0.1"  # where the workers reach the trainer's store
    device_host = None  # gloo binds the address the host name resolves to

    def __init__(self, spec: WorkerSpec, cpus: list[list[int]] | None, gpus: list[list[int]] | None = None):
        self.spec, self.cpus, self.gpus = spec, cpus, gpus  # gpus: each worker's CUDA devices (rollout.gpus)
        self._context = torch.multiprocessing.get_context("spawn")
        self._environ = threading.Lock()  # a worker's CUDA_VISIBLE_DEVICES is this process's while it starts

    def spawn(self, index: int, incarnation: int, port: int, started: list | None = None) -> LocalWorker:
        """Starts worker `index`'s process (added to `started` as soon as it runs, so that a Ctrl-C arriving as
        SIGINT is unblocked leaves no worker that the caller's clean-up does not know of)."""
        ctx = self._context
        requests, inbox, replies = ctx.Queue(), ctx.Queue(), ctx.Queue()
        process = ctx.Process(target=serve, name=f"posttrain-rollout-{index}", daemon=False, args=(
            self.spec, index, incarnation, port, self.cpus[index] if self.cpus else None, requests, inbox, replies))
        # The new process inherits this thread's signal mask through fork and exec: with SIGINT blocked, a Ctrl-C
        # while it starts (imports torch, unpickles `serve`'s arguments) waits until `serve` ignores it, rather than
        # stopping it with a traceback. This process still takes the interrupt, in another thread or once unblocked.
        masked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            with self._environ, visible_devices(self.gpus[index] if self.gpus else None), main_unimported():
                process.start()
            worker = LocalWorker(index, incarnation, process, requests, inbox, replies)
            if started is not None:
                started.append(worker)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, masked)
        return worker

    def report(self) -> dict:
        return {}

    def close(self) -> None:
        pass


@dataclass
class Request:
    id: int
    worker: int  # the index it goes to
    prompts: list[list[int]]
    n: int | list[int]
    sampling: dict
    min_version: int
    rng: torch.Tensor
    incarnation: int = -1  # of the worker it was last sent to
    first: int = 0  # the index of its first prompt in the call's prompts
    rows: Batch | None = None  # a scoring request's rows (then prompts, n, sampling, rng are unused)


@dataclass
class Layout:
    """How the pushed weights lie in the flat buckets: [(dtype, numel, [(name, shape, offset, numel)])]."""

    buckets: list = field(default_factory=list)

    @classmethod
    def of(cls, tensors: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> Layout:
        buckets = []
        for name, t in tensors:
            dtype, nbytes = str(t.dtype).removeprefix("torch."), t.numel() * t.element_size()
            last = buckets[-1] if buckets else None
            if last is None or last[0] != dtype or (last[1] * t.element_size() + nbytes > bucket_bytes and last[1]):
                last = [dtype, 0, []]
                buckets.append(last)
            last[2].append((name, tuple(t.shape), last[1], t.numel()))
            last[1] += t.numel()
        return cls([(d, n, entries) for d, n, entries in buckets])


class WorkerPool(Workers):
    """The rollout engine a trainer sees under `rollout.placement=separate`: its calls go to the worker processes.

    `generate` splits the prompts between the workers and joins their batches (each row's `version` is the policy
    version that sampled it); `load_weights` pushes a numbered version to every worker. Calls are safe from two
    threads (the producer's sampling, the loop's evaluation and pushes).

    Args:
        spec: what each worker builds.
        workers: how many.
        cpus: each worker's cores (None: not pinned).
        shared_rng: the workers (one) draw from this process's torch generator, as the colocated engine does, so that
            a run at max_staleness 0 samples the same tokens; False: each worker has its own stream from `spec.seed`.
        max_restarts: restarts of one worker before the run stops.
        bucket_mb: the bound of one weight bucket.
        launcher: what starts and watches the workers: a `LocalLauncher` (the default: processes of this one), or
            posttrain.rollout.workers.actors.RayLauncher (Ray actors in a placement group).
        gpus: each local worker's CUDA devices (rollout.gpus), or None.
    """

    colocated = False

    def __init__(self, spec: WorkerSpec, workers: int, *, cpus: list[list[int]] | None, shared_rng: bool,
                 max_restarts: int, bucket_mb: float, launcher=None, gpus: list[list[int]] | None = None):
        if shared_rng and workers != 1:
            raise ValueError("WorkerPool: a shared generator needs exactly one worker")
        self.spec, self.name, self.shared_rng = spec, spec.engine, shared_rng
        self.stops = get(spec.engine).stops  # the workers' engine stops a turn at an environment's strings
        self.takes_adapter = spec.lora is not None  # hf workers under LoRA hold the same adapted model
        self.max_restarts, self.bucket_bytes = max_restarts, int(bucket_mb * 2**20)
        self.timeout = datetime.timedelta(seconds=spec.timeout_s)
        self.version, self.pushed = 0, -1  # the version being pushed / the last one every worker took
        self.restarts, self.restarts_of = 0, [0] * workers
        self.idle = 0.0  # workers' idle seconds since the last `take_idle`
        self.layout, self.buffers, self.buffered = None, [], -1  # the last pushed weights, for a restarted worker
        self.rng = [torch.Generator().manual_seed(spec.seed * 7919 + i + 1).get_state() for i in range(workers)]
        self._ids, self.calls = itertools.count(), 0  # request ids; generate calls made
        self._requests, self._weights = threading.Lock(), threading.RLock()
        self.launcher = launcher or LocalLauncher(spec, cpus, gpus)
        # the pushed weights' buckets: on this process's GPU when they go over NCCL, else in CPU memory
        self.device = (torch.device("cuda", torch.cuda.current_device()) if spec.transport == "nccl"
                       else torch.device("cpu"))
        self.store = dist.TCPStore(self.launcher.host, 0, is_master=True, wait_for_workers=False,
                                   timeout=self.timeout)
        self.workers: list = []
        self.closed = False
        self.start_s, self.push_bytes = 0.0, 0  # seconds the workers took to start (set by who starts them); the
        # bytes of one push to one worker
        atexit.register(_close, weakref.ref(self))
        started = []  # bound before the first start: a Ctrl-C in `_spawn` comes to the clean-up below
        try:
            for i in range(workers):  # all start loading at once
                self._spawn(i, 0, started)
            for w in started:
                self._connect(w)
                self.workers.append(w)
        except BaseException:
            for w in started:
                w.kill()
            self.launcher.close()
            raise

    # -- processes --------------------------------------------------------------------------------------------
    def _spawn(self, index: int, incarnation: int, started: list | None = None):
        return self.launcher.spawn(index, incarnation, self.store.port, started)

    def _connect(self, w) -> None:
        """Waits for `w` to start (imports and the model's load, given at least START_S), joining its weights group
        as it does."""
        limit = max(self.spec.timeout_s, START_S)
        w.hello(limit)
        w.group = weights_group(dist.PrefixStore(prefix(w.index, w.incarnation), self.store), 0, self.timeout,
                                self.launcher.device_host, self.spec.transport)
        w.ready(limit)

    def _restart(self, index: int, incarnation: int, why: str) -> None:
        """Replaces worker `index` (if still incarnation `incarnation`: another thread may have done it) by a new
        process that holds the last pushed weights."""
        with self._weights:
            old = self.workers[index]
            if old.incarnation != incarnation:
                return
            self.restarts_of[index] += 1
            if self.restarts_of[index] > self.max_restarts:
                old.kill()
                raise TrainingError(f"{old.who} {why}, and was restarted {self.max_restarts} times already "
                                    "(rollout.max_worker_restarts); stopping")
            old.kill()
            new = self._spawn(index, incarnation + 1)
            try:
                self._connect(new)
                if self.buffers:
                    self._push_to(new, self.buffered)
            except BaseException:  # a Ctrl-C, or a start that failed: `close` would not know of this process
                new.kill()
                raise
            self.workers[index] = new
            self.restarts += 1
            print(f"posttrain: {old.who} {why}; restarted as pid {new.pid}, and its requests sent again",
                  file=sys.stderr)

    # -- sampling ---------------------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], n: int | list[int], *, max_new_tokens: int,
                 temperature: float = 1.0, top_p: float = 1.0, greedy: bool = False,
                 stop: list[list[int]] | None = None) -> Batch:
        sampling = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, greedy=greedy)
        if stop:  # a turn of a multi-turn episode: the worker's engine stops at these too
            sampling["stop"] = stop
        rng = torch.get_rng_state() if self.shared_rng else None
        [(batch, rng)] = self.sample([(prompts, n, rng)], sampling)
        if self.shared_rng:
            torch.set_rng_state(rng)
        return batch

    def sample(self, parts: list[tuple], sampling: dict) -> list[tuple[Batch, torch.Tensor | None]]:
        """One sampling call made of `parts`, (prompts, n, generator state) each: one per training process when
        several share the workers (posttrain.rollout.shared). Returns each part's batch, and with a shared generator
        (one worker, max_staleness 0) the part's generator state after it: the worker answers each part in turn from
        the part's own state, so it samples what that process's colocated engine would have. Otherwise the prompts
        of all parts are split between the workers, each drawing from its own stream, and the rows handed back by
        part."""
        with self._requests:
            requests = []
            if self.shared_rng:
                for prompts, n, rng in parts:
                    requests.append(Request(next(self._ids), 0, prompts, n, sampling, max(self.pushed, 0), rng))
            else:
                prompts = [p for part in parts for p in part[0]]
                sizes = [c for part in parts for c in counts(part[1], len(part[0]))]
                uniform = all(isinstance(part[1], int) and part[1] == parts[0][1] for part in parts)
                share = -(-len(prompts) // len(self.workers))
                for i, first in enumerate(range(0, len(prompts), share)):
                    part = slice(first, first + share)
                    n = parts[0][1] if uniform else sizes[part]
                    requests.append(Request(next(self._ids), i, prompts[part], n, sampling, max(self.pushed, 0),
                                            self.rng[i], first=first))
            for r in requests:
                self._send(r)
            self.calls += 1
            crash_point("request", self.calls)  # fault injection: the training process killed, prompts in flight
            batches = []
            for r in requests:
                batch, version, rng, idle = self._answer(r)
                if not self.shared_rng:
                    self.rng[r.worker] = rng
                self.idle += idle
                batch.version = torch.full((len(batch),), version, dtype=torch.long)  # [b]
                batch.group = batch.group + r.first
                batches.append((batch, rng))
        if self.shared_rng:
            return batches
        whole = batches[0][0] if len(batches) == 1 else concat([b for b, _ in batches], self.spec.pad_id)
        if len(parts) == 1:
            return [(whole, None)]
        out, first = [], 0
        for prompts, _, _ in parts:  # each part's rows: those answering its prompts, numbered from 0 again
            mine = (whole.group >= first) & (whole.group < first + len(prompts))
            rows = whole.select(mine)
            rows.group = rows.group - first
            out.append((rows.trimmed(), None))
            first += len(prompts)
        return out

    def score_frozen(self, batch: Batch) -> dict[str, torch.Tensor]:
        """`batch`'s log-probs under the frozen models the workers hold (rollout.reference_on=workers), by the batch
        field they fill ("ref_logp", "teacher_logp"): [B, R] float32 each, its rows shared between the workers."""
        return self.score_frozen_parts([batch])[0]

    def score_frozen_parts(self, parts: list[Batch]) -> list[dict[str, torch.Tensor]]:
        """`score_frozen` of several batches in one call: one a training process, when several share the workers."""
        with self._requests:
            requests, shares = [], []
            for batch in parts:
                rows = scoring_rows(batch)
                share = -(-len(batch) // len(self.workers))
                pieces = [rows.select(slice(first, first + share)) for first in range(0, len(batch), share)]
                shares.append(len(pieces))
                requests += [Request(next(self._ids), i, [], 0, {}, 0, None, rows=piece)
                             for i, piece in enumerate(pieces)]
            for r in requests:
                self._send(r)
            answers = []
            for r in requests:
                logp, idle = self._answer(r)
                self.idle += idle
                answers.append(logp)
        out = []
        for n in shares:
            out.append({field: torch.cat([a[field] for a in answers[:n]]) for field in answers[0]})
            answers = answers[n:]
        return out

    def _send(self, r: Request) -> None:
        w = self.workers[r.worker]
        r.incarnation = w.incarnation
        if r.rows is not None:
            w.send((r.id, "score", r.rows))
        else:
            w.send((r.id, "sample", (r.prompts, r.n, r.sampling, r.min_version, r.rng)))

    def _answer(self, r: Request) -> tuple:
        deadline = time.monotonic() + self.spec.timeout_s
        while True:
            if self.closed:
                raise TrainingError("rollout workers: closed while a request was waiting")
            w = self.workers[r.worker]
            if w.incarnation != r.incarnation:  # restarted by another thread meanwhile
                self._send(r)
                deadline = time.monotonic() + self.spec.timeout_s
                continue
            message = w.poll(POLL_S)
            if message is None:
                why = w.gone()
                if why is None and time.monotonic() > deadline:
                    why = (f"did not answer a sampling request within {self.spec.timeout_s:g} s "
                           "(rollout.worker_timeout_s)")
                if why:
                    self._restart(r.worker, r.incarnation, why)
                continue
            if message[0] == "error" and message[1] == r.id:
                raise TrainingError(f"{w.who}: {message[2]}")
            if message[0] in ("batch", "scores") and message[1] == r.id:
                return message[2:]

    def report(self) -> dict:
        return {"workers": len(self.workers), "pids": self.pids(), "attention": self.attentions(),
                "requests": self.calls, "restarts": self.restarts, "launcher": self.launcher.name,
                "start_s": round(self.start_s, 3), "push_mib": round(self.push_bytes / 2**20, 4),
                "devices": [w.device for w in self.workers], "transport": self.spec.transport,
                **self.launcher.report(), **({"nodes": [w.node for w in self.workers]}
                                            if any(w.node for w in self.workers) else {})}

    def pids(self) -> list[int]:
        """The live workers' process ids."""
        return [w.pid for w in self.workers]

    def attentions(self) -> list[str]:
        """The attention each live worker samples with, as it reported it."""
        return [w.attention for w in self.workers]

    def take_idle(self) -> float:
        """The workers' idle seconds since the last call."""
        idle, self.idle = self.idle, 0.0
        return idle

    # -- weights ----------------------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Pushes `weights` to every worker as version `self.version`; returns the bytes sent to each.

        The weights are taken one at a time into this process's flat buckets (on the CPU), so where a backend
        gathers each from its shards (fsdp2, zero3) only one whole weight at a time exists on the device."""
        version = self.version
        with self._weights, torch.no_grad():
            items = ((name, t.detach()) for name, t in weights)
            if self.layout is None:  # the first push lays the buckets out: the weights copied once, then placed
                items = [(name, t.to("cpu", copy=True)) for name, t in items]
                self.layout = Layout.of(items, self.bucket_bytes).buckets
                self.buffers = [torch.empty(numel, dtype=getattr(torch, d), device=self.device)
                                for d, numel, _ in self.layout]
            views = dict(unpack(self.layout, self.buffers))
            taken = 0
            for name, t in items:
                if name not in views:
                    raise TrainingError(f"rollout workers: weight {name} is not in the layout of the first push")
                views[name].copy_(t.reshape(views[name].shape))
                taken += 1
            if taken != len(views):
                raise TrainingError(f"rollout workers: {taken} weights to push, the layout holds {len(views)}")
            self.buffered = version
            for w in list(self.workers):
                try:
                    self._push_to(w, version)
                except (RuntimeError, TimeoutError) as err:
                    self._restart(w.index, w.incarnation, f"did not take weights version {version} "
                                  f"({one_line(err)[:160]})")
            self.pushed = version
        self.push_bytes = sum(b.numel() * b.element_size() for b in self.buffers)
        return self.push_bytes

    def _push_to(self, w, version: int) -> None:
        """Sends version `version` to `w`: its collectives on a thread of their own, waited for at most
        rollout.worker_timeout_s (a NCCL broadcast cannot time out by itself); past it, the group is aborted where
        it can be, and the caller restarts the worker."""
        w.announce(version, self.layout)

        def send():
            for i, buf in enumerate(self.buffers):
                w.group.broadcast(buf, 0, op_timeout(self.timeout)).wait()
                if i == 0:
                    crash_point("push", version)  # fault injection: the training process killed mid-push
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

        try:
            bounded(send, self.spec.timeout_s, f"pushing weights version {version}")
        except TimeoutError:
            with contextlib.suppress(Exception):  # NCCL's communicator, so that its thread ends
                getattr(w.group, "abort", lambda: None)()
            raise

    def release(self) -> None:
        pass  # the workers' memory is their own

    def restore(self) -> None:
        pass

    # -- checkpoints and shutdown -----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Each worker's generator stream (none when they draw from this process's generator)."""
        return {"rng": None if self.shared_rng else [r.clone() for r in self.rng]}

    def load_state_dict(self, state: dict) -> None:
        if state["rng"] is not None:
            self.rng = [r.clone() for r in state["rng"]]

    def close(self) -> None:
        """Stops the workers (killing those that do not stop within 10 s)."""
        self.closed = True
        workers, self.workers = self.workers, []
        for w in workers:
            w.stop()
        for w in workers:
            w.join(timeout=10)
            w.kill()
        self.launcher.close()


def _close(ref) -> None:
    pool = ref()
    if pool is not None:
        pool.close()
