"""Data sources: where each step's batch comes from. A plugin names one (`Algorithm.source`); the engine builds it.

- ``offline``: rows of (prompt, response) from a file, a `datasets` object or the embedded task (SFT).
- ``online``: G samples of the current policy per prompt, judged by the rewards, every step (GRPO, PPO, Online RFT).
- ``samples_once``: k samples of the starting model per prompt, generated once (and cached), kept where the accuracy
  rule says correct (RFT).
- ``pairs``: a correct and an incorrect response to one prompt, from a preference file or judged from the starting
  model's samples; reference log-probs are computed once per pair here and reused every step (DPO).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import torch

from posttrain import data, rollout
from posttrain.batch import Batch
from posttrain.errors import DataError
from posttrain.rewards import accuracy


class Offline:
    def __init__(self, engine):
        self.engine = engine

    def next(self) -> tuple[Batch, dict]:
        e, cfg = self.engine, self.engine.cfg
        rows = e.sampler.next(cfg.train.batch_size)
        tok = e.tokenizer
        batch = data.collate(data.prompt_ids(tok, rows, cfg.data), data.response_ids(tok, rows, cfg.data),
                             tok.pad_token_id)
        return batch, {}


class Online:
    def __init__(self, engine):
        self.engine = engine

    def next(self) -> tuple[Batch, dict]:
        e, cfg = self.engine, self.engine.cfg
        rows = e.sampler.next(cfg.train.batch_size)
        n = e.plugin.samples_per_prompt(cfg.algorithm)
        t0 = time.perf_counter()
        batch = rollout.sample(e.model, e.tokenizer, data.prompt_ids(e.tokenizer, rows, cfg.data), n,
                               max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                               top_p=cfg.rollout.top_p)
        stats = {"time/rollout": time.perf_counter() - t0, "generated_tokens": float(batch.mask.sum()),
                 "response_len": float(batch.mask.sum(-1).mean()),
                 "truncated_frac": float(batch.truncated.float().mean())}
        t0 = time.perf_counter()
        batch.reward, reward_stats = e.judge([r for r in rows for _ in range(n)], rollout.completions(e.tokenizer, batch))
        stats.update(reward_stats, **{"time/reward": time.perf_counter() - t0})
        return batch, stats


def starting_samples(engine, k: int, num_prompts: int) -> list[dict]:
    """k samples of the starting policy for each of `num_prompts` training prompts, with the accuracy verdict.

    Generated once and cached (keyed by the model, prompts and sampling settings), so a second run reuses them.
    """
    e, cfg = engine, engine.cfg
    rows = e.train_rows[e.acc.process_index :: e.acc.num_processes][:num_prompts]
    model_files = sorted(Path(e.model_path).glob("*.safetensors")) + [Path(e.model_path) / "config.json"]
    key = json.dumps({"model": [str(p.resolve()) + str(p.stat().st_mtime_ns) for p in model_files], "k": k,
                      "rows": [[r[cfg.data.prompt_field], r[cfg.data.answer_field]] for r in rows],
                      "rollout": vars(cfg.rollout), "template": cfg.data.template, "seed": cfg.seed})
    path = e.cache_dir / f"samples-{hashlib.sha256(key.encode()).hexdigest()[:16]}.jsonl"
    if path.is_file():
        return [json.loads(line) for line in path.read_text().splitlines()]
    torch.manual_seed(cfg.seed)
    out = []
    for start in range(0, len(rows), cfg.train.batch_size):
        chunk = rows[start : start + cfg.train.batch_size]
        prompts = data.prompt_ids(e.tokenizer, chunk, cfg.data)
        batch = rollout.sample(e.model, e.tokenizer, prompts, k, max_new_tokens=cfg.rollout.max_new_tokens,
                               temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p)
        texts = rollout.completions(e.tokenizer, batch)
        answers = [str(r[cfg.data.answer_field]) for r in chunk for _ in range(k)]
        correct = accuracy.accuracy(texts, answers)
        for i in range(len(batch)):
            n = int(batch.mask[i].sum())
            out.append({"prompt": start + i // k, "prompt_ids": prompts[i // k],
                        "response_ids": batch.response_ids[i, :n].tolist(), "correct": correct[i] == 1.0})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text("".join(json.dumps(s) + "\n" for s in out))
    tmp.rename(path)  # whole or absent, never half-written
    return out


class SamplesOnce:
    """RFT: the starting model's correct samples, drawn like offline rows."""

    def __init__(self, engine):
        a = engine.cfg.algorithm
        samples = starting_samples(engine, a.samples_per_prompt, a.num_prompts)
        self.kept = [s for s in samples if s["correct"]]
        if not self.kept:
            raise DataError(f"algorithm.samples_per_prompt: none of the starting model's {len(samples)} samples is "
                            "correct; RFT has nothing to train on (more samples, or a stronger start)")
        self.engine = engine
        self.sampler = data.RowSampler(self.kept, engine.cfg.seed)
        self.stats = {"rft_samples": float(len(samples)), "rft_kept": float(len(self.kept)),
                      "rft_prompts_with_correct": float(len({s["prompt"] for s in self.kept}))}

    def next(self) -> tuple[Batch, dict]:
        rows = self.sampler.next(self.engine.cfg.train.batch_size)
        batch = data.collate([r["prompt_ids"] for r in rows], [r["response_ids"] for r in rows],
                             self.engine.tokenizer.pad_token_id)
        batch.reward = torch.ones(len(rows))  # every kept sample is correct: I(o) = 1
        return batch, dict(self.stats)


class Pairs:
    """DPO: (chosen, rejected) pairs, rows interleaved [c0, r0, c1, r1, ...], reference log-probs precomputed."""

    def __init__(self, engine):
        e, a = engine, engine.cfg.algorithm
        self.engine = engine
        self.pairs = self._from_file(a.pairs_path) if a.pairs_path else self._from_samples()
        ref = e.ref
        for start in range(0, len(self.pairs), max(1, e.cfg.train.micro_batch_size // 2)):
            chunk = self.pairs[start : start + max(1, e.cfg.train.micro_batch_size // 2)]
            batch = self._collate(chunk, with_ref=False).to(e.acc.device)
            logp = e.score(ref, batch)  # [2·pairs, R], once per pair for the whole run
            for j, pair in enumerate(chunk):
                pair["ref"] = [logp[2 * j + s, : len(pair["responses"][s])].cpu() for s in (0, 1)]
        e.ref = None  # the reference is no longer needed: its memory is freed
        self.sampler = data.RowSampler(self.pairs, e.cfg.seed)

    def _from_file(self, path: str) -> list[dict]:
        e, a = self.engine, self.engine.cfg.algorithm
        rows = data.read_rows(path, "algorithm.pairs_path")
        data.check_fields(rows, [a.prompt_field, a.chosen_field, a.rejected_field], path)
        tok = e.tokenizer
        prompts = data.prompt_ids(tok, [{e.cfg.data.prompt_field: r[a.prompt_field]} for r in rows], e.cfg.data)
        responses = {f: data.response_ids(tok, [{e.cfg.data.response_field: r[f]} for r in rows], e.cfg.data)
                     for f in (a.chosen_field, a.rejected_field)}
        self.stats = {"dpo_pairs": float(len(rows))}
        return [{"prompt_ids": p, "responses": [c, r]}
                for p, c, r in zip(prompts, responses[a.chosen_field], responses[a.rejected_field])]

    def _from_samples(self) -> list[dict]:
        a = self.engine.cfg.algorithm
        by_prompt: dict[int, dict[bool, dict]] = {}
        for s in starting_samples(self.engine, a.samples_per_prompt, a.num_prompts):
            by_prompt.setdefault(s["prompt"], {}).setdefault(s["correct"], s)
        pairs = [{"prompt_ids": d[True]["prompt_ids"], "responses": [d[True]["response_ids"], d[False]["response_ids"]]}
                 for d in by_prompt.values() if len(d) == 2]
        self.stats = {"dpo_pairs": float(len(pairs)), "dpo_skipped_prompts": float(len(by_prompt) - len(pairs))}
        if not pairs:
            raise DataError("algorithm.samples_per_prompt: no prompt got both a correct and an incorrect sample; "
                            "DPO has no pairs (more samples or prompts)")
        return pairs

    def _collate(self, pairs: list[dict], with_ref: bool = True) -> Batch:
        prompts = [p["prompt_ids"] for p in pairs for _ in (0, 1)]
        responses = [r for p in pairs for r in p["responses"]]
        batch = data.collate(prompts, responses, self.engine.tokenizer.pad_token_id)
        if with_ref:
            batch.ref_logp = torch.zeros(batch.mask.shape)  # [B, R]
            for i, ref in enumerate(r for p in pairs for r in p["ref"]):
                batch.ref_logp[i, : len(ref)] = ref
        return batch

    def next(self) -> tuple[Batch, dict]:
        return self._collate(self.sampler.next(self.engine.cfg.train.batch_size)), dict(self.stats)


SOURCES = {"offline": Offline, "online": Online, "samples_once": SamplesOnce, "pairs": Pairs}
