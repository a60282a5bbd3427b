"""Prompt lengths, checked once over a run's rows before training: a warning when prompts are cut, or when one prompt
is so much longer than the rest that every batch drawing it is padded to its length; and a token budget
(`train.micro_batch_tokens`) that the longest sequence would not fit, refused.

A batch is padded to its longest prompt, so one 20,000-character question among short ones makes the steps that draw
it many times slower (a 2-step run took 236 s instead of 14 s), and nothing else says why. The check tokenizes the
prompts as the run will (`prompt_ids`) but uncut, once, not in the loop.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys

from posttrain.core.errors import ConfigError
from posttrain.data.rows import held_out_split, prompt_ids, response_ids
from posttrain.schema import RunConfig

RATIO = 4  # the longest prompt, as cut, over the median prompt, beyond which it is said to dominate the padding
FLOOR = 256  # tokens under which a prompt is never said to dominate: padding to it costs little
SAMPLE = 20_000  # rows tokenized at most: with more, an even sample of this many and the LONGEST longest questions
LONGEST = 256


def long_prompts(tokenizer, train: list[dict], test: list[dict], cfg: RunConfig) -> str | None:
    """One line saying which prompts data.max_prompt_len cuts, or which one dominates the padding of the batches that
    draw it (longer than FLOOR tokens and RATIO× the median, after the cut), naming the longest row; None when neither.

    The rows checked are the training rows and the held-out rows evaluated (`eval.num_problems` of them).
    """
    data = cfg.data
    rows = train + test[: cfg.eval.num_problems]
    if not rows:
        return None
    typical, picked = _picked(rows, data.prompt_field)
    uncut = dataclasses.replace(data, max_prompt_len=sys.maxsize)
    length = dict(zip(picked, map(len, prompt_ids(tokenizer, [rows[i] for i in picked], uncut))))
    cap = data.max_prompt_len
    longest = max(length, key=length.get)
    n, padded = length[longest], min(length[longest], cap)
    median = max(statistics.median(min(length[i], cap) for i in typical), 1)
    cut = sum(v > cap for v in length.values())
    dominates = padded > FLOOR and padded > RATIO * median
    if not cut and not dominates:
        return None
    where = _where(longest, len(train), cfg)
    counted = ("" if len(picked) == len(rows) else "at least ") + f"{cut} of {len(rows):,} prompts"
    if not dominates:
        return (f"{counted} {'is' if cut == 1 else 'are'} longer than data.max_prompt_len={cap} tokens and "
                f"{'keeps' if cut == 1 else 'keep'} only the last {cap}, losing the start (the longest: {where}, "
                f"{n:,} tokens)")
    ratio = f"{padded / median:.0f}x the median prompt ({median:g} tokens)"
    if cut:
        also = f"; {counted} are cut" if cut > 1 else ""
        return (f"{where}'s prompt is {n:,} tokens, cut to its last {cap} by data.max_prompt_len and still {ratio}: "
                f"every batch that draws it is padded to {cap} tokens, which slows its step{also} (lower "
                "data.max_prompt_len, or drop the row)")
    return (f"{where}'s prompt is {n:,} tokens, {ratio}: every batch that draws it is padded to its length, which "
            f"slows its step (data.max_prompt_len={cap} bounds prompts: lower it, or drop the row)")


def longest_sequence(tokenizer, train: list[dict], cfg: RunConfig, given: bool) -> tuple[int, str]:
    """The most tokens one training sequence can take, and what makes it so, for a message.

    Args:
        tokenizer: the policy's tokenizer.
        train: the training rows.
        cfg: the run's config.
        given: the rows hold the responses trained on (SFT): a row's prompt and response tokens, as cut; else the
            responses are sampled: the longest prompt, as cut, and one sampled token (a completion's length is not
            known before it is sampled, and a long one over the budget runs alone: a budget below the longest
            prompt + rollout.max_new_tokens is a fair setting for long generations that are mostly short).

    Past SAMPLE rows, an even sample and the rows with the longest questions are read (`_picked`).
    """
    picked = _picked(train, cfg.data.prompt_field)[1]
    rows = [train[i] for i in picked]
    lengths = list(map(len, prompt_ids(tokenizer, rows, cfg.data)))
    if given:
        lengths = [p + len(r) for p, r in zip(lengths, response_ids(tokenizer, rows, cfg.data))]
    at = max(range(len(rows)), key=lengths.__getitem__)
    where = _where(picked[at], len(train), cfg)
    if given:
        return lengths[at], f"{where} is {lengths[at]:,} tokens, prompt and response"
    return lengths[at] + 1, f"{where}'s prompt, {lengths[at]:,} tokens, + one sampled token"


def check_token_budget(tokenizer, train: list[dict], cfg: RunConfig, given: bool) -> None:
    """Refuses a `train.micro_batch_tokens` below the longest training sequence it can know of (`longest_sequence`):
    each sequence over the budget runs as a micro-batch of its own, and a budget below every one (4 tokens, meant as
    rows, say) ran a 2-step run for over 5 minutes, one sequence at a time, saying nothing."""
    budget = cfg.train.micro_batch_tokens
    if budget is None or not train:
        return
    longest, why = longest_sequence(tokenizer, train, cfg, given)
    if budget < longest:
        raise ConfigError(f"train.micro_batch_tokens: {budget:,} tokens are fewer than the longest sequence takes, "
                          f"{longest:,} ({why}), and each sequence over the budget runs as a micro-batch of its own; "
                          f"give at least {longest}, or null for micro-batches of train.micro_batch_size rows")

def _picked(rows: list[dict], field: str) -> tuple[list[int], list[int]]:
    """(the rows the median is taken over, every row to tokenize): all of them, or past SAMPLE rows an even sample
    and the LONGEST rows with the longest questions, where the longest prompts are."""
    if len(rows) <= SAMPLE:
        return list(range(len(rows))), list(range(len(rows)))
    even = list(range(0, len(rows), -(-len(rows) // SAMPLE)))
    longest = sorted(range(len(rows)), key=lambda i: len(str(rows[i][field])))[-LONGEST:]
    return even, sorted(set(even) | set(longest))


def _where(i: int, num_train: int, cfg: RunConfig) -> str:
    """Row `i` of training rows + held-out rows, as the user finds it: its file's key and its row number."""
    d = cfg.data
    if i < num_train:
        return f"data.path row {i + 1}" if d.path else f"training row {i + 1}"
    j = i - num_train
    if d.test_path:
        return f"data.test_path row {j + 1}"
    if d.path and held_out_split(d.path) is not None:
        return f"data.path's test split row {j + 1}"
    return f"data.path row {num_train + j + 1}" if d.path else f"held-out row {j + 1}"
