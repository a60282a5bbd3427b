"""Online rejection sampling fine-tuning (Online RFT).

Paper: DeepSeekMath (arXiv:2402.03300), Appendix A.1.3 and §5.2.1.

Objective: as RFT, but the outputs are sampled from the current policy at every step,

    J_OnRFT(θ) = E_{q~P_sft, o~πθ(O|q)} [ (1/|o|) Σ_t I(o) log πθ(o_t | q, o_<t) ].

Gradient coefficient (unified view, Table 10): GC(q, o, t) = I(o), with o from the live policy. Incorrect samples
stay in the batch with GC = 0, so the batch mean is the paper's expectation over all samples.

Deviations from the paper:
    1. "Correct" is `reward ≥ threshold`; with the default rewards ({accuracy: 1.0}) that is the accuracy rule.
    2. The gradient is taken at the sampling temperature (log-probs are scored at `rollout.temperature`), as for GRPO.

Metrics:
    correct_frac: fraction of the step's samples with I(o) = 1 (the others do not move the policy).
    objective: −J_OnRFT, the negative log-likelihood of the correct samples, −I(o)·log πθ per token under
        `train.loss_agg` (incorrect samples count in the denominators with 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.algorithms.base import Algorithm, register
from posttrain.algorithms.common import indicator_coefficient
from posttrain.core.batch import Batch
from posttrain.core.errors import ConfigError
from posttrain.core.frozen import Freezable


@dataclass
class OnlineRFTConfig(Freezable):
    samples_per_prompt: int = 4
    """Samples of the current policy per prompt, each step."""
    threshold: float = 1.0
    """A sample counts as correct when its reward is at least this."""

    def __post_init__(self):
        if self.samples_per_prompt < 1:
            raise ConfigError(f"samples_per_prompt: must be ≥ 1 (got {self.samples_per_prompt})")


@register("online_rft")
class OnlineRFT(Algorithm):
    Config = OnlineRFTConfig
    source = "online"
    reward_threshold = "threshold"

    @staticmethod
    def needs(cfg: OnlineRFTConfig) -> frozenset[str]:
        return frozenset({"reward"})

    @staticmethod
    def samples_per_prompt(cfg: OnlineRFTConfig) -> int:
        return cfg.samples_per_prompt

    @staticmethod
    def coefficient(batch: Batch, logp: torch.Tensor, cfg: OnlineRFTConfig) -> tuple[torch.Tensor, dict]:
        gc = indicator_coefficient(batch, logp, cfg.threshold)  # [B, R]
        return gc, {"correct_frac": gc[:, 0].mean()}

    @staticmethod
    def objective(batch: Batch, logp: torch.Tensor, cfg: OnlineRFTConfig) -> torch.Tensor:
        """−I(o)·log πθ per token: the negative log-likelihood of the correct samples (GC does not depend on θ)."""
        return -OnlineRFT.coefficient(batch, logp, cfg)[0] * logp  # [B, R]
