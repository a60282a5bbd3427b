"""Direct Preference Optimization (DPO).

Papers: Rafailov et al. 2023 (arXiv:2305.18290), Eq. 7; DeepSeekMath (arXiv:2402.03300), Appendix A.1.4, Eq. 12 and
Table 10.

Objective: for pairs (q, o⁺, o⁻) of a preferred and a dispreferred response, with the log-ratios to the reference

    ℓ± = Σ_t [log πθ(o±_t | q, o±_<t) − log π_ref(o±_t | q, o±_<t)]       (`length_normalize: true`: (1/|o±|) Σ_t)

and the margin z = β(ℓ⁺ − ℓ⁻), minimise the mean over pairs of

    L = −(1 − ε) log σ(z) − ε log σ(−z)                                    (ε = `label_smoothing`, 0 is plain DPO).

Gradient coefficient (unified view): with w = (1 − ε) σ(−z) − ε σ(z) (= σ(β ℓ⁻ − β ℓ⁺) when ε = 0),

    GC on every token of o⁺ = +2βw,    GC on every token of o⁻ = −2βw,

one value per sequence. The engine sums GC · ∇log πθ over tokens (standard form) or averages it (Eq. 12 form) and
divides by the number of sequences; the 2 turns that into the mean over pairs (see `coefficient`).

Deviations from the paper:
    1. The default is the standard summed log-ratio of Rafailov et al.; DeepSeekMath's Eq. 12 divides each by |o±|
       (`length_normalize: true`).
    2. `label_smoothing` > 0 is conservative DPO (cDPO, Mitchell 2023): labels flipped with probability ε.
    3. Reference log-probs are computed once per pair by the engine and reused in every epoch.
    4. Pairs come from a file (`pairs_path`) or, as in the paper, are built by the engine from samples of the starting
       model judged by the rule reward (`samples_per_prompt`, `num_prompts`).
    5. GC keeps the factor β of the exact derivative, so the surrogate's gradient is exactly that of L.

Metrics (means over the pairs of a micro-batch):
    reward_margin: z = β(ℓ⁺ − ℓ⁻), the implicit reward of o⁺ minus that of o⁻.
    pair_accuracy: fraction of pairs with z > 0 (the policy already prefers o⁺ more than the reference does).
    chosen_logratio: ℓ⁺; rises as the policy moves probability onto preferred responses.
    rejected_logratio: ℓ⁻; falls as it moves probability off dispreferred ones.
    dpo_loss: L itself (the engine's `loss` is the surrogate, whose value means nothing here).
    objective: L as well, as every method logs it: the mean over pairs of L, the quantity minimised.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from posttrain.algorithms.base import Algorithm, register
from posttrain.core.batch import Batch
from posttrain.core.errors import ConfigError
from posttrain.core.frozen import Freezable


@dataclass
class PreferenceConfig(Freezable):
    """The keys of DPO's loss, which online DPO shares."""

    beta: float = 0.1
    """β: strength of the implicit KL constraint to the reference; larger keeps the policy closer (> 0)."""
    length_normalize: bool = False
    """Divide each sequence log-ratio by its length (DeepSeekMath Eq. 12) instead of summing (Rafailov et al.)."""
    label_smoothing: float = 0.0
    """ε of conservative DPO (cDPO): the probability that a pair's preference label is wrong, in [0, 0.5)."""

    def __post_init__(self):
        if self.beta <= 0:
            raise ConfigError(f"beta: must be > 0 (got {self.beta})")
        if not 0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"label_smoothing: must be in [0, 0.5) (got {self.label_smoothing})")


@dataclass
class DPOConfig(PreferenceConfig):
    pairs_path: str | None = None
    """JSONL/Parquet preference file with prompt/chosen/rejected; null: build pairs from the starting model's samples
    judged by the rule reward."""
    samples_per_prompt: int = 8
    """k: samples per prompt when building pairs from the starting model (at least 2)."""
    num_prompts: int = 512
    """Prompts sampled when building pairs from the starting model (at least 1)."""
    prompt_field: str = "prompt"
    """Field of `pairs_path` rows holding the prompt."""
    chosen_field: str = "chosen"
    """Field of `pairs_path` rows holding the preferred response."""
    rejected_field: str = "rejected"
    """Field of `pairs_path` rows holding the dispreferred response."""

    def __post_init__(self):
        super().__post_init__()
        if self.samples_per_prompt < 2:
            raise ConfigError(f"samples_per_prompt: building pairs needs at least 2 (got {self.samples_per_prompt})")
        if self.num_prompts < 1:
            raise ConfigError(f"num_prompts: must be ≥ 1 (got {self.num_prompts})")


@register("dpo")
class DPO(Algorithm):
    Config = DPOConfig
    source = "pairs"
    unit = 2  # rows [chosen_i, rejected_i] stay in one micro-batch

    @staticmethod
    def needs(cfg: DPOConfig) -> frozenset[str]:
        return frozenset({"ref_logp"})

    @staticmethod
    def aggregation(cfg: DPOConfig) -> tuple[str, float]:
        """(mode, norm) replacing `train.loss_agg`: a sum over tokens (standard form) or a mean (Eq. 12 form)."""
        return ("seq_mean_token_mean", 1.0) if cfg.length_normalize else ("seq_mean_token_sum_norm", 1.0)

    @staticmethod
    def pair_weight(batch: Batch) -> torch.Tensor | None:
        """Each pair's weight in the loss [B/2], or None: every pair weighs 1. Online DPO gives a tie (no preference)
        weight 0."""
        return None

    @classmethod
    def coefficient(cls, batch: Batch, logp: torch.Tensor, cfg: DPOConfig) -> tuple[torch.Tensor, dict]:
        B, R = logp.shape
        z, chosen, rejected = margin(batch, logp, cfg)  # [B/2] each
        eps = cfg.label_smoothing
        w = (1 - eps) * torch.sigmoid(-z) - eps * torch.sigmoid(z)  # [B/2] = −dL/dz
        weight = cls.pair_weight(batch)  # [B/2] or None
        if weight is not None:
            w = w * weight
        # dL/dℓ± = ∓βw, and L is averaged over pairs. The engine divides by the number of sequences, two per pair,
        # so each sequence's GC carries a factor 2: Σ_seq GC/(2·pairs) = Σ_pairs βw/pairs.
        sign = torch.tensor([1.0, -1.0], dtype=logp.dtype, device=logp.device)  # [2] + on o⁺, − on o⁻
        gc = (2 * cfg.beta * w[:, None] * sign).reshape(B, 1) * batch.mask  # [B, R]

        def mean(x):  # over the pairs in the loss (weight > 0): every pair, unless the method weighs them
            return x.mean() if weight is None else (x * (weight > 0)).sum() / (weight > 0).sum().clamp(min=1)

        metrics = {"reward_margin": mean(z), "pair_accuracy": mean((z > 0).to(logp.dtype)),
                   "chosen_logratio": mean(chosen), "rejected_logratio": mean(rejected),
                   "dpo_loss": mean(pair_loss(z, eps))}
        return gc, {k: v.detach() for k, v in metrics.items()}

    @classmethod
    def objective(cls, batch: Batch, logp: torch.Tensor, cfg: DPOConfig) -> torch.Tensor:
        """Each pair's L on the tokens of both its rows, spread so that DPO's aggregation (`aggregation`) gives the
        mean over pairs: L on every token under the mean over tokens, L/|o| under the sum (times the pair's weight
        where the method weighs pairs)."""
        z, _, _ = margin(batch, logp, cfg)  # [B/2]
        loss = pair_loss(z, cfg.label_smoothing)  # [B/2]
        weight = cls.pair_weight(batch)
        if weight is not None:
            loss = loss * weight
        per_row = loss.repeat_interleave(2)  # [B] L of the row's pair
        if not cfg.length_normalize:
            per_row = per_row / batch.mask.sum(-1)  # [B]
        return per_row[:, None] * batch.mask  # [B, R]


def margin(batch: Batch, logp: torch.Tensor, cfg: DPOConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(z, ℓ⁺, ℓ⁻), each [B/2]: the margin β(ℓ⁺ − ℓ⁻) and the log-ratios to the reference of the rows
    [chosen_0, rejected_0, chosen_1, …] of `logp` [B, R] (summed over tokens, or averaged: `length_normalize`)."""
    B, R = logp.shape
    assert B % 2 == 0, f"DPO expects rows [chosen, rejected] * pairs, got an odd B = {B}"
    assert batch.mask.shape == (B, R), f"DPO expects mask [B, R] = {(B, R)}, got {tuple(batch.mask.shape)}"
    assert batch.ref_logp is not None and batch.ref_logp.shape == (B, R), "DPO expects ref_logp [B, R]"
    length = batch.mask.sum(-1)  # [B]
    assert bool((length > 0).all()), "DPO expects every response to have at least one token (EOS)"
    logratio = ((logp - batch.ref_logp) * batch.mask).sum(-1)  # [B]
    if cfg.length_normalize:
        logratio = logratio / length  # [B]
    chosen, rejected = logratio.view(B // 2, 2).unbind(-1)  # [B/2], [B/2]
    return cfg.beta * (chosen - rejected), chosen, rejected  # [B/2] each


def pair_loss(z: torch.Tensor, eps: float) -> torch.Tensor:
    """L = −(1 − ε) log σ(z) − ε log σ(−z) of each pair; [B/2] -> [B/2]."""
    return -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
