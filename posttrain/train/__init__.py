"""The training loop: the engine (one step of any method), and the run around it (tracking, evaluation, checkpoints).

`run` trains from a validated config; `Engine` is one step, for tests and tools that drive it directly.
"""

from posttrain.train.engine import Engine
from posttrain.train.loop import run

__all__ = ["Engine", "run"]
