"""A rollout worker's process: it builds its engine (and the frozen reference, where it scores one), takes weight
pushes into a staging copy on a receiver thread, and answers sampling and scoring requests (`serve`)."""

from __future__ import annotations

import contextlib
import datetime
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist

from posttrain.core import micro
from posttrain.core.batch import Batch
from posttrain.core.launch import forget_launcher
from posttrain.core.precision import MIXED
from posttrain.rollout.base import RolloutEngine, Setup, get
from posttrain.rollout.workers.spec import FAULT, POLL_S, WorkerSpec, bounded, one_line, prefix


class Staging:
    """The newest weights the receiver took (flat buckets, on `device`: the GPU under NCCL), until the worker's loop
    swaps them into its engine."""

    def __init__(self, engine: RolloutEngine, device: torch.device | str = "cpu"):
        self.engine, self.device, self.cond = engine, torch.device(device), threading.Condition()
        self.layout, self.buffers = None, []
        self.staged, self.applied = -1, -1  # versions: complete in the buffers, in the engine

    def receive(self, group, version: int, layout: list, timeout: datetime.timedelta, bound_s: float) -> None:
        """Takes version `version` into the buffers, its collectives on a thread of their own that this one waits
        for at most `bound_s` seconds. While the buffers change they hold no version newer than the engine's, so a
        push that fails or times out half way is discarded: nothing of it reaches the engine."""
        with self.cond:
            if layout != self.layout:
                self.buffers = [torch.empty(numel, dtype=getattr(torch, dtype), device=self.device)
                                for dtype, numel, _ in layout]
                self.layout = layout
            self.staged = self.applied  # a complete version not yet swapped in is being overwritten by a newer one

        def take():
            for buf in self.buffers:
                group.broadcast(buf, 0, timeout).wait()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # NCCL's wait orders the stream; the host waits here

        bounded(take, bound_s, f"taking weights version {version}")
        with self.cond:
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


def fault(kind: str, count: int, incarnation: int, kill=None) -> None:
    """Fault injection ($POSTTRAIN_WORKER_FAULT=kind:count) for the worker-death and hang tests: `kill` ends this
    worker (default: SIGKILL to its process; a Ray actor has Ray kill it), after which it hangs until it is gone."""
    if incarnation == 0 and os.environ.get(FAULT) == f"{kind}:{count}":
        if kind.startswith("die"):
            (kill or (lambda: os.kill(os.getpid(), signal.SIGKILL)))()
        while True:  # hang (or wait to be killed)
            time.sleep(3600)


def start_engine(spec: WorkerSpec, device: torch.device | str = "cpu") -> tuple[RolloutEngine, str]:
    """The worker's own engine, on its own copy of the starting policy (built as the trainer builds its sampler) on
    `device`, and the attention it samples with as the model reports it (an engine without a module: its name)."""
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
        policy.to(device)
    engine = get(spec.engine).start(Setup(policy=policy, model_path=Path(spec.model_path), pad_id=spec.pad_id,
                                          stop_ids=list(spec.stop_ids), sampling=spec.sampling,
                                          precision=spec.precision, seed=spec.seed, max_seqs=spec.max_seqs))
    config = getattr(lora.hf_model(policy), "config", None) if policy is not None else None
    return engine, getattr(config, "_attn_implementation", None) or spec.engine


def load_frozen(spec: WorkerSpec, device: torch.device | str = "cpu") -> dict[str, torch.nn.Module]:
    """The frozen models a worker scores with under rollout.reference_on=workers, by the batch field their log-probs
    fill: "ref_logp" (the reference) and "teacher_logp" (the distillation teacher), where the spec names them. Each
    with the model's own attention (SDPA): it only runs forwards, where SDPA is the faster on CPU (bf16, long
    completions, one thread: 0.68 s against eager's 1.1 s for 64 rows, AVX512-BF16 without AMX); the eager attention
    the trainer gives its models under bf16 is for the update's backward."""
    from posttrain.models.loading import load

    out = {}
    for field, path in (("ref_logp", spec.reference), ("teacher_logp", spec.teacher)):
        if path is not None:
            model, _ = load(path, dtype=spec.reference_dtype)
            out[field] = model.to(device).eval().requires_grad_(False)
    return out


@torch.no_grad()
def reference_logprobs(model: torch.nn.Module | None, batch: Batch, rows: int, tokens: int | None = None,
                       packing: bool = False) -> torch.Tensor:
    """log π of `batch`'s response tokens under a frozen `model` (the reference, or the teacher) ([B, R] float32), cut
    into micro-batches as the trainer's scoring passes are (posttrain.core.micro: `rows` rows, or a budget of `tokens` tokens; packed where `packing` asks and the model
    can), each trimmed of its all-padding columns."""
    from posttrain.models.scoring import packs, token_logprobs

    if model is None:
        raise RuntimeError("asked for log-probs under a frozen model, and this worker holds none")
    packed = packing and packs(model)
    device = next(model.parameters()).device
    out = torch.zeros(batch.mask.shape)  # [B, R]
    for idx in micro.split(batch.lengths(), 1, rows, tokens, packed):  # single rows: an online source's
        mb = batch.select(idx).trimmed().to(device)
        part = token_logprobs(model, mb.input_ids, mb.attention_mask, mb.prompt_len, temperature=batch.temperature,
                              packed=packed)
        out[idx, : part.shape[1]] = part.float().cpu()
    return out


class Core:
    """What a worker holds and does, whatever carries its messages (queues of the training process's spawned
    processes here, Ray's calls in posttrain.rollout.workers.actors): its weights group, its engine and reference, the
    staging of pushed weights, and the answers to requests."""

    def __init__(self, spec: WorkerSpec, index: int, incarnation: int, cpus: list[int] | None, kill=None):
        self.spec, self.index, self.incarnation, self.kill = spec, index, incarnation, kill
        self.timeout = datetime.timedelta(seconds=spec.timeout_s)
        forget_launcher()  # an engine that reads torchrun's variables (vLLM) would take it for a training process
        if cpus:
            os.sched_setaffinity(0, cpus)
        torch.set_num_threads(spec.threads)
        self.device = torch.device("cuda", 0) if spec.gpus else torch.device("cpu")  # its own: CUDA_VISIBLE_DEVICES
        if spec.gpus:
            torch.cuda.set_device(self.device)
        self.mixed = MIXED.get(spec.precision)  # the trainer samples under the same autocast
        self.served = self.scored = self.pushes = 0
        self.idle_since = time.perf_counter()

    def connect(self, host: str, port: int, device_host: str | None = None) -> str:
        """Joins the weights group of two over the trainer's store at `host`:`port`, builds the engine and the
        frozen models it scores with (the reference, the teacher); returns the attention it samples with."""
        store = dist.TCPStore(host, port, is_master=False, timeout=self.timeout)
        self.group = weights_group(dist.PrefixStore(prefix(self.index, self.incarnation), store), 1, self.timeout,
                                   device_host, self.spec.transport)
        self.engine, attention = start_engine(self.spec, self.device)
        self.frozen = load_frozen(self.spec, self.device)  # the reference and the teacher, where it scores them
        self.staging = Staging(self.engine, self.device if self.spec.transport == "nccl" else "cpu")
        return attention

    def take(self, version: int, layout: list) -> None:
        """One weight push, into the staging copy (on the receiving thread)."""
        self.pushes += 1
        fault("die_weights", self.pushes, self.incarnation, self.kill)
        fault("hang_weights", self.pushes, self.incarnation, self.kill)
        self.staging.receive(self.group, version, layout, op_timeout(self.timeout), self.spec.timeout_s)

    def answer(self, rid: int, kind: str, payload) -> tuple:
        """The reply to one request: a sampled batch, the log-probs under its frozen models, or a one-line error."""
        idle = time.perf_counter() - self.idle_since
        self.served += 1
        fault("die", self.served, self.incarnation, self.kill)
        fault("hang", self.served, self.incarnation, self.kill)
        spec = self.spec
        try:
            with torch.autocast(self.device.type, dtype=self.mixed) if self.mixed else contextlib.nullcontext():
                if kind == "score":
                    self.scored += 1
                    fault("die_scoring", self.scored, self.incarnation, self.kill)
                    if not self.frozen:
                        raise RuntimeError("asked for log-probs under a frozen model, and this worker holds none")
                    return ("scores", rid, {field: reference_logprobs(model, payload, spec.micro, spec.micro_tokens,
                                                                      spec.packing)
                                            for field, model in self.frozen.items()}, idle)
                prompts, n, sampling, min_version, rng = payload
                version = self.staging.apply(min_version, spec.timeout_s)
                torch.set_rng_state(rng)
                if self.device.type == "cuda":  # a GPU samples from its own generator, seeded from the stream given
                    torch.cuda.manual_seed(int(torch.randint(2**62, (1,))))
                batch = self.engine.generate(prompts, n, **sampling).to("cpu")
                return ("batch", rid, batch, version, torch.get_rng_state(), idle)
        except Exception as err:  # noqa: BLE001 - a sampling error is the run's, not the worker's
            return ("error", rid, one_line(err))
        finally:
            self.idle_since = time.perf_counter()


def op_timeout(bound: datetime.timedelta) -> datetime.timedelta:
    """The weights group's own time-out on an operation: twice the bound its caller waits (`bounded`), so that the
    caller's watchdog, which NCCL needs, is what stops a hung push under gloo too, and the tests on gloo exercise it."""
    return 2 * bound


def weights_group(store, rank: int, timeout: datetime.timedelta, host: str | None = None, backend: str = "gloo"):
    """The weights group of two over `store`: gloo, or NCCL between the trainer's GPU and the worker's. On one
    machine gloo binds the address the host name resolves to; a worker on another node binds `host`, its node's
    address as Ray knows it (GLOO_SOCKET_IFNAME, where set, names the interface instead)."""
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = op_timeout(timeout)
        return dist.ProcessGroupNCCL(store, rank, 2, options)
    if host is None or os.environ.get("GLOO_SOCKET_IFNAME"):
        return dist.ProcessGroupGloo(store, rank, 2, timeout)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(store, rank, 2, options)


GONE = object()  # next_message's answer when the training process has exited


def next_message(messages, parent: int):
    """The next item of a queue from the training process, or GONE once that process (`parent`) has exited."""
    while True:
        try:
            return messages.get(timeout=POLL_S)
        except queue.Empty:
            if os.getppid() != parent:
                return GONE


def receive(core: Core, inbox, parent: int) -> None:
    """The receiver thread: takes each pushed version into the staging buffers."""
    while True:
        message = next_message(inbox, parent)
        if message is GONE:
            os._exit(0)
        if message is None:
            return
        try:
            core.take(*message)
        except Exception:  # the trainer gave up on this push and restarts this worker
            os._exit(3)


def serve(spec: WorkerSpec, index: int, incarnation: int, port: int, cpus: list[int] | None, requests, inbox,
          replies) -> None:
    """A worker process's main: connect, build the engine, then answer sampling requests until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the training process's to handle (it stops this one)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # blocked by `_spawn` until now: a pending one drops
    parent = os.getppid()
    try:
        core = Core(spec, index, incarnation, cpus)
        replies.put(("hello", os.getpid()))
        attention = core.connect("127.0.0.1", port)
        threading.Thread(target=receive, args=(core, inbox, parent), daemon=True, name="posttrain-weights").start()
    except BaseException as err:  # noqa: BLE001 - reported to the trainer, which names this worker
        replies.put(("error", None, one_line(err)))
        return
    replies.put(("ready", os.getpid(), attention, str(core.device)))
    while True:
        message = next_message(requests, parent)
        if message is None or message is GONE:
            leave(replies)
        replies.put(core.answer(*message))


def leave(replies) -> None:
    """Ends a worker told to stop, once its replies are sent, without the interpreter's finalization: the weights
    thread may be waiting in a gloo collective, and destroying the group under it aborts the process with
    "terminate called without an active exception" on the run's stderr, though nothing went wrong."""
    replies.close()
    replies.join_thread()  # what was put is in the pipe
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
