"""Methods as gradient-coefficient plugins, and their registry.

In the unified view of DeepSeekMath (arXiv:2402.03300, §5.2.1) every method's gradient is

    E_{(q,o)~D} [ (1/|o|) Σ_t GC(q, o, t) ∇θ log πθ(o_t | q, o_<t) ].

A plugin supplies what differs: its data source, what the engine must compute for it (rewards, old or reference
log-probs), per-batch preparation (advantages, filters) and the per-token coefficient GC. The engine turns any GC into
the surrogate loss −aggregate(stopgrad(GC) · log πθ), and logs beside it the method's own `objective`; it never asks
which method it runs. Helpers that several methods share live in `common.py`.
"""

import importlib

from posttrain.algorithms.base import REGISTRY, Algorithm, get, plugin_of, register

__all__ = ["REGISTRY", "Algorithm", "get", "plugin_of", "register"]

# The built-in methods register themselves on import, in the order of the paper's Table 10 (the order listings use),
# then GRPO's family in the order of publication (GRPO+PS, from GRPO's own paper, first).
for _module in ("sft", "rft", "online_rft", "dpo", "ppo", "grpo", "grpo_ps", "rloo", "reinforce_pp", "gspo"):
    importlib.import_module(f"posttrain.algorithms.{_module}")
