"""Samples of the starting model, drawn once and cached (RFT keeps the correct ones; DPO pairs them)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from posttrain.core.batch import Batch, collate
from posttrain.core.errors import DataError
from posttrain.data import RowSampler, completion_texts, prompt_ids, prompt_texts
from posttrain.judge import Judge
from posttrain.rollout import RolloutEngine
from posttrain.schema import DataConfig, RolloutConfig
from posttrain.sources.base import Source, register


def starting_samples(rows: list[dict], k: int, *, tokenizer, data: DataConfig, rollout: RolloutEngine,
                     sampling: RolloutConfig, judge: Judge, batch_size: int, seed: int, model_path: Path,
                     cache_dir: Path) -> list[dict]:
    """k samples of the starting policy for each of `rows`, with the judge's verdict.

    Generated once and cached (keyed by the model files, prompts and sampling settings), so a second run reuses them.
    Returns one dict per sample: prompt index, prompt and response token ids, and `correct`.
    """
    model_files = sorted(Path(model_path).glob("*.safetensors")) + [Path(model_path) / "config.json"]
    key = json.dumps({"model": [str(p.resolve()) + str(p.stat().st_mtime_ns) for p in model_files], "k": k,
                      "rows": [[r[data.prompt_field], r[data.answer_field]] for r in rows],
                      "rollout": vars(sampling), "prompt": prompt_texts(rows[:1], data, tokenizer),
                      "answer_format": data.answer_format, "seed": seed})
    path = cache_dir / f"samples-{hashlib.sha256(key.encode()).hexdigest()[:16]}.jsonl"
    if path.is_file():
        return [json.loads(line) for line in path.read_text().splitlines()]
    torch.manual_seed(seed)
    out = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        prompts = prompt_ids(tokenizer, chunk, data)
        batch = rollout.generate(prompts, k, max_new_tokens=sampling.max_new_tokens,
                                 temperature=sampling.temperature, top_p=sampling.top_p)
        correct = judge.correct([r for r in chunk for _ in range(k)], completion_texts(tokenizer, batch))
        for i in range(len(batch)):
            n = int(batch.mask[i].sum())
            out.append({"prompt": start + i // k, "prompt_ids": prompts[i // k],
                        "response_ids": batch.response_ids[i, :n].tolist(), "correct": correct[i]})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text("".join(json.dumps(s) + "\n" for s in out))
    tmp.rename(path)  # whole or absent, never half-written
    return out


def starting_samples_of(d, k: int, num_prompts: int) -> list[dict]:
    """`starting_samples` for the first `num_prompts` of this process's training rows, from a source's `Deps`."""
    return starting_samples(d.sampler.rows[:num_prompts], k, tokenizer=d.tokenizer, data=d.data,
                            rollout=d.rollout, sampling=d.sampling, judge=d.judge, batch_size=d.batch_size,
                            seed=d.seed, model_path=d.model_path, cache_dir=d.cache_dir)


@register("samples_once")
class SamplesOnce(Source):
    """RFT: the starting model's correct samples, drawn like offline rows."""

    @staticmethod
    def judges_rows(cfg) -> bool:
        return True  # a sample is kept when the judge finds it correct

    def __init__(self, samples: list[dict], pad_id: int, batch_size: int, seed: int):
        self.kept = [s for s in samples if s["correct"]]
        if not self.kept:
            raise DataError(f"algorithm.samples_per_prompt: none of the starting model's {len(samples)} samples is "
                            "correct; RFT has nothing to train on (more samples, or a stronger start)")
        self.pad_id, self.batch_size = pad_id, batch_size
        self.sampler = RowSampler(self.kept, seed)
        self.stats = {"rft_samples": float(len(samples)), "rft_kept": float(len(self.kept)),
                      "rft_prompts_with_correct": float(len({s["prompt"] for s in self.kept}))}

    @classmethod
    def from_deps(cls, d) -> SamplesOnce:
        a = d.algorithm
        return cls(starting_samples_of(d, a.samples_per_prompt, a.num_prompts), d.tokenizer.pad_token_id,
                   d.batch_size, d.seed)

    def next(self) -> tuple[Batch, dict]:
        rows = self.sampler.next(self.batch_size)
        batch = collate([r["prompt_ids"] for r in rows], [r["response_ids"] for r in rows], self.pad_id)
        batch.reward = torch.ones(len(rows))  # every kept sample is correct: I(o) = 1
        return batch, dict(self.stats)
