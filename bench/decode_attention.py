"""The HF decode loop under eager and SDPA attention: completion tokens/s, by precision and threads.

    python bench/decode_attention.py                    # both variants, fp32 and bf16, 1 and 2 threads; ~4 min
    python bench/decode_attention.py --variants long-completions --threads 1 --repeats 3

Why it matters: a rollout worker samples with the attention the trainer uses (build.py, `trainer_attention`): eager
under bf16 on CPU, chosen for the update's backward. This measures what the other choice, the model's own SDPA,
would decode at on the CPU at hand. The variants and prompts are bench/decode_rows.py's (64 sequences, 8 prompts ×
8 samples; the warmed-up embedded model at a 64-token budget, and its architecture untrained at 256, whose
completions end at random near 100 tokens), with rollout.compact_every's default of 16.

Each configuration samples once untimed, then `--repeats` times under the same seeds; the table gives the median
completion tokens/s (real tokens ÷ seconds of `decode`) and SDPA's against eager's.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_rows import parse_args, sample, setup_of  # noqa: E402 - the same options, variants, prompts and timed decode

ATTENTION = ("eager", "sdpa")


def main(argv=None) -> None:
    args = parse_args(argv, __doc__)
    print("| variant | precision | threads | eager tokens/s | SDPA tokens/s | SDPA vs eager |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for variant in args.variants.split(","):
            setup, tok = setup_of(variant, Path(tmp))
            model = setup[0]
            for precision in args.precisions.split(","):
                for threads in map(int, args.threads.split(",")):
                    torch.set_num_threads(threads)
                    rates = {}
                    for attention in ATTENTION:
                        model.set_attn_implementation(attention)
                        sample(*setup, precision, 16, 99)  # untimed: one-time costs
                        runs = [sample(*setup, precision, 16, seed) for seed in range(args.repeats)]
                        rates[attention] = statistics.median(int((t != tok.pad_token_id).sum()) / s
                                                             for t, _, s in runs)
                    print(f"| {variant} | {precision} | {threads} | {rates['eager']:,.0f} | {rates['sdpa']:,.0f} | "
                          f"{rates['sdpa'] / rates['eager']:.2f}× |", flush=True)


if __name__ == "__main__":
    main()
