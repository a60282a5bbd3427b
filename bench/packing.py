"""Padding against packing: the update's tokens/s and peak RSS, padded, under a token budget, and packed, beside
TRL's SFTTrainer padded and padding-free on the same sequences; and the rollout's tokens/s with and without the rows
that ended. At 19.5M and 100M parameters, fp32, on two length distributions.

    pip install ".[bench]"          # TRL
    python bench/packing.py         # both sizes, both distributions; about 25 minutes on 2 CPU cores
    python bench/packing.py --sizes 19.5M --dists gsm8k --steps 2

Length distributions (tokens of each sequence's prompt and response):
- embedded: the embedded task's rows (recipe=grpo_math's data), prompts and the worked answers SFT trains on, in
  the embedded character tokenizer: short and close to one another;
- gsm8k: drawn from tests/fixtures/gsm8k/lengths.json, real GSM8K questions and answers in a byte-level BPE learnt
  from GSM8K (answers 37 to 512 tokens, median 138): the long tail of a reasoning run.

The models are random Llamas of bench/vs_trl.py's shapes (32,000-token vocabulary, untied head), positions up to
1,024. Token ids are drawn at random at those lengths: the compute depends on the lengths alone.

Update: one optimizer step (AdamW, lr 1e-6) over `--rows` sequences, the loss on the response tokens (SFT's), one
unmeasured step, then `--steps` measured (`--trl-steps` for TRL, whose steps are slower); tokens/s is real tokens
(prompt and response) per second of the step, median. posttrain's three variants run in one process, taking turns
on each step's batch, each with its own peak RSS (the kernel's high-water mark reset before each of its updates,
large allocations given back to the system when freed, as the engine's update does); TRL's each in its own process
(its ru_maxrss, model loading included). The variants:
- padded: today's default, `train.micro_batch_size=8`: rows longest first, each micro-batch trimmed to its columns
  with a real token (prompts left-padded, responses right-padded, so a micro-batch is as wide as its longest prompt
  plus its longest response);
- budget: `train.micro_batch_tokens` = 8 mean rows' tokens, padded;
- packed: the same budget with `train.packing=true`: sequences end to end in rows as wide as the longest;
- trl padded / trl padding-free: TRL's SFTTrainer, `per_device_train_batch_size=8` and gradient accumulation over the
  same rows in TRL's shuffled order, padded to the longest of each 8 (transformers 5 has no `group_by_length`), or
  padding-free (`padding_free=True`: the 8 flattened into one row, restarting position ids).
"computed" is the tokens the forward runs on (padding included) over the real ones: the padding share is 1 − 1/it.

Rollout: `--rows` completions of prompts at the distribution's lengths, decoded by the HF engine's loop with every
row kept to the end (`rollout.compact_every=0`) and with ended rows dropped every 16 tokens (the default), under the
same seeds. A hook on the output head sets the stop token's probability at each step to the hazard of the
distribution's response lengths, so that completions end at those lengths whatever the random weights say.
Completion tokens/s, median of `--repeats`, and the share of rows whose tokens came out the same both ways: the
loop draws every row's number alike either way, but in fp32 a matrix product's last bits depend on how many rows it
computes, so a draw that falls within that rounding of a boundary between two tokens can go the other way (at a
32,000-token vocabulary of near-equal probabilities, boundaries are close).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from vs_trl import SIZES, VOCAB, build_model  # noqa: E402  (the shapes and model builder bench/vs_trl.py uses)

LENGTHS = HERE.parent / "tests" / "fixtures" / "gsm8k" / "lengths.json"
MICRO_ROWS, LR, MAX_LEN = 8, 1e-6, 1024


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated, from {', '.join(SIZES)}")
    p.add_argument("--dists", default="embedded,gsm8k", help="comma-separated: embedded, gsm8k")
    p.add_argument("--rows", type=int, default=32, help="sequences per optimizer step and per rollout")
    p.add_argument("--steps", type=int, default=5, help="measured optimizer steps of posttrain's variants")
    p.add_argument("--repeats", type=int, default=2, help="rollouts per setting")
    p.add_argument("--trl-steps", type=int, default=2, help="measured optimizer steps of each TRL variant")
    p.add_argument("--no-trl", dest="trl", action="store_false", help="posttrain's variants only")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # one measurement, as JSON, in this process
    return p.parse_args(argv)


def lengths(dist: str, n: int, seed: int = 0) -> list[tuple[int, int]]:
    """(prompt, response) token lengths of `n` sequences of a distribution."""
    rng = random.Random(seed)
    if dist == "gsm8k":
        table = json.loads(LENGTHS.read_text())
        pairs = list(zip(table["question"], table["answer"]))
    else:
        from posttrain import config
        from posttrain.data import prompt_ids, response_ids
        from posttrain.models.embedded import build_tokenizer
        from posttrain.sources import run_splits

        cfg, _ = config.load("grpo_math", ["data.train_size=2000"])
        rows, tok = run_splits(cfg)[0], build_tokenizer()
        pairs = [(len(p), len(r)) for p, r in zip(prompt_ids(tok, rows, cfg.data), response_ids(tok, rows, cfg.data))]
    return [pairs[rng.randrange(len(pairs))] for _ in range(n)]


def sequences(dist: str, n: int, step: int) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts and responses of random ids (never a special token) at the distribution's lengths; `step` varies them."""
    rng = random.Random(1000 + step)
    pairs = lengths(dist, n, seed=step)
    ids = lambda k: [rng.randrange(10, VOCAB) for _ in range(k)]  # noqa: E731
    return [ids(p) for p, _ in pairs], [ids(r) for _, r in pairs]


# -- the update, one variant per process ---------------------------------------------------------------------------
def posttrain_update(model: str, dist: str, rows: int, steps: int) -> dict:
    """posttrain's three variants in one process, taking turns on each step's batch (so that the machine's drift
    touches all alike); each one's peak RSS is the high-water mark of its own updates, reset before each."""
    from posttrain import config
    from posttrain.backends.ddp import DDP
    from posttrain.core.batch import collate
    from posttrain.core.heap import large_allocations_mapped
    from posttrain.core.memory import PhasePeaks
    from posttrain.models.scoring import pack
    from posttrain.sources import run_splits
    from posttrain.train import build

    budget = MICRO_ROWS * round(statistics.mean(p + r for p, r in lengths(dist, rows)))
    settings = {"padded": (MICRO_ROWS, None, False), "budget": (rows, budget, False), "packed": (rows, budget, True)}
    cfg, _ = config.load("sft_math", [f"model.path={model}", "train.precision=fp32", f"train.lr={LR}",
                                      "data.train_size=64", "data.test_size=4"])
    engine = build(cfg, model, DDP(), run_splits(cfg))
    peaks, rates = PhasePeaks(), {v: [] for v in settings}
    computed = dict.fromkeys(settings, 0)
    for step in range(steps + 1):
        batch = collate(*sequences(dist, rows, step), engine.tokenizer.pad_token_id)
        real = int(batch.attention_mask.sum())
        for variant, (engine.micro, engine.micro_tokens, engine.packed) in settings.items():
            if step == steps:  # the forward's tokens, padding included, over the real ones, of the last batch
                computed[variant] = sum(pack(mb.input_ids, mb.attention_mask, mb.prompt_len).input_ids.numel()
                                        if engine.packed else mb.input_ids.numel()
                                        for _, mb in engine.micro_batches(batch)) / real
            with peaks.phase(variant), large_allocations_mapped():
                engine.update(batch, engine.totals(batch))
            if step:  # the first is unmeasured: it allocates AdamW's state
                rates[variant].append(real / peaks.seconds[variant])
    return {v: {"tokens_per_s": statistics.median(rates[v]), "computed": computed[v],
                "peak_rss": peaks.cpu_mb[v] * 2**20} for v in settings}


def trl_update(model: str, dist: str, variant: str, rows: int, steps: int) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    data = {"input_ids": [], "completion_mask": []}
    real = []
    for step in range(steps + 1):
        prompts, responses = sequences(dist, rows, step)
        real.append(sum(map(len, prompts)) + sum(map(len, responses)))
        for p, r in zip(prompts, responses):
            data["input_ids"].append(p + r)
            data["completion_mask"].append([0] * len(p) + [1] * len(r))
    free = variant == "trl padding-free"
    args = SFTConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=MICRO_ROWS,
                     gradient_accumulation_steps=rows // MICRO_ROWS, max_steps=steps + 1, learning_rate=LR,
                     lr_scheduler_type="constant", padding_free=free, max_length=None,
                     report_to=[], save_strategy="no", logging_steps=10_000, use_cpu=True, bf16=False,
                     dataloader_drop_last=True, seed=0)
    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            times.append(time.perf_counter())

        def on_step_end(self, *a, **k):
            times[-1] = time.perf_counter() - times[-1]

    tok = AutoTokenizer.from_pretrained(model)
    trainer = SFTTrainer(model=AutoModelForCausalLM.from_pretrained(model, attn_implementation="sdpa"), args=args,
                         train_dataset=Dataset.from_dict(data), processing_class=tok, callbacks=[Clock()])
    trainer.train()
    # TRL shuffles the rows: every step takes `rows` of them, about the mean real tokens of a step
    per_step = statistics.mean(real)
    return {variant: {"tokens_per_s": statistics.median(per_step / t for t in times[1:]), "computed": None,
                      "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}}


# -- the rollout --------------------------------------------------------------------------------------------------
def hazard(responses: list[int], budget: int) -> list[float]:
    """P(stop at token k | not stopped before) for k = 0 .. budget - 1, from the response lengths (EOS counted in)."""
    counts = [0] * (budget + 1)
    for n in responses:
        counts[min(n, budget)] += 1
    left, out = len(responses), []
    for k in range(budget):
        out.append(counts[k + 1] / left if left else 1.0)
        left -= counts[k + 1]
    return out


def rollout(model_dir: str, dist: str, rows: int, repeats: int) -> dict:
    from posttrain.core.batch import left_pad
    from posttrain.models.loading import load, stop_token_ids
    from posttrain.rollout.hf import decode

    model, tok = load(model_dir)
    model.eval()
    stops = stop_token_ids(model, tok)
    eos = stops[0]
    pairs = lengths(dist, 4000, seed=7)
    budget = max(r for _, r in pairs)
    h = hazard([r for _, r in pairs], budget)
    prompts, _ = sequences(dist, rows, 99)
    ids, mask = left_pad(prompts, tok.pad_token_id)
    state = {"k": 0}

    def stop_at_hazard(module, inputs, logits):  # [b, t, V]: the last position's stop probability is h[k]
        last = logits[:, -1]
        others = torch.cat([last[:, :eos], last[:, eos + 1 :]], -1).logsumexp(-1)  # [b]
        p = min(max(h[min(state["k"], budget - 1)], 1e-6), 1 - 1e-6)
        last[:, eos] = others + math.log(p / (1 - p))
        state["k"] += 1
        return logits

    model.get_output_embeddings().register_forward_hook(stop_at_hazard)
    out = {}
    for every in (0, 16):
        runs = []
        for seed in range(repeats + 1):  # the first untimed
            state["k"] = 0
            torch.manual_seed(seed)
            t0 = time.perf_counter()
            with torch.no_grad():
                tokens, _ = decode(model, ids, mask, budget, stop_ids=stops, pad_id=tok.pad_token_id,
                                   compact_every=every)
            runs.append((tokens, time.perf_counter() - t0))
        out[every] = runs[1:]
    same = sum(int((a == b).all(-1).sum()) for (a, _), (b, _) in zip(out[0], out[16]))  # rows drawn alike
    real = [int((t != tok.pad_token_id).sum()) for t, _ in out[0]]
    rate = {e: statistics.median(n / s for n, (_, s) in zip(real, runs)) for e, runs in out.items()}
    return {"kept": rate[0], "dropped": rate[16], "same": same / (rows * repeats), "mean_len": statistics.mean(real) / rows,
            "budget": budget}


def worker(spec: str) -> None:
    s = json.loads(spec)
    if s["variant"] == "rollout":
        result = rollout(s["model"], s["dist"], s["rows"], s["repeats"])
    elif s["variant"] == "posttrain":
        result = posttrain_update(s["model"], s["dist"], s["rows"], s["steps"])
    else:
        result = trl_update(s["model"], s["dist"], s["variant"], s["rows"], s["trl_steps"])
    print("RESULT " + json.dumps(result), flush=True)


def measure(**spec) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], capture_output=True, text=True)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"{spec}: failed\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args.worker)
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, {args.rows} sequences a step")
    print("| size | lengths | padding share today (whole batch) | variant | update tokens/s | vs padded | computed / "
          "real | peak RSS |")
    print("|---|---|---|---|---|---|---|---|")
    rollouts = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes.split(","):
            model = str(Path(tmp) / size)
            build_model(Path(model), SIZES[size], max_len=MAX_LEN)
            for dist in args.dists.split(","):
                pairs = lengths(dist, args.rows)
                whole = 1 - sum(p + r for p, r in pairs) / (len(pairs) * (max(p for p, _ in pairs) +
                                                                           max(r for _, r in pairs)))
                results = measure(model=model, dist=dist, variant="posttrain", rows=args.rows, steps=args.steps)
                for v in ("trl padded", "trl padding-free") if args.trl else ():
                    results.update(measure(model=model, dist=dist, variant=v, rows=args.rows, trl_steps=args.trl_steps))
                base = results.get("padded", {}).get("tokens_per_s")
                today = 1 - 1 / results["padded"]["computed"] if "padded" in results else float("nan")
                for v, r in results.items():
                    vs = f"{r['tokens_per_s'] / base:.2f}×" if base else ""
                    computed = f"{r['computed']:.2f}" if r["computed"] else ""
                    print(f"| {size} | {dist} | {today:.0%} ({whole:.0%}) | {v} | {r['tokens_per_s']:,.0f} | {vs} | "
                          f"{computed} | {r['peak_rss'] / 2**30:.2f} GiB |", flush=True)
                rollouts.append((size, dist, measure(model=model, dist=dist, variant="rollout", rows=args.rows,
                                                     repeats=args.repeats)))
    print()
    print("| size | lengths | completion tokens (mean, budget) | every row kept, tokens/s | ended rows dropped, "
          "tokens/s | speed-up | rows drawn alike |")
    print("|---|---|---|---|---|---|---|")
    for size, dist, r in rollouts:
        print(f"| {size} | {dist} | {r['mean_len']:.0f}, {r['budget']} | {r['kept']:,.0f} | {r['dropped']:,.0f} | "
              f"{r['dropped'] / r['kept']:.2f}× | {r['same']:.0%} |")


if __name__ == "__main__":
    main()
