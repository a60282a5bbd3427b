"""Supervised fine-tuning (SFT).

Paper: DeepSeekMath (arXiv:2402.03300), Appendix A.1.1.

Objective: maximise the log-likelihood of reference responses o for questions q from an offline data set,

    J_SFT(θ) = E_{(q,o)~P_sft} [ (1/|o|) Σ_t log πθ(o_t | q, o_<t) ].

Gradient coefficient (unified view, Table 10): GC(q, o, t) = 1 on every response token.

Deviations from the paper:
    1. The aggregation over tokens is the engine's `train.loss_agg`; the paper's 1/|o| is `seq_mean_token_mean`
       (the default). `token_mean` weights every token equally, as most SFT trainers do.
    2. The EOS token closing each response is trained too, so the model learns to stop.

Metrics:
    objective: −J_SFT, the negative log-likelihood −log πθ per token under the chosen aggregation. As GC = 1, the
        engine's `loss` has the same value.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.algorithms.base import Algorithm, register
from posttrain.core.batch import Batch
from posttrain.core.frozen import Freezable


@dataclass
class SFTConfig(Freezable):
    """SFT has no hyperparameters of its own: learning rate and batch sizes live in `train`."""


@register("sft")
class SFT(Algorithm):
    Config = SFTConfig
    source = "offline"

    @staticmethod
    def coefficient(batch: Batch, logp: torch.Tensor, cfg: SFTConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return torch.ones_like(logp), {}  # [B, R]

    @staticmethod
    def objective(batch: Batch, logp: torch.Tensor, cfg: SFTConfig) -> torch.Tensor:
        return -logp  # [B, R] the negative log-likelihood
