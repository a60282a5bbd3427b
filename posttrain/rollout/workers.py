"""Rollout workers: sampling in processes of their own, apart from the trainer (`rollout.placement=separate`).

The training process starts each worker with torch.multiprocessing (spawn). A worker loads the starting policy
itself and runs a registered rollout engine on it (hf, or vllm), on its own cores and threads. It takes:

- sampling requests, from a queue: prompts, group sizes, sampling settings, the oldest policy version it may sample
  with, and the random generator's state to sample from. It answers with the batch, the version that sampled it,
  the generator's state after it, and how long it sat idle before the request;
- scoring requests (`rollout.reference_on=workers`): a batch it sampled, made into training rows, whose log-probs
  under the frozen reference model it holds beside its engine it answers with;
- weights, on a receiver thread: numbered versions over a gloo process group of two (trainer and worker), in
  buckets of at most `rollout.weight_bucket_mb`, into a staging copy. The worker swaps the newest staged version in
  at the start of its next request, so a push never waits for a rollout to end and never changes weights mid-rollout.

Why this machinery: torch.multiprocessing's queues carry tensors through shared memory, and a gloo group gives
collective transfers with a time-out on every operation; both ship with torch, and the group is the same code that
runs NCCL between GPUs. A worker that dies (its process gone) or hangs (a push or a request unanswered for
`rollout.worker_timeout_s`) is killed and started again, takes the last pushed weights, and gets its request again
with the same generator state, so it samples the same tokens; the log says so in a line and metrics.jsonl counts it
(`rollout/worker_restarts`). After `rollout.max_worker_restarts` restarts of one worker the run stops with an error
naming it. A worker whose training process has gone exits within a second.

Ctrl-C sends SIGINT to every process of the terminal's process group, the workers too. They ignore it, from the moment
they start (a worker starts with SIGINT blocked, and ignores it before unblocking it): the interrupt is the training
process's, which says so in one line and stops its workers (`close`), with no traceback from them.

Under LoRA with the hf engine, a worker holds the same adapted model and takes the adapter alone; vllm takes the
merged weights (`weight_sync` in summary.json says which was sent).
"""

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
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from posttrain.core import micro
from posttrain.core.batch import Batch, concat
from posttrain.core.errors import TrainingError
from posttrain.core.faults import crash_point
from posttrain.core.launch import forget_launcher
from posttrain.core.precision import MIXED
from posttrain.rollout.base import RolloutEngine, Setup, counts, get

POLL_S = 1.0  # how often a waiting side looks whether the other is still alive
START_S = 300.0  # the least time a worker is given to start (import torch, load the model, start its engine)
FAULT = "POSTTRAIN_WORKER_FAULT"  # fault injection for the tests: die:N, hang:N (the N-th request), die_scoring:N
# (the N-th reference scoring request) or hang_weights:N (the N-th weight push), in a worker's first incarnation only


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to build its engine: picklable, the same for every worker and incarnation."""

    engine: str  # a registered rollout engine
    model_path: str
    dtype: str  # the trained policy's weight dtype: a worker samples from the same numbers
    precision: str  # train.precision as it runs (autocast under the mixed ones)
    lora: Any  # the LoraConfig when the worker takes adapters (hf engine under LoRA); None: whole weights
    sampling: Any  # the rollout.* keys
    pad_id: int
    stop_ids: tuple[int, ...]
    seed: int
    max_seqs: int
    threads: int
    timeout_s: float
    attention: str | None = None  # the attention implementation to sample with (the trainer's); None: the model's own
    reference: str | None = None  # rollout.reference_on=workers: the reference model's directory; None: no reference
    reference_dtype: str = "float32"  # its frozen weights' dtype, as the trainer would hold them
    micro: int = 256  # rows of one reference forward (train.micro_batch_size), as the trainer's scoring passes cut
    micro_tokens: int | None = None  # train.micro_batch_tokens: a token budget instead, where set
    packing: bool = False  # train.packing: sequences packed end to end, where the reference model can confine
    # attention to each (posttrain.models.scoring.packs)


# -- the worker process -----------------------------------------------------------------------------------------------
class Staging:
    """The newest weights the receiver took (flat buckets), until the worker's loop swaps them into its engine."""

    def __init__(self, engine: RolloutEngine):
        self.engine, self.cond = engine, threading.Condition()
        self.layout, self.buffers = None, []
        self.staged, self.applied = -1, -1  # versions: in the buffers, in the engine

    def receive(self, group, version: int, layout: list, timeout: datetime.timedelta) -> None:
        with self.cond:
            if layout != self.layout:
                self.buffers = [torch.empty(numel, dtype=getattr(torch, dtype)) for dtype, numel, _ in layout]
                self.layout = layout
            for buf in self.buffers:
                group.broadcast(buf, 0, timeout).wait()
            self.staged = version
            self.cond.notify_all()

    def apply(self, min_version: int, timeout_s: float) -> int:
        """Swaps in the newest staged weights (waiting for `min_version` to arrive); returns the version in use."""
        with self.cond:
            if not self.cond.wait_for(lambda: self.staged >= min_version, timeout_s):
                raise TimeoutError(f"weights version {min_version} did not arrive within {timeout_s:g} s")
            if self.staged > self.applied:
                self.engine.load_weights(unpack(self.layout, self.buffers))
                self.applied = self.staged
            return self.applied


def unpack(layout: list, buffers: list[torch.Tensor]) -> Iterable[tuple[str, torch.Tensor]]:
    for (_, _, entries), buf in zip(layout, buffers):
        for name, shape, offset, numel in entries:
            yield name, buf[offset : offset + numel].view(shape)


def fault(kind: str, count: int, incarnation: int) -> None:
    """Fault injection ($POSTTRAIN_WORKER_FAULT=kind:count) for the worker-death and hang tests."""
    if incarnation == 0 and os.environ.get(FAULT) == f"{kind}:{count}":
        if kind.startswith("die"):
            os.kill(os.getpid(), signal.SIGKILL)
        while True:  # hang
            time.sleep(3600)


def start_engine(spec: WorkerSpec) -> tuple[RolloutEngine, str]:
    """The worker's own engine, on its own copy of the starting policy (built as the trainer builds its sampler), and
    the attention it samples with as the model reports it (an engine without a module: its name)."""
    from posttrain.models import lora
    from posttrain.models.gated_mlp import lean_gated_mlps
    from posttrain.models.loading import load

    policy = None
    if get(spec.engine).colocated:  # an engine that samples from a module: this process's copy
        policy, _ = load(spec.model_path, dtype=spec.dtype)
        if spec.attention and hasattr(policy, "set_attn_implementation"):
            policy.set_attn_implementation(spec.attention)
        lean_gated_mlps(policy)
        if spec.lora is not None:
            policy = lora.hf_model(lora.apply(policy, spec.lora, spec.model_path))
    engine = get(spec.engine).start(Setup(policy=policy, model_path=Path(spec.model_path), pad_id=spec.pad_id,
                                          stop_ids=list(spec.stop_ids), sampling=spec.sampling,
                                          precision=spec.precision, seed=spec.seed, max_seqs=spec.max_seqs))
    config = getattr(lora.hf_model(policy), "config", None) if policy is not None else None
    return engine, getattr(config, "_attn_implementation", None) or spec.engine


def load_reference(spec: WorkerSpec) -> torch.nn.Module | None:
    """The frozen reference model a worker scores with under rollout.reference_on=workers (None otherwise), with the
    model's own attention (SDPA): it only runs forwards, where SDPA is the faster on CPU (bf16, long completions,
    one thread: 0.68 s against eager's 1.1 s for 64 rows, AVX512-BF16 without AMX); the eager attention the trainer
    gives its models under bf16 is for the update's backward."""
    if spec.reference is None:
        return None
    from posttrain.models.loading import load

    model, _ = load(spec.reference, dtype=spec.reference_dtype)
    return model.eval().requires_grad_(False)


def scoring_rows(batch: Batch) -> Batch:
    """What reference scoring reads of a batch (ids, masks, P, τ), nothing more to send through a queue or a group."""
    return Batch(batch.input_ids, batch.attention_mask, batch.mask, batch.prompt_len, temperature=batch.temperature)


@torch.no_grad()
def reference_logprobs(model: torch.nn.Module | None, batch: Batch, rows: int, tokens: int | None = None,
                       packing: bool = False) -> torch.Tensor:
    """log π_ref of `batch`'s response tokens ([B, R] float32), cut into micro-batches as the trainer's scoring passes
    are (posttrain.core.micro: `rows` rows, or a budget of `tokens` tokens; packed where `packing` asks and the model
    can), each trimmed of its all-padding columns."""
    from posttrain.models.scoring import packs, token_logprobs

    if model is None:
        raise RuntimeError("asked for reference log-probs, and this worker holds no reference model")
    packed = packing and packs(model)
    out = torch.zeros(batch.mask.shape)  # [B, R]
    for idx in micro.split(batch.lengths(), 1, rows, tokens, packed):  # single rows: an online source's
        mb = batch.select(idx).trimmed()
        part = token_logprobs(model, mb.input_ids, mb.attention_mask, mb.prompt_len, temperature=batch.temperature,
                              packed=packed)
        out[idx, : part.shape[1]] = part.float()
    return out


GONE = object()  # next_message's answer when the training process has exited


def next_message(messages, parent: int):
    """The next item of a queue from the training process, or GONE once that process (`parent`) has exited."""
    while True:
        try:
            return messages.get(timeout=POLL_S)
        except queue.Empty:
            if os.getppid() != parent:
                return GONE


def receive(group, inbox, staging: Staging, parent: int, timeout: datetime.timedelta, incarnation: int) -> None:
    """The receiver thread: takes each pushed version into the staging buffers."""
    for pushes in itertools.count(1):
        message = next_message(inbox, parent)
        if message is GONE:
            os._exit(0)
        if message is None:
            return
        fault("hang_weights", pushes, incarnation)
        try:
            staging.receive(group, *message, timeout)
        except Exception:  # the trainer gave up on this push and restarts this worker
            os._exit(3)


def serve(spec: WorkerSpec, index: int, incarnation: int, port: int, cpus: list[int] | None, requests, inbox,
          replies) -> None:
    """A worker process's main: connect, build the engine, then answer sampling requests until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the training process's to handle (it stops this one)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # blocked by `_spawn` until now: a pending one drops
    parent = os.getppid()
    forget_launcher()  # an engine that reads torchrun's variables (vLLM) would take this worker for a training process
    try:
        if cpus:
            os.sched_setaffinity(0, cpus)
        torch.set_num_threads(spec.threads)
        replies.put(("hello", os.getpid()))
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
        group = dist.ProcessGroupGloo(dist.PrefixStore(prefix(index, incarnation), store), 1, 2, timeout)
        engine, attention = start_engine(spec)
        reference = load_reference(spec)
        staging = Staging(engine)
        threading.Thread(target=receive, args=(group, inbox, staging, parent, timeout, incarnation),
                         daemon=True, name="posttrain-weights").start()
    except BaseException as err:  # noqa: BLE001 - reported to the trainer, which names this worker
        replies.put(("error", None, one_line(err)))
        return
    replies.put(("ready", os.getpid(), attention))
    mixed = MIXED.get(spec.precision)  # the trainer samples under the same autocast
    idle_since, scored = time.perf_counter(), 0
    for served in itertools.count(1):
        message = next_message(requests, parent)
        if message is None or message is GONE:
            leave(replies)
        rid, kind, payload = message
        idle = time.perf_counter() - idle_since
        fault("die", served, incarnation)
        fault("hang", served, incarnation)
        try:
            with torch.autocast("cpu", dtype=mixed) if mixed else contextlib.nullcontext():
                if kind == "score":
                    scored += 1
                    fault("die_scoring", scored, incarnation)
                    replies.put(("scores", rid, reference_logprobs(reference, payload, spec.micro, spec.micro_tokens, spec.packing), idle))
                else:
                    prompts, n, sampling, min_version, rng = payload
                    version = staging.apply(min_version, spec.timeout_s)
                    torch.set_rng_state(rng)
                    batch = engine.generate(prompts, n, **sampling)
                    replies.put(("batch", rid, batch, version, torch.get_rng_state(), idle))
        except Exception as err:  # noqa: BLE001 - a sampling error is the run's, not the worker's
            replies.put(("error", rid, one_line(err)))
        idle_since = time.perf_counter()


def leave(replies) -> None:
    """Ends a worker told to stop, once its replies are sent, without the interpreter's finalization: the weights
    thread may be waiting in a gloo collective, and destroying the group under it aborts the process with
    "terminate called without an active exception" on the run's stderr, though nothing went wrong."""
    replies.close()
    replies.join_thread()  # what was put is in the pipe
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


def prefix(index: int, incarnation: int) -> str:
    return f"posttrain/rollout/{index}.{incarnation}/"


# -- the trainer's side -----------------------------------------------------------------------------------------------
@dataclass
class Worker:
    """One worker process and its channels, as the trainer holds them."""

    index: int
    incarnation: int
    process: Any
    requests: Any  # sampling requests
    inbox: Any  # weight push headers
    replies: Any
    group: Any = None  # the gloo group of two, once connected
    pid: int | None = None
    attention: str | None = None  # what its engine samples with, as the worker reported it

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=10)

    @property
    def who(self) -> str:
        return f"rollout worker {self.index} (pid {self.pid or self.process.pid})"


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


class WorkerPool(RolloutEngine):
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
    """

    colocated = False

    def __init__(self, spec: WorkerSpec, workers: int, *, cpus: list[list[int]] | None, shared_rng: bool,
                 max_restarts: int, bucket_mb: float):
        if shared_rng and workers != 1:
            raise ValueError("WorkerPool: a shared generator needs exactly one worker")
        self.spec, self.name, self.cpus, self.shared_rng = spec, spec.engine, cpus, shared_rng
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
        self._context = torch.multiprocessing.get_context("spawn")
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=self.timeout)
        self.workers: list[Worker] = []
        self.closed = False
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
            raise

    # -- processes --------------------------------------------------------------------------------------------
    def _spawn(self, index: int, incarnation: int, started: list[Worker] | None = None) -> Worker:
        """Starts worker `index`'s process (added to `started` as soon as it runs, so that a Ctrl-C arriving as
        SIGINT is unblocked leaves no worker that the caller's clean-up does not know of)."""
        ctx = self._context
        requests, inbox, replies = ctx.Queue(), ctx.Queue(), ctx.Queue()
        process = ctx.Process(target=serve, name=f"posttrain-rollout-{index}", daemon=False, args=(
            self.spec, index, incarnation, self.store.port, self.cpus[index] if self.cpus else None, requests, inbox,
            replies))
        # The new process inherits this thread's signal mask through fork and exec: with SIGINT blocked, a Ctrl-C
        # while it starts (imports torch, unpickles `serve`'s arguments) waits until `serve` ignores it, rather than
        # stopping it with a traceback. This process still takes the interrupt, in another thread or once unblocked.
        masked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            process.start()
            worker = Worker(index, incarnation, process, requests, inbox, replies)
            if started is not None:
                started.append(worker)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, masked)
        return worker

    def _wait(self, w: Worker, kind: str, what: str) -> tuple:
        """The worker's next message of `kind` (its start: imports and the model's load, given at least
        START_S); an error, its death or the time-out raise."""
        limit = max(self.spec.timeout_s, START_S)
        deadline = time.monotonic() + limit
        while True:
            try:
                message = w.replies.get(timeout=POLL_S)
            except queue.Empty:
                if not w.process.is_alive():
                    raise TrainingError(f"{w.who} exited (code {w.process.exitcode}) before {what}") from None
                if time.monotonic() > deadline:
                    raise TrainingError(f"{w.who} did not {what} within {limit:g} s") from None
                continue
            if message[0] == "error":
                raise TrainingError(f"{w.who} could not start: {message[2]}")
            if message[0] == kind:
                return message

    def _connect(self, w: Worker) -> None:
        w.pid = self._wait(w, "hello", "start")[1]
        w.group = dist.ProcessGroupGloo(dist.PrefixStore(prefix(w.index, w.incarnation), self.store), 0, 2,
                                        self.timeout)
        w.attention = self._wait(w, "ready", "load its engine")[2]

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

    def score_reference(self, batch: Batch) -> torch.Tensor:
        """`batch`'s log-probs under the reference model the workers hold (rollout.reference_on=workers): [B, R]
        float32, its rows shared between the workers."""
        return self.score_references([batch])[0]

    def score_references(self, parts: list[Batch]) -> list[torch.Tensor]:
        """`score_reference` of several batches in one call: one a training process, when several share the
        workers."""
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
            out.append(torch.cat(answers[:n]))
            answers = answers[n:]
        return out

    def _send(self, r: Request) -> None:
        w = self.workers[r.worker]
        r.incarnation = w.incarnation
        if r.rows is not None:
            w.requests.put((r.id, "score", r.rows))
        else:
            w.requests.put((r.id, "sample", (r.prompts, r.n, r.sampling, r.min_version, r.rng)))

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
            try:
                message = w.replies.get(timeout=POLL_S)
            except queue.Empty:
                why = None
                if not w.process.is_alive():
                    why = f"died (exit code {w.process.exitcode})"
                elif time.monotonic() > deadline:
                    why = f"did not answer a sampling request within {self.spec.timeout_s:g} s (rollout.worker_timeout_s)"
                if why:
                    self._restart(r.worker, r.incarnation, why)
                continue
            if message[0] == "error" and message[1] == r.id:
                raise TrainingError(f"{w.who}: {message[2]}")
            if message[0] in ("batch", "scores") and message[1] == r.id:
                return message[2:]

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
                self.buffers = [torch.empty(numel, dtype=getattr(torch, d)) for d, numel, _ in self.layout]
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
                except RuntimeError as err:
                    self._restart(w.index, w.incarnation, f"did not take weights version {version} "
                                  f"({one_line(err)[:160]})")
            self.pushed = version
        return sum(b.numel() * b.element_size() for b in self.buffers)

    def _push_to(self, w: Worker, version: int) -> None:
        w.inbox.put((version, self.layout))
        for i, buf in enumerate(self.buffers):
            w.group.broadcast(buf, 0, self.timeout).wait()
            if i == 0:
                crash_point("push", version)  # fault injection: the training process killed mid-push

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
            w.requests.put(None)
            w.inbox.put(None)
        for w in workers:
            w.process.join(timeout=10)
            w.kill()


def _close(ref) -> None:
    pool = ref()
    if pool is not None:
        pool.close()
