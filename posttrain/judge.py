"""The judge: the one place that turns (rows, completions) into rewards and verdicts.

Training (the online source), the sample-once sources (RFT keeps correct samples, DPO pairs a correct with an
incorrect one) and held-out evaluation all ask it, so "reward" and "correct" mean the same everywhere:

- `score` is what the policy is trained on: the weighted rule rewards of `rewards`, plus a reward model's score
  times `reward_model.weight` when one is configured;
- `correct` is the task's verdict: the accuracy rule on the row's reference answer. Evaluation reports it, and RFT
  and DPO filter on it, whatever rewards the run trains with;
- `score_steps` is the reward of each step, for the methods that train on step rewards (`rewards.process`: the
  embedded task's rule, `posttrain.rewards.steps`, or a process reward model, `posttrain.rewards.process_model`).

Reward functions see the completion, the reference answer and the prompt text of each sample. Each call runs in a
worker process, one completion at a time, within `rewards.timeout_s` (`posttrain.rewards.base`): a reward that
raises, hangs or gives nan costs that sample's score (0), and the step's metrics count it.

Several objectives (`rewards.normalize`, after GDPO: Liu et al. 2026, "Group reward-Decoupled Normalization Policy
Optimization for Multi-reward RL Optimization", arXiv:2601.05242). In a plain weighted sum Σ_k w_k r_k the objective
with the larger scale or spread sets the group-relative advantage whatever its weight. With `group`, each objective k
(each rule, custom function and the reward model) is first z-scored over the samples of its prompt,
z_k = (r_k − mean_g r_k) / (std_g r_k + 1e-4) (unbiased std), and the total is Σ_k w_k z_k, so the weights mean what
they say and an objective constant within a group adds 0; `batch` z-scores over the whole batch (methods without
groups). Deviation: GDPO then whitens the sum over the batch; here the sum is the reward, and the method's advantage
takes it from there (GRPO's z-scores it again within the group).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from numbers import Real

import torch

from posttrain import rewards
from posttrain.algorithms.common import group_stats
from posttrain.core.errors import ConfigError, UserError
from posttrain.data import prompt_texts
from posttrain.rewards import custom
from posttrain.rewards.accuracy import final_answers, verdicts
from posttrain.rewards.steps import step_scores
from posttrain.schema import DataConfig, RewardsConfig, RunConfig, weights_dtype

NORM_EPS = 1e-4  # rewards.normalize: z = (r − mean) / (std + eps), GDPO's value


def normalized(parts: dict[str, torch.Tensor], weights: dict[str, float], group: torch.Tensor) -> torch.Tensor:
    """Σ_k w_k (r_k − mean_g r_k) / (std_g r_k + NORM_EPS): each objective's [B] scores z-scored within the samples of
    each group (unbiased std; groups of any size and order), then weighted; [B] group ids -> [B]."""
    total = torch.zeros(group.shape, dtype=torch.float64)  # [B]
    for name, r in parts.items():
        mean, std = group_stats(r, group)  # [B], [B]
        total += weights[name] * (r - mean) / (std + NORM_EPS)
    return total


class Judge:
    """Rewards and verdicts for completions, one row per completion.

    Args:
        data: the field mapping (`answer_field`, `prompt_field`), how answers are checked (`answer_format`) and the
            prompt template.
        rules: the `rewards` group: rule rewards and custom functions with their weights, the bound on a call, and
            whether each objective is z-scored before the weighted sum (`normalize`).
        reward_model: a callable (prompts, completions) -> scores, or None.
        reward_model_weight: its weight in the total.
        tokenizer: the policy's; with a chat template, rewards see the prompt as the template rendered it.
        process_model: a callable (prompts, completions) -> [(char_end, score)] per step, for rewards.process=model.
        functions: Python reward functions given from Python (posttrain.Run's `rewards`), by name -> (function,
            weight): each called in this process on a whole batch as TRL calls its reward functions,
            `function(completions, prompts=..., **row_fields)`, a list per keyword, one float or None per completion
            back (`call_function`).
    """

    def __init__(self, data: DataConfig, rules: RewardsConfig, reward_model=None,
                 reward_model_weight: float = 1.0, tokenizer=None, process_model=None,
                 functions: dict[str, tuple[Callable, float]] | None = None):
        self.data, self.reward_model, self.reward_model_weight = data, reward_model, reward_model_weight
        self.tokenizer, self.process, self.process_model = tokenizer, rules.process, process_model
        self.rules = rewards.combine(rules, answer_format=data.answer_format)
        self.normalize = rules.normalize
        self.weights = {**rules.weights, **{custom.load(entry).label: w for entry, w in rules.custom.items()},
                        "model": reward_model_weight}  # objective -> weight, by its name in `parts`
        self.functions = dict(functions or {})
        for name, (_, weight) in self.functions.items():
            if name in self.weights:
                raise ConfigError(f"rewards: a Python reward function is named {name!r}, as a reward of the config "
                                  "is; give it another name")
            self.weights[name] = weight

    def answers(self, rows: list[dict]) -> list[str]:
        return [str(r[self.data.answer_field]) for r in rows]

    def score(self, rows: list[dict], completions: list[str],
              group: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """([B] total reward, stats) for completions of `rows`, `group` their [B] group ids (the samples of one
        prompt; None: one group). The total is Σ_k w_k r_k, or with rewards.normalize each objective z-scored first
        (module docstring). The stats hold "reward" (the mean of the raw Σ_k w_k r_k, normalising or not),
        "reward/<name>" (the mean of each part, a missing score as 0) and four counts of missing scores, each scored 0:
        "reward/verify_errors" (a reward could not score: the accuracy rule's math check raised), "reward/errors" (a
        call raised), "reward/timeouts" (a call outlasted rewards.timeout_s) and "reward/nonfinite" (a call gave nan
        or inf). With `group`, "reward/<name>/std" is the mean over samples of that part's std within their group:
        how much it tells a group's samples apart (0: it teaches nothing). When normalising, "reward/normalized" is
        the mean of the total returned."""
        prompts = prompt_texts(rows, self.data, self.tokenizer)
        total, parts, counts = self.rules(completions, self.answers(rows), prompts)
        for name, (function, weight) in self.functions.items():
            raw = call_function(name, function, completions, prompts, rows)
            counts["verify_errors"] += sum(s is None for s in raw)
            counts["nonfinite"] += sum(s is not None and not math.isfinite(s) for s in raw)
            parts[name] = [s if s is not None and math.isfinite(s) else None for s in raw]
            total = [t + weight * (s or 0.0) for t, s in zip(total, parts[name])]
        parts = {name: [s or 0.0 for s in scores] for name, scores in parts.items()}
        if self.reward_model is not None:
            parts["model"] = self.reward_model(prompts, completions)
            total = [t + self.reward_model_weight * m for t, m in zip(total, parts["model"])]
        stats = {"reward": sum(total) / len(total), **{f"reward/{k}": sum(v) / len(v) for k, v in parts.items()},
                 **{f"reward/{k}": float(n) for k, n in counts.items()}}
        reward = torch.tensor(total)  # [B]
        if group is None and self.normalize == "none":
            return reward, stats
        if group is not None and group.shape != reward.shape:
            raise ValueError(f"score: {tuple(group.shape)} group ids for {len(total)} completions")
        raw = {name: torch.tensor(scores, dtype=torch.float64) for name, scores in parts.items()}  # name -> [B]
        if group is not None:
            stats.update({f"reward/{k}/std": float(group_stats(r, group)[1].mean()) for k, r in raw.items()})
        if self.normalize != "none":
            one = torch.zeros(reward.shape, dtype=torch.long)  # [B] the whole batch as one group
            by = group if self.normalize == "group" and group is not None else one
            reward = normalized(raw, self.weights, by).to(reward.dtype)
            stats["reward/normalized"] = float(reward.mean())
        return reward, stats

    def score_steps(self, rows: list[dict], completions: list[str]) -> list[list[tuple[int, float]]]:
        """(char_end, reward) for each step of each completion of `rows`, steps in order; char_end is the offset in
        the completion just past the step. By `rewards.process`: `steps` checks each line of the embedded task by rule
        (from the row's question), `model` asks the process reward model (prompt text + completion)."""
        if self.process == "steps":
            return [step_scores(str(r[self.data.prompt_field]), c) for r, c in zip(rows, completions, strict=True)]
        if self.process == "model" and self.process_model is not None:
            return self.process_model(prompt_texts(rows, self.data, self.tokenizer), completions)
        raise ValueError(f"score_steps: no process reward (rewards.process={self.process}, model loaded: "
                         f"{self.process_model is not None})")

    def correct(self, rows: list[dict], completions: list[str]) -> list[bool]:
        """The accuracy rule's verdict for each completion of `rows` (a failed check is not correct)."""
        return [v is True for v in verdicts(completions, self.answers(rows), self.data.answer_format)]

    def final_answers(self, completions: list[str]) -> list[str | None]:
        """The final answer the accuracy rule reads from each completion, as a string equal for equal answers, or
        None: what maj@k votes on."""
        return final_answers(completions, self.data.answer_format)


def call_function(name: str, function: Callable, completions: list[str], prompts: list[str],
                  rows: list[dict]) -> list[float | None]:
    """A Python reward function's scores for `completions`, called as TRL calls one: the completions, then keywords
    `prompts` (the prompt texts, as rendered) and each field of the rows, a list each (GSM8K's `question` and
    `answer`, say), so that `def reward(completions, answer, **kwargs)` reads the reference. One number or None (could
    not score: 0, counted in reward/verify_errors; nan or inf count 0 in reward/nonfinite) per completion; anything
    else is a one-line error naming it. What
    the function raises reaches the caller as raised: it is the caller's own code, in the caller's process."""
    fields = {k: [row.get(k) for row in rows] for k in dict.fromkeys(k for row in rows for k in row)}
    fields.pop("completions", None)
    scores = function(list(completions), **{**fields, "prompts": list(prompts)})
    try:
        scores = list(scores)
    except TypeError:
        raise UserError(f"rewards: the function {name!r} returned {type(scores).__name__}, not a list of scores") \
            from None
    if len(scores) != len(completions):
        raise UserError(f"rewards: the function {name!r} returned {len(scores)} scores for {len(completions)} "
                        "completions")
    for s in scores:
        if s is not None and (isinstance(s, bool) or not isinstance(s, Real)):
            raise UserError(f"rewards: the function {name!r} returned {s!r} among its scores; give a number or None")
    return [None if s is None else float(s) for s in scores]


def build(cfg: RunConfig, device, *, with_reward_model: bool, place=None, tokenizer=None,
          with_process_model: bool = False, precision: str = "fp32", functions: dict | None = None) -> Judge:
    """The run's judge; the reward model (`reward_model.path`) is loaded only when the method trains on rewards, the
    process reward model (`reward_model.process_path`, with rewards.process=model) only when it trains on step
    rewards, each placed by `place` (the backend's, which shards it where weights are sharded) when given, in the
    dtype of models only scored under `precision` (the one that runs)."""
    model = process_model = None
    dtype = weights_dtype(precision, trained=False)
    if with_reward_model and cfg.reward_model.path:
        from posttrain.rewards.model import RewardModel

        model = RewardModel(cfg.reward_model.path, device, dtype=dtype, place=place)
    if with_process_model and cfg.rewards.process == "model":
        from posttrain.rewards.process_model import ProcessRewardModel

        process_model = ProcessRewardModel(cfg.reward_model.process_path, device, dtype=dtype, place=place)
    return Judge(cfg.data, cfg.rewards, model, cfg.reward_model.weight, tokenizer, process_model, functions)
