"""The training loop: building a run's parts, the engine that steps them, and the run around it (tracking,
evaluation, checkpoints).

`run` trains from a validated config, a `Training` stepped to its end (what `posttrain.Run`, docs/python.md, steps);
`build` makes a run's `Engine`, for tests and tools that drive steps directly.
"""

from posttrain.train.build import build
from posttrain.train.engine import Engine
from posttrain.train.loop import Training, run

__all__ = ["Engine", "Training", "build", "run"]
