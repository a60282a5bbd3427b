"""Which attention implementation runs packed sequences fastest on this machine: the packed update's tokens/s under
SDPA (the block-diagonal mask transformers builds from restarting position ids), eager and flex attention, taking
turns in one process on each step's batch; and each one's packed log-probs against SDPA's padded ones.

    python bench/packing_attention.py                       # 19.5M, GSM8K lengths, 5 measured updates
    python bench/packing_attention.py --size 100M --steps 3

The model and sequences are bench/packing.py's (a random Llama of bench/vs_trl.py's shapes, 32 sequences drawn from
the GSM8K length fixture), fp32, `train.micro_batch_tokens` = 8 mean rows' tokens, `train.packing=true`. An
implementation that cannot run here (flex attention compiles a kernel through torch's inductor) is reported with its
error's first line, and left out of the timing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from packing import LR, MICRO_ROWS, lengths, sequences  # noqa: E402
from vs_trl import SIZES, build_model  # noqa: E402

IMPLEMENTATIONS = ("sdpa", "eager", "flex_attention")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="19.5M", choices=sorted(SIZES))
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--steps", type=int, default=5, help="measured updates (one more runs first, unmeasured)")
    args = ap.parse_args(argv)

    from posttrain import config
    from posttrain.backends.ddp import DDP
    from posttrain.core.batch import collate
    from posttrain.core.precision import cpu_class
    from posttrain.models.lora import hf_model
    from posttrain.sources import run_splits
    from posttrain.train import build

    tmp = Path(tempfile.mkdtemp())
    build_model(tmp / "model", SIZES[args.size], 1024)
    budget = MICRO_ROWS * round(statistics.mean(p + r for p, r in lengths("gsm8k", args.rows)))
    cfg, _ = config.load("sft_math", [f"model.path={tmp / 'model'}", "train.precision=fp32", f"train.lr={LR}",
                                      "data.train_size=64", "data.test_size=4", f"train.micro_batch_tokens={budget}",
                                      "train.packing=true"])
    engine = build(cfg, str(tmp / "model"), DDP(), run_splits(cfg))
    model, pad = hf_model(engine.policy.module), engine.tokenizer.pad_token_id
    print(f"{args.size}, {args.rows} sequences of GSM8K lengths, budget {budget} tokens, {cpu_class()}, "
          f"{torch.get_num_threads()} threads, fp32")

    batch = collate(*sequences("gsm8k", args.rows, 0), pad)
    engine.packed = False
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        padded = engine.score(engine.policy.module, batch)
    engine.packed = True
    usable = []
    for impl in IMPLEMENTATIONS:
        try:
            model.set_attn_implementation(impl)
            with torch.no_grad():
                packed = engine.score(engine.policy.module, batch)
        except Exception as e:  # noqa: BLE001 - reported, and left out of the timing
            print(f"{impl:15s} did not run: {type(e).__name__}: {str(e).strip().splitlines()[0][:160]}")
            continue
        usable.append(impl)
        print(f"{impl:15s} packed log-probs vs padded SDPA: max |diff| {(packed - padded).abs().max().item():.2e}")

    rates = {impl: [] for impl in usable}
    for step in range(args.steps + 1):
        batch = collate(*sequences("gsm8k", args.rows, step), pad)
        real = int(batch.attention_mask.sum())
        for impl in usable:  # taking turns, so that the machine's drift touches each alike
            model.set_attn_implementation(impl)
            t0 = time.perf_counter()
            engine.update(batch, engine.totals(batch))
            if step:
                rates[impl].append(real / (time.perf_counter() - t0))
    base = statistics.median(rates["sdpa"]) if "sdpa" in rates else None
    for impl in usable:
        median = statistics.median(rates[impl])
        spread = f"{min(rates[impl]):,.0f}-{max(rates[impl]):,.0f}"
        ratio = f", {median / base:.2f}x SDPA" if base else ""
        print(f"{impl:15s} packed update: median {median:,.0f} tok/s (range {spread}){ratio}")


if __name__ == "__main__":
    main()
