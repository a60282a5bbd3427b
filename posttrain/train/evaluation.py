"""Held-out evaluation: greedy answers to test problems from the rollout engine, judged correct or not; and with
`eval.k`, pass@k and maj@k from sampled answers. `posttrain run` evaluates with it, and `posttrain eval` alone."""

from __future__ import annotations

import math
from collections import Counter

import torch

from posttrain.data import completion_texts, prompt_ids
from posttrain.schema import DataConfig, EvalConfig


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from n ≥ k samples of which c are correct (Chen et al. 2021,
    arXiv:2107.03374): 1 − C(n − c, k) / C(n, k), as a product that never forms the binomials."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def majority(answers: list[str | None]) -> str | None:
    """The most frequent answer (the earliest of those tied), ignoring completions without one; None if none has."""
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return None
    top = max(votes.values())
    return next(a for a in answers if a is not None and votes[a] == top)


def majority_right(finals: list[str | None], right: list[bool], K: int) -> float:
    """maj@K from n samples: the share of the ⌊n/K⌋ disjoint runs of K samples (in order) whose vote is right; a
    vote is right when the first sample that gave the voted answer is."""
    runs = [range(s, s + K) for s in range(0, len(finals) - K + 1, K)]
    wins = 0
    for run in runs:
        voted = majority([finals[i] for i in run])
        wins += voted is not None and right[next(i for i in run if finals[i] == voted)]
    return wins / len(runs)


def _sample(rollout, episodes, rows: list[dict], prompts: list[list[int]], n: int, **settings):
    """`n` completions of each prompt, or with `episodes` `n` episodes in the environment."""
    if episodes is None:
        return rollout.generate(prompts, n, **settings)
    return episodes.generate(rows, prompts, n, **settings)[0]


@torch.no_grad()
def evaluate(rollout, judge, tokenizer, rows: list[dict], data_cfg: DataConfig, *, max_new_tokens: int,
             batch_size: int, backend=None, k: int = 0, n: int | None = None, temperature: float = 1.0,
             top_p: float = 1.0, records: bool = False, progress=None, episodes=None) -> dict:
    """Greedy accuracy on `rows` (sharded across processes when `backend` runs several), and with `k` > 0 pass@k and
    maj@k from `n` (default k) samples per problem at `temperature` and `top_p`.

    pass@k is the unbiased estimate from the n samples; maj@k votes over the final answers of the first k (a problem
    counts as solved when the most frequent answer is right). The same samples also give the curve over K = 1, 2, 4,
    … ≤ n (DeepSeekMath's Figure 7): pass@K, the unbiased estimate, and maj@K, the mean over the ⌊n/K⌋ disjoint runs
    of K samples of whether their vote is right (every sample counts once, so the estimate is steadier than one
    vote of the first K).

    Args:
        episodes: with `env.name`, the Episodes (posttrain.sources.episodes) that answer each problem turn by turn in
            the environment, on `rollout`; the completion judged is the whole episode's text.
        records: also return one record per problem of this process ("records").
        progress: called with the number of problems done so far, after each batch.

    Returns:
        {"accuracy", "num_problems", "mean_response_tokens", "examples": first three (prompt, completion, answer)},
        with k: "pass@k", "maj@k" (k written out), "k", "n" and "curve": {"K": [...], "pass": [...], "maj": [...]}.
    """
    rank, world = (backend.rank, backend.world_size) if backend else (0, 1)
    n = (n or k) if k else 0
    shard = rows[rank::world]
    # Sharded weights: every process makes as many calls as the largest shard needs, an empty one on a dummy row.
    calls = -(-len(rows[::world]) // batch_size) if rollout.collective else -(-len(shard) // batch_size)
    sums = torch.zeros(5, dtype=torch.float64)  # greedy correct, greedy tokens, problems, pass@k, maj@k
    Ks = [2**i for i in range(n.bit_length())] if n else []  # 1, 2, 4, … ≤ n
    curve = torch.zeros(2, len(Ks), dtype=torch.float64)  # Σ pass@K, Σ maj@K over problems
    examples, out = [], []
    for start in range(0, calls * batch_size, batch_size):
        chunk = shard[start : start + batch_size]
        prompts = prompt_ids(tokenizer, chunk or rows[:1], data_cfg)
        batch = _sample(rollout, episodes, chunk or rows[:1], prompts, 1, max_new_tokens=max_new_tokens, greedy=True)
        sampled = _sample(rollout, episodes, chunk or rows[:1], prompts, n, max_new_tokens=max_new_tokens,
                          temperature=temperature, top_p=top_p) if n else None
        if not chunk:
            continue
        texts = completion_texts(tokenizer, batch)
        verdicts = judge.correct(chunk, texts)
        sums[:3] += torch.tensor([sum(verdicts), float(batch.mask.sum()), len(chunk)], dtype=torch.float64)
        examples += [{"question": str(r[data_cfg.prompt_field]), "completion": t, "answer": a}
                     for r, t, a in zip(chunk, texts, judge.answers(chunk))][: 3 - len(examples)]
        if n:
            samples = completion_texts(tokenizer, sampled)  # rows i·n … i·n + n − 1 answer problem i
        for i, row in enumerate(chunk):
            record = {"question": str(row[data_cfg.prompt_field]), "answer": judge.answers([row])[0],
                      "greedy": {"completion": texts[i], "correct": verdicts[i]}}
            if n:
                mine = samples[i * n : (i + 1) * n]
                right = judge.correct([row] * n, mine)
                finals = judge.final_answers(mine[:k])
                voted = majority(finals)  # right when the samples that gave it are (the first one is judged)
                voted_right = voted is not None and right[finals.index(voted)]
                sums[3:] += torch.tensor([pass_at_k(n, sum(right), k), float(voted_right)], dtype=torch.float64)
                every = judge.final_answers(mine)
                curve += torch.tensor([[pass_at_k(n, sum(right), K) for K in Ks],
                                       [majority_right(every, right, K) for K in Ks]], dtype=torch.float64)
                record.update(samples=[{"completion": t, "correct": c} for t, c in zip(mine, right)],
                              correct_samples=sum(right), majority_answer=voted, majority_correct=voted_right)
            if records:
                out.append(record)
        if progress is not None:
            progress(min(start + batch_size, len(shard)))
    if backend is not None and world > 1:
        sums = backend.reduce(sums.float().to(backend.device), "sum").cpu().double()
        curve = backend.reduce(curve.float().to(backend.device), "sum").cpu().double()
    correct, tokens, total, passed, voted = sums.tolist()
    result = {"accuracy": correct / max(total, 1), "num_problems": int(total),
              "mean_response_tokens": tokens / max(total, 1), "examples": examples}
    if n:
        result.update({f"pass@{k}": passed / max(total, 1), f"maj@{k}": voted / max(total, 1), "k": k, "n": n})
        per = (curve / max(total, 1)).tolist()
        result["curve"] = {"K": Ks, "pass": per[0], "maj": per[1]}
    if records:
        result["records"] = out
    return result


class Schedule:
    """When a run evaluates: before training, every `eval.every` steps and at the last step, or after the loop."""

    def __init__(self, cfg: EvalConfig, steps: int):
        self.on, self.every, self.steps = cfg.num_problems > 0, cfg.every, steps

    def in_loop(self, step: int) -> bool:
        return self.on and bool(self.every) and (step % self.every == 0 or step == self.steps)

    @property
    def after_loop(self) -> bool:
        return self.on and not self.every


class EarlyStop:
    """Early stopping with rollback (`eval.stop_on`, `patience`, `min_delta`), judged at each evaluation of the loop.

    - ``accuracy``: the held-out accuracy. An evaluation is worse when it falls below the best so far by more than
      `min_delta` of the best (relative: 0.05 is 5%); `patience` worse ones in a row stop the run, and its final model
      is the best evaluation's.
    - ``kl``: the mean of the steps' training KL to the reference since the previous evaluation. KL grows as the
      policy learns, so the lowest is no model to keep: an evaluation counts when its KL grew by more than `min_delta`
      over the previous evaluation's; `patience` growths in a row stop the run, and its final model is that of the
      last evaluation before the growth began. The seed's rule, "stop when validation KL grows 5% over 3 evaluations",
      is stop_on=kl with the defaults. We take the training KL, measured on the step's own samples, rather than a KL
      on held-out prompts, which would cost a reference forward on the evaluation's samples; it is the quantity the
      KL penalty acts on. An evaluation after steps that logged no KL (a β stage of 0) is not judged.

    The evaluation the run would roll back to is the "best"; the loop keeps its checkpoint.
    """

    def __init__(self, cfg: EvalConfig):
        self.metric, self.patience, self.delta = cfg.stop_on, cfg.patience, cfg.min_delta
        self.best, self.best_step, self.worse, self.kls, self.previous = None, None, 0, [], None
        self.best_evaluation: dict | None = None  # the best evaluation's report, the run's eval_after on rollback
        self.checkpoint: str | None = None  # the name of the best evaluation's checkpoint, which the loop keeps

    def state_dict(self) -> dict:
        """What a resumed run needs back, with the best evaluation's checkpoint."""
        return {"best": self.best, "best_step": self.best_step, "worse": self.worse, "kls": self.kls,
                "previous": self.previous, "best_evaluation": self.best_evaluation, "checkpoint": self.checkpoint}

    def load_state_dict(self, state: dict) -> None:
        self.best, self.best_step, self.worse, self.kls = state["best"], state["best_step"], state["worse"], state["kls"]
        self.previous, self.best_evaluation, self.checkpoint = state["previous"], state["best_evaluation"], \
            state["checkpoint"]

    @property
    def on(self) -> bool:
        return self.metric != "none"

    def track(self, metrics: dict) -> None:
        """Every step's metrics, for the mean KL since the last evaluation."""
        if "kl" in metrics:
            self.kls.append(metrics["kl"])

    def judge(self, step: int, evaluation: dict) -> bool:
        """Takes the evaluation at `step`; True when the run would now roll back to it (the loop saves a checkpoint)."""
        if self.metric == "accuracy":
            value = evaluation["accuracy"]
            if self.best is None or value > self.best:
                self.best, self.best_step, self.worse, self.best_evaluation = value, step, 0, evaluation
                return True
            self.worse = self.worse + 1 if value < self.best - self.delta * abs(self.best) else 0
            return False
        if not self.kls:  # no step since the last evaluation measured a KL
            return False
        value, self.kls = sum(self.kls) / len(self.kls), []
        grew, self.previous = self.previous is not None and value > self.previous * (1 + self.delta), value
        if grew:
            self.worse += 1
            return False
        self.best, self.best_step, self.worse, self.best_evaluation = value, step, 0, evaluation
        return True

    @property
    def stop(self) -> bool:
        return self.worse >= self.patience

    def summary(self, stopped_at: int | None) -> dict:
        return {"metric": self.metric, "best_step": self.best_step, "best_value": self.best, "stopped_at": stopped_at}
