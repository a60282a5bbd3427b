"""posttrain: post-training methods as gradient-coefficient plugins over one shared engine.

The DeepSeekMath paper (arXiv:2402.03300, §5.2.1) writes the gradient of SFT, RFT, DPO, PPO and GRPO in one form,
E[(1/|o|) Σ_t GC(q, o, t) ∇θ log πθ(o_t | q, o_<t)]; methods differ in data source, reward and GC only.
"""

import os as _os

__version__ = "0.1.0"
__all__ = ["Run", "UserError", "run"]

_LAZY = {"Run": "posttrain.apps.api", "run": "posttrain.apps.api", "UserError": "posttrain.core.errors"}


def __getattr__(name: str):
    """`posttrain.Run`, `posttrain.run` (docs/python.md) and `posttrain.UserError`, imported on first use: `import
    posttrain` stays cheap, and the command line (which imports this package first) does not pay for torch before it
    needs it."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'posttrain' has no attribute {name!r}")

# A checkout keeps algorithms/, rewards/, environments/ and recipes/ beside posttrain/; an install maps them inside it
# as posttrain.algorithms, posttrain.rewards, posttrain.environments and posttrain.recipes (pyproject.toml). When
# posttrain is imported from a checkout (`python -m posttrain` or `torchrun -m posttrain` in the repository root,
# where the source tree shadows an install), the checkout's root joins this package's search path, so those imports
# find the folders beside it.
_here = _os.path.dirname(_os.path.abspath(__file__))
_root = _os.path.dirname(_here)
if not _os.path.isdir(_os.path.join(_here, "algorithms")) and _os.path.isfile(
        _os.path.join(_root, "algorithms", "__init__.py")):
    __path__.append(_root)
