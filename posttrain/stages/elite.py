"""The elite replay stage (`rollout.elite_pool`): the best completion ever sampled for a prompt, replayed into its
group when the policy falls below it.

Idea: self-imitation (Oh et al. 2018, "Self-Imitation Learning", arXiv:1806.05635): a policy that once found a
high-reward answer should keep learning from it while its fresh samples do worse. The pool (`rollout.elite_pool`
prompts, 0: off) holds, per prompt (its token ids), one completion: the highest-reward one sampled so far (ties: the
newer), as its response ids and mask, its behaviour log-probs μ(o_t|·) (the `rollout_logp` the rollout engine reported
when it drew it, at that step's sampling temperature), the policy version that drew it, its reward and whether it was
truncated. The pool is a controller: the run owns it and checkpoints it. When full, the prompt
least recently stored or replayed is evicted (LRU).

Each step the stage (`EliteReplay`, after dynamic sampling has kept groups by their own samples' rewards) calls
`inject` on the fresh batch, then `update`:
    inject: for each group whose best fresh reward is strictly below its prompt's elite reward, the group's
        lowest-reward sample (the last of equals) is replaced by the elite, with the elite's reward, truncation,
        version and μ as `rollout_logp`, and marked in `batch.extra["replayed"]` ([B] float, 1.0 on replayed rows; present whenever
        the pool is on). Rows and group ids stay as they were (every process runs as many rows); an elite longer
        than the batch's R widens the batch, padding every per-token tensor.
    update: each group's best fresh sample (replayed rows excluded) replaces its prompt's elite if its reward is at
        least the stored one.
The pool fires only when a prompt is drawn again: from the second pass over the training rows, or with small data.

Why the lowest-reward sample: the group keeps its best fresh samples, so the policy's own successes and most of its
failures still set the group's baseline, and a group of equal rewards (no advantage) gets the spread back; e.g. with
0/1 rewards a group of all 0 gains one 1, whose group-relative advantage is positive.

Off-policy correction (train/engine.py, `Engine.coefficient`): a replayed row was drawn from an older policy μ, not
π_old, the policy that sampled this step. Each of its tokens' GC is multiplied by the truncated importance weight of
V-trace (Espeholt et al. 2018, IMPALA, arXiv:1802.01561, the ρ̄ truncation)

    w_t = min(π_old(o_t|q,o_<t) / μ(o_t|q,o_<t), C),   C = rollout.elite_is_cap,

a constant of the gradient like the advantage; the plugin's own clipped ratio πθ/π_old does the rest, so the product
is πθ/μ truncated. With C = 1 a token the policy has since moved away from is down-weighted and none is up-weighted.
The estimate is biased (the truncation, and the elite is a best-of-many pick, not a draw from μ: the bias towards
high-reward answers is the point) but bounded: w_t ≤ C. Fresh rows are untouched (`rollout.tis_cap` still applies to
them), and replayed rows are left out of the train-inference mismatch (`mismatch/*`): their `rollout_logp` is μ.

Metrics:
    elite/replayed: rows replaced by an elite this step (`metrics`).
    elite/pool_size: prompts in the pool after the step's update.
    elite/is_weight: mean w_t over the step's replayed tokens on every process (0 if none; logged by the engine).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass

import torch

from posttrain.core.batch import Batch
from posttrain.core.errors import ConfigError
from posttrain.data import completion_texts
from posttrain.stages.base import Judged, Stage

REPLAYED = "replayed"  # the key in `batch.extra` of the [B] marks of replayed rows


@dataclass
class Elite:
    response: list[int]  # [L] token ids
    mask: torch.Tensor  # [L] the row's `mask` over them, on the CPU
    logp: torch.Tensor  # [L] μ: log-probs of the policy that drew them, at its sampling temperature, on the CPU
    reward: float
    truncated: bool
    version: int = 0  # the policy version that drew it


class ElitePool:
    """The best completion per prompt, at most `capacity` prompts (LRU); `pad_id` pads widened responses."""

    def __init__(self, capacity: int, pad_id: int):
        self.capacity, self.pad_id = capacity, pad_id
        self.elites: OrderedDict[tuple[int, ...], Elite] = OrderedDict()  # least recently stored or used first

    def __len__(self) -> int:
        return len(self.elites)

    def metrics(self, replayed: int) -> dict[str, float]:
        return {"elite/replayed": float(replayed), "elite/pool_size": float(len(self))}

    def update(self, batch: Batch) -> None:
        """Stores each group's best fresh sample where its reward is ≥ its prompt's elite's (or none is stored)."""
        if batch.rollout_logp is None:
            raise ValueError("ElitePool.update: the batch has no rollout_logp, the behaviour log-probs μ it stores")
        for rows in groups(batch):
            i = int(rows[batch.reward[rows].argmax()])
            key, reward = prompt_key(batch, i), float(batch.reward[i])
            if key in self.elites and reward < self.elites[key].reward:
                continue
            L = int(batch.attention_mask[i, batch.prompt_len :].sum())  # responses are right-padded
            version = int(batch.version[i]) if batch.version is not None else 0
            self.elites[key] = Elite(batch.response_ids[i, :L].tolist(), batch.mask[i, :L].detach().cpu().clone(),
                                     batch.rollout_logp[i, :L].detach().float().cpu().clone(), reward,
                                     bool(batch.truncated[i]), version)
            self.elites.move_to_end(key)
        while len(self.elites) > self.capacity:
            self.elites.popitem(last=False)

    def inject(self, batch: Batch) -> tuple[Batch, int]:
        """The batch with each group's lowest-reward sample replaced by its prompt's elite where the group's best fresh
        reward is below the elite's, and `extra["replayed"]` marking them; and how many rows were replaced."""
        if batch.rollout_logp is None or any(t is not None for t in (batch.old_logp, batch.ref_logp, batch.adv)):
            raise ValueError("ElitePool.inject: runs on the source's batch, with the rollout's log-probs and before "
                             "the engine scores it")
        chosen = []  # (row, its prompt, the elite)
        for rows in groups(batch):
            key = prompt_key(batch, int(rows[0]))
            elite = self.elites.get(key)
            reward = batch.reward[rows]  # [n]
            if elite is not None and float(reward.max()) < elite.reward:
                lowest = (reward == reward.min()).nonzero().flatten()  # [k]
                chosen.append((int(rows[lowest[-1]]), key, elite))
        B, P, R = len(batch), batch.prompt_len, batch.input_ids.shape[1] - batch.prompt_len
        batch = batch.widened(P, max([R] + [len(e.response) for _, _, e in chosen]), self.pad_id)
        batch = batch._map(torch.clone)  # the caller's batch stays as it was
        R = batch.input_ids.shape[1] - P
        replayed = batch.extra.get(REPLAYED, torch.zeros(B, device=batch.mask.device))  # [B]
        for i, key, e in chosen:
            L, dev = len(e.response), batch.input_ids.device
            batch.input_ids[i, P:] = self.pad_id
            batch.input_ids[i, P : P + L] = torch.tensor(e.response, dtype=torch.long, device=dev)
            batch.attention_mask[i, P:] = 0
            batch.attention_mask[i, P : P + L] = 1
            for name, t in batch.extra.items():  # per-token extras described the sample replaced
                if name != REPLAYED and t.dim() >= 2 and t.shape[1] == R:
                    t[i] = 0
            for t, value in ((batch.mask, e.mask), (batch.rollout_logp, e.logp)):
                t[i] = 0
                t[i, :L] = value.to(t.device, t.dtype)
            batch.truncated[i], batch.reward[i], replayed[i] = e.truncated, e.reward, 1.0
            if batch.version is not None:
                batch.version[i] = e.version
            self.elites.move_to_end(key)
        batch.extra[REPLAYED] = replayed
        return batch, len(chosen)

    def state_dict(self) -> dict:
        """The pool in LRU order, as CPU tensors and lists."""
        return {"elites": [{"prompt": list(k), **dataclasses.asdict(e)} for k, e in self.elites.items()]}

    def load_state_dict(self, state: dict) -> None:
        self.elites = OrderedDict((tuple(e["prompt"]), Elite(**{k: v for k, v in e.items() if k != "prompt"}))
                                  for e in state["elites"])
        while len(self.elites) > self.capacity:
            self.elites.popitem(last=False)


class EliteReplay(Stage):
    """The stage around the pool: inject, then update, then the texts of replayed rows for the stages after it."""

    key = "rollout.elite_pool"

    def __init__(self, pool: ElitePool, tokenizer):
        self.pool, self.tokenizer = pool, tokenizer

    @staticmethod
    def check(cfg, plugin) -> None:
        r = cfg.rollout
        if r.elite_pool and (plugin.source != "online" or plugin.samples_per_prompt(cfg.algorithm) < 2):
            raise ConfigError(f"rollout.elite_pool: replays a prompt's best sample in place of the worst of its group; "
                              f"{plugin.name} with these settings samples no groups (one completion per prompt, or "
                              "none)")
        if r.elite_pool and cfg.rewards.normalize != "none":
            raise ConfigError(f"rollout.elite_pool: compares rewards across steps, and rewards.normalize="
                              f"{cfg.rewards.normalize} makes each reward relative to its own step's samples; choose "
                              "one")

    @staticmethod
    def on(cfg, needs) -> bool:
        return bool(cfg.rollout.elite_pool)

    @classmethod
    def build(cls, deps) -> EliteReplay:
        return cls(deps.elite, deps.tokenizer)

    def __call__(self, judged: Judged, more) -> Judged:
        batch, replayed = self.pool.inject(judged.batch)
        self.pool.update(batch)
        metrics = {**judged.metrics, **self.pool.metrics(replayed)}
        if not replayed:
            return judged.replace(batch=batch, metrics=metrics)
        marks = batch.extra[REPLAYED].cpu() > 0  # [B]
        outcome = torch.where(marks, batch.reward.cpu(), judged.outcome)  # [B] a replayed row's stored reward
        return judged.replace(batch=batch, texts=completion_texts(self.tokenizer, batch), outcome=outcome,
                              metrics=metrics)


def prompt_key(batch: Batch, i: int) -> tuple[int, ...]:
    """The real (unpadded) prompt token ids of row i."""
    P = batch.prompt_len
    return tuple(batch.input_ids[i, :P][batch.attention_mask[i, :P].bool()].tolist())


def fresh_mask(batch: Batch) -> torch.Tensor:
    """[B, R] `mask` less the rows replayed from an elite pool (`extra["replayed"]`): the tokens this step's rollout
    engine drew, whose `rollout_logp` measures the train-inference mismatch and the sampling entropy."""
    replayed = batch.extra.get(REPLAYED)  # [B] or None
    return batch.mask if replayed is None else batch.mask * (1 - replayed)[:, None].to(batch.mask.dtype)


def groups(batch: Batch) -> list[torch.Tensor]:
    """The CPU row indices of each group's fresh (not replayed) samples, for every group that has some."""
    group = batch.group.cpu()  # [B]
    keep = torch.ones(len(batch), dtype=torch.bool)  # [B]
    if REPLAYED in batch.extra:
        keep = batch.extra[REPLAYED].cpu() == 0
    out = [((group == g) & keep).nonzero().flatten() for g in group.unique().tolist()]
    return [rows for rows in out if len(rows)]
