"""Peak memory of posttrain's scoring engine against the naive log_softmax over all [B, T, V] logits.

    python bench/scoring_memory.py            # defaults: B=8, P=768, R=256, V=32000; about a minute on 2 CPU cores

`naive_token_logprobs` materialises float32 [B, T, V] logits and a float32 log_softmax of them; `token_logprobs`
asks the model for logits at the R response positions only (`logits_to_keep`) and reduces them in chunks of
`--chunk-rows` rows, checkpointed under autograd. Both are measured in two modes: `no_grad` (reference and old policy)
and `fwd+bwd` (policy: sum of masked log-probs, then `.backward()`).

Each (variant, mode) runs in its own fresh subprocess, so one variant's peak never hides inside another's; within it
the measurement is repeated `--repeats` times and the median printed. The figure is peak memory ABOVE the baseline
taken after the model and inputs are built. On CPU it is the kernel's exact resident-set high-water mark (VmHWM),
reset before each repeat by writing 5 to /proc/self/clear_refs (Linux >= 4.0); where that is not possible, the RSS
is sampled every millisecond by a background thread instead, and the output says so. On CUDA it is
torch.cuda.max_memory_allocated, reset before each repeat.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import statistics
import subprocess
import sys
import threading

import psutil
import torch

MODES = ("no_grad", "fwd+bwd")
VARIANTS = ("naive", "posttrain")
MiB = 2**20


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=8, help="B, sequences per batch")
    p.add_argument("--prompt-len", type=int, default=768, help="P, prompt columns (left-padded)")
    p.add_argument("--response-len", type=int, default=256, help="R, response columns")
    p.add_argument("--vocab", type=int, default=32000, help="V; large, so that logits dominate memory")
    p.add_argument("--hidden", type=int, default=64, help="hidden size of the tiny Llama")
    p.add_argument("--max-pad", type=int, default=64, help="each row gets 0..max-pad left-padding tokens")
    p.add_argument("--chunk-rows", type=int, default=2048, help="token_logprobs' chunk_rows")
    p.add_argument("--repeats", type=int, default=3, help="measurements per (variant, mode); the median is printed")
    p.add_argument("--worker", nargs=3, metavar=("VARIANT", "MODE", "DEVICE"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def build(args, device: str):
    """A randomly initialised tiny Llama (no download) and a left-padded batch of random tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=args.prompt_len + args.response_len)
    model = LlamaForCausalLM(config).to(device)
    B, P, T = args.batch, args.prompt_len, args.prompt_len + args.response_len
    input_ids = torch.randint(1, args.vocab, (B, T), device=device)  # [B, T]
    pad = torch.randint(0, args.max_pad + 1, (B, 1), device=device)  # [B, 1] left-padding length per row
    attention_mask = (torch.arange(T, device=device)[None] >= pad).long()  # [B, T]
    input_ids = input_ids * attention_mask  # pad id 0
    return model, input_ids, attention_mask, P


def score(variant: str, model, input_ids, attention_mask, prompt_len: int, chunk_rows: int) -> torch.Tensor:
    from posttrain.scoring import naive_token_logprobs, token_logprobs

    if variant == "naive":
        return naive_token_logprobs(model, input_ids, attention_mask, prompt_len)
    return token_logprobs(model, input_ids, attention_mask, prompt_len, chunk_rows=chunk_rows)  # [B, R]


class CpuPeak:
    """Peak RSS above the level at entry. Kernel high-water mark if it can be reset, else 1 ms sampling."""

    def __init__(self):
        try:
            self._reset_hwm()
            self.method = "CPU peak RSS above baseline: kernel high-water mark VmHWM, reset via /proc/self/clear_refs"
        except OSError:
            self._reset_hwm = None
            self.method = "CPU peak RSS above baseline: psutil sampling every 1 ms in a background thread"

    @staticmethod
    def _reset_hwm():
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    @staticmethod
    def _status_kib(field: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))

    def __enter__(self):
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # give freed heap pages back, so every repeat starts from live data
        if self._reset_hwm:
            self._reset_hwm()
            self.base = self._status_kib("VmRSS") * 1024
        else:
            proc, self.base, self.top, self._stop = psutil.Process(), psutil.Process().memory_info().rss, 0, False

            def sample():
                while not self._stop:
                    self.top = max(self.top, proc.memory_info().rss)
                    threading.Event().wait(0.001)

            self._thread = threading.Thread(target=sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self._reset_hwm:
            self.top = self._status_kib("VmHWM") * 1024
        else:
            self._stop = True
            self._thread.join()
        self.peak = self.top - self.base


class CudaPeak:
    method = "CUDA torch.cuda.max_memory_allocated above memory_allocated at baseline"

    def __enter__(self):
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        self.base = torch.cuda.memory_allocated()
        return self

    def __exit__(self, *exc):
        torch.cuda.synchronize()
        self.peak = torch.cuda.max_memory_allocated() - self.base


def worker(args) -> None:
    """Measure one (variant, mode, device) `--repeats` times; print the peaks in MiB as one JSON line."""
    variant, mode, device = args.worker
    model, input_ids, attention_mask, P = build(args, device)
    meter = CudaPeak() if device == "cuda" else CpuPeak()
    peaks = []
    for _ in range(args.repeats):
        model.zero_grad(set_to_none=True)  # each repeat allocates parameter grads afresh
        with meter, torch.set_grad_enabled(mode == "fwd+bwd"):
            logp = score(variant, model, input_ids, attention_mask, P, args.chunk_rows)  # [B, R]
            if mode == "fwd+bwd":
                (logp * attention_mask[:, P:]).sum().backward()
            del logp
        peaks.append(meter.peak / MiB)
    print(json.dumps({"peaks": peaks, "method": meter.method}))


def measure(variant: str, mode: str, device: str) -> tuple[float, str]:
    cmd = [sys.executable, __file__, *sys.argv[1:], "--worker", variant, mode, device]
    out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
    return statistics.median(out["peaks"]), out["method"]


def max_abs_diff(args) -> float:
    """Both variants give the same log-probs (no grad, on CPU), over the unpadded response tokens."""
    model, input_ids, attention_mask, P = build(args, "cpu")
    with torch.no_grad():
        naive, ours = (score(v, model, input_ids, attention_mask, P, args.chunk_rows) for v in VARIANTS)
        return ((naive - ours).abs() * attention_mask[:, P:]).max().item()


def main() -> None:
    args = parse_args()
    if args.worker:
        return worker(args)
    B, T, V = args.batch, args.prompt_len + args.response_len, args.vocab
    print(f"B={B} P={args.prompt_len} R={args.response_len} T={T} V={V} chunk_rows={args.chunk_rows} "
          f"threads={torch.get_num_threads()}, median of {args.repeats} runs, each variant in a fresh subprocess")
    print(f"one float32 [B, T, V] tensor: {B * T * V * 4 / MiB:.0f} MiB; "
          f"one float32 [B, R, V]: {B * args.response_len * V * 4 / MiB:.0f} MiB")
    for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        rows = []
        for mode in MODES:
            (naive, method), (ours, _) = (measure(v, mode, device) for v in VARIANTS)
            rows.append(f"{mode:<10} {naive:>10.0f} {ours:>15.0f} {naive / ours:>7.1f}x")
        print(f"\n{method}\n{'mode':<10} {'naive MiB':>10} {'posttrain MiB':>15} {'ratio':>8}", *rows, sep="\n")
    print(f"\nmax |naive - posttrain| log-prob over response tokens: {max_abs_diff(args):.2e}")


if __name__ == "__main__":
    main()
