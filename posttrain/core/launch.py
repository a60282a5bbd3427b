"""What a launcher (torchrun, accelerate launch) tells each training process it starts, through the environment.

A process that a training process starts for a part of its own (a rollout worker, the embedded model's warm-up)
inherits those variables, and would take itself for one more training process: `forget_launcher` removes them.
"""

from __future__ import annotations

import contextlib
import os
import sys

from posttrain.core.errors import ConfigError

LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
                "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED")


def launched() -> bool:
    """True in a process a launcher started as one of several training processes."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1) > 1


def forget_launcher() -> None:
    """Removes the launcher's variables from this process's environment (and so from its children's)."""
    for key in LAUNCHER_ENV:
        os.environ.pop(key, None)


def local_world() -> int:
    """The training processes on this machine (LOCAL_WORLD_SIZE; 1 without a launcher): they use its first GPUs."""
    raw = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(raw) if raw.isdigit() and int(raw) > 0 else 1


def cuda_devices() -> int:
    """The CUDA devices this process sees (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def worker_gpus(workers: int, gpus: int, devices: int, trainers: int) -> tuple[tuple[int, ...], ...]:
    """Each of `workers` local rollout workers' `gpus` CUDA devices (rollout.gpus): the machine's last ones, after
    the `trainers` training processes' (devices 0 .. trainers − 1), of `devices` in all; refused in one line where
    there are not enough."""
    need = workers * gpus
    if devices == 0:
        raise ConfigError("rollout.gpus: this machine has no CUDA device; leave rollout.gpus=0 (workers on CPU "
                          "cores), or use rollout.launcher=ray with a cluster that has GPUs")
    if trainers + need > devices:
        raise ConfigError(f"rollout.gpus: {workers} worker(s) × {gpus} GPU and {trainers} training process(es) need "
                          f"{trainers + need} GPUs; this machine has {devices}")
    first = devices - need
    return tuple(tuple(range(first + i * gpus, first + (i + 1) * gpus)) for i in range(workers))


@contextlib.contextmanager
def main_unimported():
    """Within it, a process started by spawn or forkserver (and the fork server itself) does not import this process's
    `__main__`: posttrain's worker processes run posttrain's own code, so a script that starts a run from Python needs
    no `if __name__ == "__main__":` guard, and a script read from stdin (which a child cannot import) works too.
    multiprocessing reads the main module's `__spec__` and `__file__` as the child starts; both are hidden meanwhile."""
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__spec__", "__file__") if main is not None and k in main.__dict__}
    if main is not None:
        main.__dict__.pop("__file__", None)
        main.__dict__["__spec__"] = None
    try:
        yield
    finally:
        if main is not None:
            main.__dict__.pop("__spec__", None)
            main.__dict__.update(saved)
