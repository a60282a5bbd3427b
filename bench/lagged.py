"""`posttrain` with the colocated hf engine sampling each training batch from weights k updates old: staleness
without rollout workers, to tell what staleness costs from what the workers' machinery might.

    python bench/lagged.py 1 run recipe=grpo_math seed=0 rollout.tis_cap=2

The first argument is k; the rest is a `posttrain` command line. Before each update the engine keeps a copy of the
weights (the version the update starts from); a training batch is then sampled from the oldest of the last k copies,
so the batch the update to version j trains on was sampled by version j − 1 − k, as under
`rollout.placement=separate rollout.max_staleness=k` (bench/async.py's "lagged k=1" configuration). The sampler's
log-probs are the old weights', so `rollout.tis_cap` corrects as it does for the workers' samples (give it: the
colocated placement leaves it off). Greedy calls (the held-out evaluation) sample from the current weights.
"""

from __future__ import annotations

import collections
import copy
import sys

from posttrain.apps.cli import main
from posttrain.rollout.hf import HFEngine


def lag(k: int) -> None:
    """Patches HFEngine so that its non-greedy calls sample from the weights k updates back."""
    release, generate = HFEngine.release, HFEngine.generate

    def keeping_release(self) -> None:  # the engine's call just before each update
        if not hasattr(self, "lagged"):
            self.lagged = collections.deque(maxlen=k)
        self.lagged.append(copy.deepcopy(self.model.state_dict()))
        release(self)

    def lagged_generate(self, prompts, n, **sampling):
        old = getattr(self, "lagged", None)
        if sampling.get("greedy") or not old:  # evaluation, or before the first update: the current weights
            return generate(self, prompts, n, **sampling)
        current = copy.deepcopy(self.model.state_dict())
        self.model.load_state_dict(old[0])
        try:
            return generate(self, prompts, n, **sampling)
        finally:
            self.model.load_state_dict(current)

    HFEngine.release, HFEngine.generate = keeping_release, lagged_generate


if __name__ == "__main__":  # the reward pool's spawned processes import this file too, and must not run it
    lag(int(sys.argv[1]))
    sys.exit(main(sys.argv[2:]))
