"""The training loop: building a run's parts, the engine that steps them, and the run around it (tracking,
evaluation, checkpoints).

`run` trains from a validated config; `build` makes a run's `Engine`, for tests and tools that drive steps directly.
"""

from posttrain.train.build import build
from posttrain.train.engine import Engine
from posttrain.train.loop import run

__all__ = ["Engine", "build", "run"]
