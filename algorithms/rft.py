"""Rejection sampling fine-tuning (RFT).

Paper: DeepSeekMath (arXiv:2402.03300), Appendix A.1.2; Yuan et al. 2023 (arXiv:2308.01825).

Objective: sample k outputs per question from the SFT model once, keep the correct ones, and maximise their
log-likelihood,

    J_RFT(θ) = E_{q~P_sft, o~π_sft(O|q)} [ (1/|o|) Σ_t I(o) log πθ(o_t | q, o_<t) ].

Gradient coefficient (unified view, Table 10): GC(q, o, t) = I(o), 1 if the rule reward says o is correct, else 0.

Deviations from the paper:
    1. The incorrect samples are dropped when the data set is built (`samples_once` source) instead of being carried
       with I(o) = 0: the gradient direction is the same and no compute goes to sequences that contribute nothing.
       The batch mean is therefore over kept samples, a constant rescaling of the paper's expectation.
    2. Correct means the accuracy rule (`rewards/accuracy.py`) on the final answer; samples are generated once per
       run at `rollout.temperature` and cached, keyed by the starting model and the sampling settings.

Metrics:
    rft_samples: samples drawn from the starting model (k × prompts).
    rft_kept: of those, the correct ones RFT trains on.
    rft_prompts_with_correct: prompts with at least one correct sample.
    objective: −J_RFT, the negative log-likelihood of the kept samples under `train.loss_agg`.
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
class RFTConfig(Freezable):
    samples_per_prompt: int = 8
    """k: samples of the starting model per prompt."""
    num_prompts: int = 512
    """Training prompts sampled (once, at the start) to build the filtered set."""

    def __post_init__(self):
        for key in ("samples_per_prompt", "num_prompts"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key}: must be ≥ 1 (got {getattr(self, key)})")


@register("rft")
class RFT(Algorithm):
    Config = RFTConfig
    source = "samples_once"  # the source keeps only correct samples and marks them with reward 1

    @staticmethod
    def coefficient(batch: Batch, logp: torch.Tensor, cfg: RFTConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return indicator_coefficient(batch, logp, 1.0), {}

    @staticmethod
    def objective(batch: Batch, logp: torch.Tensor, cfg: RFTConfig) -> torch.Tensor:
        """−I(o)·log πθ per token: the negative log-likelihood of the kept samples (GC does not depend on θ)."""
        return -RFT.coefficient(batch, logp, cfg)[0] * logp  # [B, R]
