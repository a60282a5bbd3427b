"""DPO's pairs: a preferred and a dispreferred response per prompt, with reference log-probs computed once."""

from __future__ import annotations

from collections.abc import Callable

import torch

from posttrain.core.batch import Batch, collate
from posttrain.core.errors import DataError
from posttrain.data import RowSampler, check_fields, prompt_ids, read_rows, response_ids
from posttrain.sources.base import Source, register
from posttrain.sources.samples import starting_samples_of


def pairs_from_file(path: str, a, tokenizer, data) -> tuple[list[dict], dict]:
    """Pairs from a preference file with `a.prompt_field`, `a.chosen_field` and `a.rejected_field` on every row."""
    rows = read_rows(path, "algorithm.pairs_path")
    check_fields(rows, [a.prompt_field, a.chosen_field, a.rejected_field], "algorithm.pairs_path", path)
    prompts = prompt_ids(tokenizer, [{data.prompt_field: r[a.prompt_field]} for r in rows], data)
    responses = {f: response_ids(tokenizer, [{data.prompt_field: r[a.prompt_field], data.response_field: r[f]}
                                             for r in rows], data)
                 for f in (a.chosen_field, a.rejected_field)}
    pairs = [{"prompt_ids": p, "responses": [c, r]}
             for p, c, r in zip(prompts, responses[a.chosen_field], responses[a.rejected_field])]
    return pairs, {"dpo_pairs": float(len(rows))}


def pairs_from_samples(samples: list[dict]) -> tuple[list[dict], dict]:
    """Per prompt, its first correct and first incorrect sample; prompts without both are skipped."""
    by_prompt: dict[int, dict[bool, dict]] = {}
    for s in samples:
        by_prompt.setdefault(s["prompt"], {}).setdefault(s["correct"], s)
    pairs = [{"prompt_ids": d[True]["prompt_ids"], "responses": [d[True]["response_ids"], d[False]["response_ids"]]}
             for d in by_prompt.values() if len(d) == 2]
    if not pairs:
        raise DataError("algorithm.samples_per_prompt: no prompt got both a correct and an incorrect sample; "
                        "DPO has no pairs (more samples or prompts)")
    return pairs, {"dpo_pairs": float(len(pairs)), "dpo_skipped_prompts": float(len(by_prompt) - len(pairs))}


@register("pairs")
class Pairs(Source):
    """Rows interleaved [c0, r0, c1, r1, ...], reference log-probs precomputed once per pair.

    Args:
        pairs: {"prompt_ids", "responses": [chosen ids, rejected ids]} each.
        score_reference: [B, R] log π_ref of a batch; called here only, in chunks of `chunk_pairs` pairs.
    """

    scores_reference = True  # the engine may free the reference model once this source is built

    @staticmethod
    def judges_rows(cfg) -> bool:
        return not cfg.algorithm.pairs_path  # pairs of samples the judge found correct and incorrect

    def __init__(self, pairs: list[dict], stats: dict, score_reference: Callable[[Batch], torch.Tensor],
                 pad_id: int, batch_size: int, chunk_pairs: int, seed: int):
        self.pairs, self.stats, self.pad_id, self.batch_size = pairs, stats, pad_id, batch_size
        for start in range(0, len(pairs), chunk_pairs):
            chunk = pairs[start : start + chunk_pairs]
            logp = score_reference(self._collate(chunk, with_ref=False))  # [2·pairs, R], once for the whole run
            for j, pair in enumerate(chunk):
                pair["ref"] = [logp[2 * j + s, : len(pair["responses"][s])].cpu() for s in (0, 1)]
        self.sampler = RowSampler(self.pairs, seed)

    @classmethod
    def from_deps(cls, d) -> Pairs:
        a = d.algorithm
        if a.pairs_path:
            pairs, stats = pairs_from_file(a.pairs_path, a, d.tokenizer, d.data)
        else:
            pairs, stats = pairs_from_samples(starting_samples_of(d, a.samples_per_prompt, a.num_prompts))
        return cls(pairs, stats, d.score_reference, d.tokenizer.pad_token_id, d.batch_size,
                   max(1, d.micro_batch_size // 2), d.seed)

    def _collate(self, pairs: list[dict], with_ref: bool = True) -> Batch:
        prompts = [p["prompt_ids"] for p in pairs for _ in (0, 1)]
        responses = [r for p in pairs for r in p["responses"]]
        batch = collate(prompts, responses, self.pad_id)
        if with_ref:
            batch.ref_logp = torch.zeros(batch.mask.shape)  # [B, R]
            for i, ref in enumerate(r for p in pairs for r in p["ref"]):
                batch.ref_logp[i, : len(ref)] = ref
        return batch

    def next(self) -> tuple[Batch, dict]:
        return self._collate(self.sampler.next(self.batch_size)), dict(self.stats)
