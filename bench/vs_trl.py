"""posttrain against TRL's GRPOTrainer at equal settings, one GRPO step after another, each side in its own process.

    pip install ".[bench]"          # TRL
    python bench/vs_trl.py          # both sizes, fp32 and bf16, micro-batches 16 and 64; about 40 min on 2 CPU cores
    python bench/vs_trl.py --sizes 19.5M --precisions fp32 --micro 16   # one configuration, a few minutes

Both sides start from the same randomly initialised Llama (no download), saved once as a Hugging Face directory
with a 32,000-token vocabulary, so that the output layer is a real model's and completions run to the budget. The
settings are those of a GRPO step: 8 prompts × G = 8 completions of 128 new tokens (temperature 1, no top-k or
top-p), β = 0.04 against the starting model, μ = 1, the sequence-mean-of-token-mean loss (TRL's `loss_type="grpo"`),
group-scaled advantages, AdamW at lr 1e-6, gradient clipping at 1, the same rule reward (posttrain's `accuracy`,
called by both). The same 64 completions make one optimizer step on both sides: posttrain with
`train.micro_batch_size`, TRL with `per_device_train_batch_size` × `gradient_accumulation_steps` =
`steps_per_generation` × `per_device_train_batch_size` = 64.

Precision: fp32 against fp32, and bf16 against bf16 where both mean the same thing: bf16 compute under autocast
with fp32 weights, gradients and AdamW state (posttrain `train.precision=bf16-mixed`, TRL `bf16=True`).

Each side runs `--steps` measured steps after one unmeasured step (the first allocates everything), at each
micro-batch size in `--micro`; the table shows each side at its fastest. Figures, per step, as medians over the
measured steps: step time; completion tokens/s (completion tokens generated ÷ step time); rollout (sampling),
scoring (rewards and no-grad forwards of the reference) and update (forward, backward, optimizer) seconds; and the
process's peak RSS over the whole run (ru_maxrss; for posttrain, which resets the kernel's high-water mark at each
phase to measure phases, the run peak it keeps in summary.json, whichever is larger). TRL's phases come from timing its `_generate_single_turn` (rollout)
and `_generate_and_score_completions` (rollout + scoring) from outside; the rest of its step is the update.

The update's useful work is 6 · (non-embedding parameters of the body) · (tokens) + 6 · V · H · (completion tokens)
floating-point operations (attention scores left out); it is printed as a fraction of the matmul ceiling, a
2048³ matmul in the same dtype measured at the start of the run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
GSM8K = HERE.parent / "tests" / "fixtures" / "gsm8k" / "test_head.jsonl"  # 40 GSM8K test questions (MIT)
SIZES = {  # name -> Llama shape (untied output layer, vocabulary 32,000)
    "19.5M": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4),
    "100M": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=7, num_attention_heads=12),
}
VOCAB, PROMPTS, GROUP, NEW_TOKENS, BETA, LR = 32_000, 8, 8, 128, 0.04, 1e-6
PEAK: dict[str, float] = {}  # bytes, where a side keeps its own whole-run peak RSS
PROMPT_CHARS = 40  # each question's first characters: prompts of about 45 tokens, the same text on both sides


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated, from {', '.join(SIZES)}")
    p.add_argument("--precisions", default="fp32,bf16", help="comma-separated: fp32, bf16")
    p.add_argument("--micro", default="16,64", help="micro-batch sizes (sequences) tried on each side")
    p.add_argument("--micro-trl", help="TRL's micro-batch sizes, where they should differ from --micro")
    p.add_argument("--steps", type=int, default=3, help="measured steps per run, after one unmeasured step")
    p.add_argument("--sides", default="posttrain,trl", help=argparse.SUPPRESS)
    p.add_argument("--worker", nargs=5, metavar=("SIDE", "MODEL", "DATA", "PRECISION", "MICRO"),
                   help=argparse.SUPPRESS)
    return p.parse_args(argv)


# -- setup ------------------------------------------------------------------------------------------------------------
def build_model(path: Path, shape: dict, max_len: int = 512) -> int:
    """A random Llama of `shape` (positions up to `max_len`) and the padded character tokenizer, saved to `path`;
    returns its parameter count."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from posttrain.models.embedded import build_tokenizer

    tok = build_tokenizer(VOCAB)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, num_key_value_heads=shape["num_attention_heads"], tie_word_embeddings=False,
                         max_position_embeddings=max_len, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, **shape)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def write_prompts(path: Path, n: int) -> None:
    """`n` GSM8K questions cut to PROMPT_CHARS characters, with their answers (the 40 of the fixture over again if
    `n` is larger). Both sides put them in posttrain's default template, `Q: {question}\nA: `."""
    rows = [json.loads(line) for line in GSM8K.read_text().splitlines()]
    with path.open("w") as f:
        for r in (rows * (n // len(rows) + 1))[:n]:
            f.write(json.dumps({"question": r["question"][:PROMPT_CHARS], "answer": r["answer"]}) + "\n")


def matmul_ceiling(dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    """Median FLOP/s of an n³ matmul in `dtype` on this machine."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times)


# -- the two sides ----------------------------------------------------------------------------------------------------
def run_posttrain(model: str, data: str, precision: str, micro: int, steps: int) -> list[dict]:
    from posttrain import config
    from posttrain.sources import run_splits
    from posttrain.train.loop import run

    out = tempfile.mkdtemp(prefix="vs_trl_posttrain_")
    cfg, resolved = config.load("grpo_math", [
        f"model.path={model}", f"data.path={data}", f"output_dir={out}", "overwrite=true", "eval.num_problems=0",
        f"train.steps={steps + 1}", f"train.batch_size={PROMPTS}", f"train.micro_batch_size={micro}",
        f"train.lr={LR}", "train.warmup_steps=0", "train.max_grad_norm=1.0", "train.loss_agg=seq_mean_token_mean",
        f"train.precision={'bf16-mixed' if precision == 'bf16' else 'fp32'}", f"algorithm.group_size={GROUP}",
        f"algorithm.beta={BETA}", "algorithm.mu=1", "algorithm.clip_eps=0.2", "rollout.temperature=1.0",
        "rollout.top_p=1.0", f"rollout.max_new_tokens={NEW_TOKENS}"])
    summary = run(cfg, resolved, model_path=model, splits=run_splits(cfg), quiet=True)
    # posttrain resets the kernel's high-water mark at each phase (and with it ru_maxrss); it keeps the run's peak.
    PEAK["posttrain"] = summary["peak_rss_mb"] * 2**20
    metrics = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return [{"step": m["time/step"], "completion_tokens": m["generated_tokens"], "rollout": m["time/rollout"],
             "scoring": m["time/reward"] + m["time/score"], "update": m["time/update"]} for m in metrics]


def run_trl(model: str, data: str, precision: str, micro: int, steps: int) -> list[dict]:
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from posttrain.rewards.base import REWARDS

    accuracy = REWARDS["accuracy"]

    def reward(prompts, completions, answer, **_):
        return accuracy(completions, answer, prompts)

    rows = [{"prompt": f"Q: {r['question']}\nA: ", "answer": r["answer"]}
            for r in map(json.loads, Path(data).read_text().splitlines())]
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="vs_trl_trl_"), max_steps=steps + 1, per_device_train_batch_size=micro,
        gradient_accumulation_steps=PROMPTS * GROUP // micro, steps_per_generation=PROMPTS * GROUP // micro,
        num_generations=GROUP, max_completion_length=NEW_TOKENS, temperature=1.0, top_p=1.0, top_k=0, beta=BETA,
        num_iterations=1, epsilon=0.2, loss_type="grpo", scale_rewards="group", learning_rate=LR,
        lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0, bf16=precision == "bf16", use_cpu=True,
        model_init_kwargs={"dtype": torch.float32}, shuffle_dataset=False, logging_steps=1, report_to="none",
        save_strategy="no", disable_dropout=True, seed=0, dataloader_num_workers=0)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=Dataset.from_list(rows),
                          processing_class=AutoTokenizer.from_pretrained(model))
    timers = {"rollout": 0.0, "generate_and_score": 0.0, "completion_tokens": 0.0}

    def timed(name, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            timers[name] += time.perf_counter() - t0
            if name == "generate_and_score":
                timers["completion_tokens"] += float(out["completion_mask"].sum())
            return out
        return wrapper

    trainer._generate_single_turn = timed("rollout", trainer._generate_single_turn)
    trainer._generate_and_score_completions = timed("generate_and_score", trainer._generate_and_score_completions)
    records = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.t0 = time.perf_counter()
            timers.update(rollout=0.0, generate_and_score=0.0, completion_tokens=0.0)

        def on_step_end(self, *_, **__):
            step = time.perf_counter() - self.t0
            records.append({"step": step, "completion_tokens": timers["completion_tokens"],
                            "rollout": timers["rollout"], "scoring": timers["generate_and_score"] - timers["rollout"],
                            "update": step - timers["generate_and_score"]})

    trainer.add_callback(StepTimer())
    trainer.train()
    return records


def worker(args) -> None:
    side, model, data, precision, micro = args.worker
    records = (run_posttrain if side == "posttrain" else run_trl)(model, data, precision, int(micro), args.steps)
    peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, PEAK.get(side, 0))  # Linux: KiB
    print(json.dumps({"records": records[1:], "peak_rss": peak}))


def measure(side: str, model: Path, data: Path, precision: str, micro: int, steps: int) -> dict:
    cmd = [sys.executable, __file__, "--steps", str(steps), "--worker", side, str(model), str(data), precision,
           str(micro)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    if proc.returncode != 0:
        sys.exit(f"{side} ({precision}, micro-batch {micro}) failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    recs = result["records"]
    med = {k: statistics.median(r[k] for r in recs) for k in recs[0]}
    med["tok_per_s"] = statistics.median(r["completion_tokens"] / r["step"] for r in recs)
    return {"side": side, "micro": micro, "median": med, "peak_gb": result["peak_rss"] / 1e9, "steps": len(recs)}


def useful_flop(shape: dict, prompt_tokens: float, completion_tokens: float) -> float:
    """6 · non-embedding body parameters · all tokens + 6 · V · H · completion tokens (forward and backward)."""
    h, i, n = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    body = n * (4 * h * h + 3 * h * i)
    return 6 * body * (prompt_tokens + completion_tokens) + 6 * VOCAB * h * completion_tokens


def prompt_tokens_per_step(model: Path, data: Path, steps: int) -> float:
    """Prompt tokens in one step's 64 sequences, averaged over the steps' prompts."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    return GROUP * sum(len(tok(f"Q: {r['question']}\nA: ")["input_ids"]) for r in rows) / (steps + 1)


def main() -> None:
    args = parse_args()
    if args.worker:
        return worker(args)
    sizes, precisions = args.sizes.split(","), args.precisions.split(",")
    micros = {side: [int(m) for m in (args.micro_trl if side == "trl" and args.micro_trl else args.micro).split(",")]
              for side in args.sides.split(",")}
    ceiling = {p: matmul_ceiling(torch.float32 if p == "fp32" else torch.bfloat16) for p in precisions}
    print(f"GRPO step: {PROMPTS} prompts x G={GROUP}, {NEW_TOKENS} new tokens, beta={BETA}, mu=1, V={VOCAB}; "
          f"{torch.get_num_threads()} threads; medians of {args.steps} steps after 1 unmeasured")
    print("matmul ceiling (2048^3): " + ", ".join(f"{p} {c / 1e12:.2f} TFLOP/s" for p, c in ceiling.items()))
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "prompts.jsonl"
        write_prompts(data, PROMPTS * (args.steps + 1))
        for size in sizes:
            model = Path(tmp) / size
            n = build_model(model, SIZES[size])
            for precision in precisions:
                best = {}
                for side in args.sides.split(","):
                    runs = [measure(side, model, data, precision, m, args.steps) for m in micros[side]]
                    for r in runs:
                        print(f"  [{size} {precision}] {side:<9} micro-batch {r['micro']:>3}: "
                              f"{r['median']['tok_per_s']:.0f} completion tok/s, step {r['median']['step']:.1f} s")
                    best[side] = max(runs, key=lambda r: r["median"]["tok_per_s"])
                report(size, n, precision, best, ceiling[precision], prompt_tokens_per_step(model, data, args.steps))


def report(size: str, n: int, precision: str, best: dict, ceiling: float, prompt_tokens: float) -> None:
    print(f"\n{size} ({n / 1e6:.1f}M parameters), {precision}; each side at its fastest micro-batch")
    print(f"{'side':<10} {'micro':>5} {'step s':>7} {'compl tok/s':>12} {'rollout s':>10} {'scoring s':>10} "
          f"{'update s':>9} {'peak RSS GB':>12}")
    for side, r in best.items():
        m = r["median"]
        print(f"{side:<10} {r['micro']:>5} {m['step']:>7.2f} {m['tok_per_s']:>12.0f} {m['rollout']:>10.2f} "
              f"{m['scoring']:>10.2f} {m['update']:>9.2f} {r['peak_gb']:>12.2f}")
    if {"posttrain", "trl"} <= best.keys():
        ours, theirs = best["posttrain"]["median"], best["trl"]["median"]
        print(f"posttrain / TRL: {ours['tok_per_s'] / theirs['tok_per_s']:.2f}x completion tokens/s, "
              f"{best['posttrain']['peak_gb'] / best['trl']['peak_gb']:.2f}x peak RSS, "
              f"{ours['step'] / theirs['step']:.2f}x step time")
    if "posttrain" in best:
        m = best["posttrain"]["median"]
        flop = useful_flop(SIZES[size], prompt_tokens, m["completion_tokens"])
        print(f"posttrain update: {flop / 1e12:.2f} TFLOP useful work in {m['update']:.2f} s = "
              f"{flop / m['update'] / 1e12:.3f} TFLOP/s, {flop / m['update'] / ceiling:.0%} of the {precision} matmul "
              f"ceiling")


if __name__ == "__main__":
    main()
