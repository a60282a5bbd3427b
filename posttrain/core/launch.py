"""What a launcher (torchrun, accelerate launch) tells each training process it starts, through the environment.

A process that a training process starts for a part of its own (a rollout worker, the embedded model's warm-up)
inherits those variables, and would take itself for one more training process: `forget_launcher` removes them.
"""

from __future__ import annotations

import os

LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
                "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED")


def launched() -> bool:
    """True in a process a launcher started as one of several training processes."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1) > 1


def forget_launcher() -> None:
    """Removes the launcher's variables from this process's environment (and so from its children's)."""
    for key in LAUNCHER_ENV:
        os.environ.pop(key, None)
