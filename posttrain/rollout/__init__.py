"""Rollout engines: sample n completions per prompt into a `Batch`, take new policy weights, free memory meanwhile.

Every caller that samples (the online source, the sample-once sources of RFT and DPO, held-out evaluation) goes
through this interface, so a faster engine serves them all. An engine gets token ids and returns token ids and masks;
it knows nothing of tokenisation, configs or the training loop. `rollout.engine` picks one by name from `ENGINES`.

The batch it returns holds the token ids exactly as sampled (never re-tokenised): prompts left-padded to P, responses
right-padded to R, a response mask that ends at the first stop token, `group` (which prompt a sample answers) and
`truncated` (no stop token within the budget).
"""

from posttrain.rollout.base import ENGINES, RolloutEngine, Setup, get, register

__all__ = ["ENGINES", "RolloutEngine", "Setup", "get", "register"]

from posttrain.rollout import hf, vllm  # noqa: E402,F401  (the built-in engines register themselves)
