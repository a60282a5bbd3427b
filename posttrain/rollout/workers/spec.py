"""What the trainer and its rollout workers share: the worker's recipe (`WorkerSpec`), the time limits, the fault
switch the tests use, and the rows a scoring request carries."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from posttrain.core.batch import Batch

POLL_S = 1.0  # how often a waiting side looks whether the other is still alive
START_S = 300.0  # the least time a worker is given to start (import torch, load the model, start its engine)
FAULT = "POSTTRAIN_WORKER_FAULT"  # fault injection for the tests: die:N, hang:N (the N-th request), die_scoring:N
# (the N-th reference scoring request), die_weights:N or hang_weights:N (the N-th weight push), in a worker's first
# incarnation only


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
    teacher: str | None = None  # rollout.reference_on=workers: the distillation teacher's directory; None: no teacher
    reference_dtype: str = "float32"  # the frozen models' weight dtype, as the trainer would hold them
    micro: int = 256  # rows of one reference forward (train.micro_batch_size), as the trainer's scoring passes cut
    micro_tokens: int | None = None  # train.micro_batch_tokens: a token budget instead, where set
    packing: bool = False  # train.packing: sequences packed end to end, where the reference model can confine
    # attention to each (posttrain.models.scoring.packs)
    gpus: int = 0  # rollout.gpus: the worker samples on a GPU of its own (its CUDA_VISIBLE_DEVICES: the launcher's)
    transport: str = "gloo"  # the weights group: gloo (buffers in CPU memory) or nccl (from the trainer's GPU to the
    # worker's)


def bounded(fn, timeout_s: float, what: str) -> None:
    """Runs `fn` on a thread of its own and waits for it at most `timeout_s` seconds, so that a collective which
    cannot time out by itself (NCCL's broadcast) cannot hold its caller past the bound. Raises TimeoutError naming
    `what` when `fn` has not returned by then (the thread is left to the process's end, or to the group's abort), or
    what `fn` raised."""
    done, failed = threading.Event(), []

    def run():
        try:
            fn()
        except BaseException as err:  # noqa: BLE001 - handed to the caller
            failed.append(err)
        finally:
            done.set()

    threading.Thread(target=run, daemon=True, name="posttrain-collective").start()
    if not done.wait(timeout_s):
        raise TimeoutError(f"{what} did not finish within {timeout_s:g} s")
    if failed:
        raise failed[0]


def one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


def prefix(index: int, incarnation: int) -> str:
    return f"posttrain/rollout/{index}.{incarnation}/"


def scoring_rows(batch: Batch) -> Batch:
    """What scoring under the frozen models reads of a batch (ids, masks, P, τ), nothing more to send through a queue
    or a group."""
    return Batch(batch.input_ids, batch.attention_mask, batch.mask, batch.prompt_len, temperature=batch.temperature)
