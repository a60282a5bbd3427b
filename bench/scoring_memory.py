"""Peak memory of posttrain's scoring engine against the naive log_softmax over all [B, T, V] logits.

    python bench/scoring_memory.py            # defaults: B=8, P=768, R=256, V=32000; about 75 s on 2 CPU cores

`naive_token_logprobs` materialises float32 [B, T, V] logits and a float32 log_softmax of them; `token_logprobs`
has the model's output head reduce the hidden states of the real response tokens to one log-probability each,
`--chunk-rows` positions at a time, and recomputes each chunk's logits in backward: no [B, R, V] tensor exists.
Both are measured in two modes: `no_grad` (reference and old policy) and `fwd+bwd` (policy: sum of masked log-probs,
then `.backward()`).

Each variant runs in its own fresh subprocess (both modes, one after the other), so one variant's memory never
hides inside another's peak; each measurement is repeated `--repeats` times and the median printed. The figure is
peak memory ABOVE the baseline taken after the model and inputs are built. On CPU it is the kernel's exact
resident-set high-water mark (VmHWM), reset before each repeat by writing 5 to /proc/self/clear_refs (Linux >= 4.0);
where that is not possible, the RSS is sampled every millisecond by a background thread, and the output says so. On
CUDA it is torch.cuda.max_memory_allocated, reset before each repeat. The log-probs of both variants are compared.

Reading the figures: naive holds three [B, T, V] float32 tensors at once in no_grad (logits, logits / temperature,
log_softmax), and their gradients in fwd+bwd. posttrain holds one [chunk_rows, V] chunk of logits and its softmax,
plus the model's own activations, which are the same for both.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
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
    p.add_argument("--chunk-rows", type=int, default=512, help="token_logprobs' chunk_rows")
    p.add_argument("--repeats", type=int, default=3, help="measurements per (variant, mode); the median is printed")
    p.add_argument("--worker", nargs=2, metavar=("VARIANT", "DEVICE"), help=argparse.SUPPRESS)
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
    from posttrain.models.scoring import naive_token_logprobs, token_logprobs

    if variant == "naive":
        return naive_token_logprobs(model, input_ids, attention_mask, prompt_len)
    return token_logprobs(model, input_ids, attention_mask, prompt_len, chunk_rows=chunk_rows)  # [B, R]


class CpuPeak:
    """Peak RSS above the level at entry.

    Linux keeps the exact high-water mark (VmHWM) and resets it when 5 is written to /proc/self/clear_refs (Linux
    >= 4.0). Where that fails, a thread samples the RSS every millisecond, which can miss a short peak.
    """

    def __init__(self):
        try:
            self._reset_hwm()
            self.exact = True
            self.method = "CPU: peak RSS above baseline, kernel high-water mark VmHWM reset via /proc/self/clear_refs"
        except OSError:
            self.exact = False
            self.method = "CPU: peak RSS above baseline, psutil sampling every 1 ms in a background thread"

    @staticmethod
    def _reset_hwm():
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    @staticmethod
    def _status_bytes(field: str) -> int:
        with open("/proc/self/status") as f:
            return 1024 * next(int(line.split()[1]) for line in f if line.startswith(field + ":"))  # "VmRSS: 12 kB"

    def _sample(self):
        while not self._stop.wait(0.001):
            self.top = max(self.top, psutil.Process().memory_info().rss)

    def __enter__(self):
        gc.collect()
        if hasattr(libc := ctypes.CDLL(None), "malloc_trim"):
            libc.malloc_trim(0)  # glibc: return freed heap pages, so every repeat starts from the live data only
        if self.exact:
            self._reset_hwm()
            self.base = self._status_bytes("VmRSS")
        else:
            self.base = self.top = psutil.Process().memory_info().rss
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self.exact:
            self.top = self._status_bytes("VmHWM")
        else:
            self._stop.set()
            self._thread.join()
        self.peak = self.top - self.base


class CudaPeak:
    method = "CUDA: torch.cuda.max_memory_allocated above memory_allocated at baseline"

    def __enter__(self):
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.base = torch.cuda.memory_allocated()
        return self

    def __exit__(self, *exc):
        torch.cuda.synchronize()
        self.peak = torch.cuda.max_memory_allocated() - self.base


def worker(args) -> None:
    """Measure one variant on one device, both modes, `--repeats` times each; print one JSON line."""
    variant, device = args.worker
    model, input_ids, attention_mask, P = build(args, device)
    mask = attention_mask[:, P:]  # [B, R]
    meter = CudaPeak() if device == "cuda" else CpuPeak()
    peaks = {mode: [] for mode in MODES}
    for mode in MODES:
        for _ in range(args.repeats):
            model.zero_grad(set_to_none=True)  # each repeat allocates the parameter grads afresh
            with meter, torch.set_grad_enabled(mode == "fwd+bwd"):
                logp = score(variant, model, input_ids, attention_mask, P, args.chunk_rows)  # [B, R]
                if mode == "fwd+bwd":
                    (logp * mask).sum().backward()
                else:
                    values = (logp * mask).tolist()  # for the naive-vs-posttrain comparison
                del logp
            peaks[mode].append(meter.peak / MiB)
    print(json.dumps({"peaks": peaks, "values": values, "method": meter.method}))


def measure(variant: str, device: str) -> dict:
    """`worker` in a fresh interpreter, so that no other variant's memory is in its process."""
    # A fixed mmap threshold stops glibc from moving mid-sized freed tensors into its heap, where they stay resident
    # and blur the RSS; with it, RSS follows the live tensors and repeats agree to within a few MiB.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MiB)}
    cmd = [sys.executable, __file__, *sys.argv[1:], "--worker", variant, device]
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout.splitlines()[-1])


def main() -> None:
    args = parse_args()
    if args.worker:
        return worker(args)
    B, R, V = args.batch, args.response_len, args.vocab
    T = args.prompt_len + R
    print(f"B={B} P={args.prompt_len} R={R} T={T} V={V} chunk_rows={args.chunk_rows}, float32 model, "
          f"{torch.get_num_threads()} threads; median of {args.repeats} repeats, each variant in a fresh subprocess")
    print(f"one float32 [B, T, V] tensor: {B * T * V * 4 / MiB:.0f} MiB; "
          f"one float32 [B, R, V]: {B * R * V * 4 / MiB:.0f} MiB")
    for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        naive, ours = (measure(v, device) for v in VARIANTS)
        print(f"\n{naive['method']}\n{'mode':<10} {'naive MiB':>10} {'posttrain MiB':>15} {'ratio':>8}")
        for mode in MODES:
            n, o = statistics.median(naive["peaks"][mode]), statistics.median(ours["peaks"][mode])
            print(f"{mode:<10} {n:>10.0f} {o:>15.0f} {n / o:>7.1f}x")
        diff = (torch.tensor(naive["values"]) - torch.tensor(ours["values"])).abs().max().item()
        print(f"max |naive - posttrain| log-prob over the response tokens: {diff:.2e}")


if __name__ == "__main__":
    main()
