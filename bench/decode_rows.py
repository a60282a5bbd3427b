"""The HF decode loop with and without the rows that ended (`rollout.compact_every`): completion tokens/s.

    python bench/decode_rows.py                 # both length distributions, fp32 and bf16, 1 and 2 threads; ~3 min
    python bench/decode_rows.py --threads 1 --repeats 3

Length distributions, 64 sequences (8 prompts × 8 samples, the prompts of the embedded task):
- embedded: the warmed-up embedded model (`recipe=grpo_math`'s start), 64-token budget: completions of ~20 tokens,
  close to one another;
- long-completions: the embedded model's architecture untrained, 256-token budget: completions end at random, a mean
  near 100 tokens and a tail to the budget (the spread of GSM8K's worked solutions), as in bench/async.py.

Each configuration samples once untimed, then `--repeats` times under the same seeds with every value of
compact_every; the table gives the median completion tokens/s (real tokens ÷ seconds of `decode`), the speed-up
over compact_every = 0 (every row kept to the end, the loop before rows left it), the share of the loop's row-steps
that were padding with every row kept, and whether every repeat drew the same tokens as compact_every = 0 (it
must) with the largest log-prob difference.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from pathlib import Path

import torch

from posttrain.core.batch import left_pad
from posttrain.models.loading import load, stop_token_ids
from posttrain.rollout.hf import decode

EVERY = (0, 4, 8, 16)


def parse_args(argv=None, doc: str = __doc__) -> argparse.Namespace:
    """The options of this bench and of bench/decode_attention.py (`doc`: the calling bench's docstring)."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--variants", default="embedded,long-completions")
    p.add_argument("--precisions", default="fp32,bf16", help="comma-separated: fp32, bf16 (bf16 autocast)")
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    p.add_argument("--repeats", type=int, default=5)
    return p.parse_args(argv)


def model_of(variant: str, root: Path):
    """(model, tokenizer, token budget) of a variant."""
    if variant == "embedded":
        from posttrain import config
        from posttrain.apps import warmup

        cfg, _ = config.load("grpo_math", [])
        return (*load(warmup.ensure(cfg, quiet=True)[0]), 64)
    from posttrain.models.embedded import build_model_dir

    return (*load(build_model_dir(root / "untrained", seed=0)), 256)


def setup_of(variant: str, root: Path) -> tuple[tuple, object]:
    """(the arguments of `sample` before its precision, tokenizer) of a variant: 8 prompts × 8 samples."""
    model, tok, budget = model_of(variant, root)
    model.eval()
    prompts = [tok(f"Q: What is {17 * i + 5} + {29 * i + 11}?\nA: ")["input_ids"] for i in range(8)]
    ids, mask = left_pad([p for p in prompts for _ in range(8)], tok.pad_token_id)
    return (model, ids, mask, budget, stop_token_ids(model, tok), tok.pad_token_id), tok


def sample(model, ids, mask, budget: int, stops: list[int], pad: int, precision: str, every: int, seed: int):
    """(tokens, log-probs, seconds) of one decode under `seed`."""
    torch.manual_seed(seed)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
    t0 = time.perf_counter()
    with torch.no_grad(), autocast:
        tokens, logp = decode(model, ids, mask, budget, stop_ids=stops, pad_id=pad, compact_every=every)
    return tokens, logp, time.perf_counter() - t0


def main(argv=None) -> None:
    args = parse_args(argv)
    print("| variant | precision | threads | compact_every | tokens/s | vs 0 | padding share at 0 | same tokens | "
          "max abs Δ log-prob |")
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for variant in args.variants.split(","):
            setup, tok = setup_of(variant, Path(tmp))
            for precision in args.precisions.split(","):
                for threads in map(int, args.threads.split(",")):
                    torch.set_num_threads(threads)
                    sample(*setup, precision, 8, 99)  # untimed: one-time costs
                    results = {e: [sample(*setup, precision, e, seed) for seed in range(args.repeats)] for e in EVERY}
                    kept = results[0]
                    real = [int((t != tok.pad_token_id).sum()) for t, _, _ in kept]  # completion tokens a repeat
                    padding = statistics.mean(1 - n / t.numel() for n, (t, _, _) in zip(real, kept))
                    base = statistics.median(n / s for n, (_, _, s) in zip(real, kept))
                    for every, runs in results.items():
                        rate = statistics.median(n / s for n, (_, _, s) in zip(real, runs))
                        same = all(torch.equal(t, k[0]) for (t, _, _), k in zip(runs, kept))
                        delta = max(float((lp - k[1]).abs().max()) for (_, lp, _), k in zip(runs, kept))
                        print(f"| {variant} | {precision} | {threads} | {every} | {rate:,.0f} | {rate / base:.2f}× | "
                              f"{padding:.0%} | {'yes' if same else 'NO'} | {delta:.1e} |", flush=True)


if __name__ == "__main__":
    main()
