"""Methods as gradient-coefficient plugins, and their registry.

In the unified view of DeepSeekMath (arXiv:2402.03300, §5.2.1) every method's gradient is

    E_{(q,o)~D} [ (1/|o|) Σ_t GC(q, o, t) ∇θ log πθ(o_t | q, o_<t) ].

A plugin supplies what differs: its data source, what the engine must compute for it (rewards, old or reference
log-probs), per-batch preparation (advantages, filters) and the per-token coefficient GC. The engine turns any GC into
the surrogate loss −aggregate(stopgrad(GC) · log πθ), and logs beside it the method's own `objective`; it never asks
which method it runs. Helpers that several methods share live in `common.py`.
"""

import importlib
import pkgutil

from posttrain.algorithms.base import REGISTRY, Algorithm, get, plugin_of, register

__all__ = ["REGISTRY", "Algorithm", "get", "plugin_of", "register"]

# Every module of this folder but the shared ones is a method that registers itself on import: a new method is one
# new file here (or anywhere, named as algorithm.name=path/to/file.py:Class). Listings follow the paper's Table 10
# (online DPO beside DPO, in the cell the table leaves empty), then GRPO's family in the order of publication (GRPO+PS,
# from GRPO's own paper, first), then on-policy distillation; any other module after them, by name.
LISTING = ("sft", "rft", "online_rft", "dpo", "online_dpo", "ppo", "grpo", "grpo_ps", "rloo", "reinforce_pp", "cispo",
           "gspo", "sapo", "distill")
_SHARED = ("base", "common")
_methods = [m.name for m in pkgutil.iter_modules(__path__) if m.name not in _SHARED and not m.name.startswith("_")]
for _module in sorted(_methods, key=lambda n: (LISTING.index(n) if n in LISTING else len(LISTING), n)):
    importlib.import_module(f"posttrain.algorithms.{_module}")
