"""A GPU check of posttrain: GRPO on a ~0.5B model in bf16 under `ddp` and `fsdp2`, its measured throughput and
memory set against `posttrain estimate`, and the HF decode loop's speed, all recorded in one JSON file.

    bash bench/gpu_check.sh --prepare gpu_wheels      # where a package index is reachable: the wheels to carry
    bash bench/gpu_check.sh --wheels gpu_wheels       # on the GPU machine: a venv over its torch, then the check
    bash bench/gpu_check.sh --no-install              # with posttrain already installed
    bash bench/gpu_check.sh --smoke                   # the same code on CPU, tiny, in about 30 s
    python bench/gpu_check.py --help                  # every option

Nothing is downloaded. The steps (the model, each run and the decode in a process of their own), each recorded even
when another fails:

1. model: a randomly initialised Qwen2 of Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads and 2 KV heads,
   intermediate 4864, tied embeddings, rope θ 1e6: 494M parameters) with posttrain's character tokenizer padded to
   Qwen's 151,936 tokens, saved as an ordinary Hugging Face directory.
2. runs: `posttrain run recipe=grpo_math model.path=DIR train.precision=bf16-mixed` for 5 steps of 8 prompts × G 8
   × 128 new tokens, evaluation off, under `train.backend=ddp` and `train.backend=fsdp2` (one process: a process
   group of one). With `model.path` set there is no warm-up; the data is the embedded arithmetic task. A random model
   earns next to no reward, so this measures speed and memory, not learning: the update still runs its forward and
   backward.
3. estimate: `posttrain estimate`'s numbers for the same model, batch, G, lengths, precision and backend, taken from
   `posttrain.apps.estimate.estimate` (gradient checkpointing off, as posttrain trains).
4. decode: posttrain's HF rollout engine (`posttrain/rollout/hf.py`) on the trained precision, 64 sequences × 128
   new tokens, one untimed call first.
5. push: one rollout worker (`rollout.placement=separate`) on the GPU and the trainer beside it, which pushes the
   model's weights 4 times as a run does after each step (the first lays the buckets out), then has it sample once:
   the worker's start-up, the MiB pushed and the median push time of the last 3. With two GPUs or more the weights
   go from GPU 0 to the worker's over NCCL; with one, over gloo from CPU buckets (NCCL cannot pair two processes on
   one GPU); under `--smoke`, to a CPU worker over gloo.

`--out` (default gpu_check.json) gets: the device (name, torch and CUDA versions, `torch.cuda.get_device_properties`);
per backend the run's summary (`backend`, `world_size`, ...), medians over the steps after the first of
`time/rollout`, `time/reward`, `time/score`, `time/update`, `generated_tokens`, `trained_tokens` and `tokens_per_s`
from metrics.jsonl, tokens/s by phase (generated tokens ÷ rollout seconds; response tokens ÷ scoring or update
seconds), the peak memory by phase from summary.json (`memory.cuda_peak_allocated_mb`: torch.cuda.max_memory_allocated
reset at each phase; on CPU `memory.cpu_peak_rss_mb`) and the bytes by role, against the estimate's rows and total;
and the decode tokens/s. A step that fails is recorded with its error under `errors` and makes the exit status 1.

On one H200 it should take 2-4 minutes (not yet measured there); a step still running after `--timeout` (120 s) is
stopped and recorded as failed, so the check ends within 8 minutes. `--smoke` (hidden 64, 2 layers, vocabulary 256,
fp32, 2 steps of 2 prompts × 4 × 8 tokens, 8 × 8 decoded) takes about 30 s on 2 CPU cores.
`--prepare DIR` is `gpu_check.sh`'s wheel folder: see that script.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
BACKENDS = ("ddp", "fsdp2")
PHASES = {"rollout": ("generated_tokens", "time/rollout"), "score": ("trained_tokens", "time/score"),
          "update": ("trained_tokens", "time/update")}  # phase -> (tokens, seconds) in metrics.jsonl
MEDIANS = ("time/rollout", "time/reward", "time/score", "time/update", "time/step", "generated_tokens",
           "trained_tokens", "tokens_per_s")
STATE_ROLES = ("policy_weights", "policy_gradients", "policy_optimizer_state", "reference_weights")
# Declared dependencies that the check never imports (posttrain reads data files and draws plots with them): the
# small wheel set leaves them out, and installs posttrain without them when the GPU machine lacks them.
NOT_AT_RUNTIME = ("datasets", "pyarrow", "matplotlib")
ON_GPU_MACHINE = ("torch", "transformers", "accelerate", "peft")  # installed there; never put in the wheel folder
TORCH_STACK = ("torch", "triton")  # with nvidia-* and cuda-*: left out of the wheel folder in every case


@dataclass(frozen=True)
class Settings:
    """The model's shape and the run's sizes."""

    hidden: int = 896
    layers: int = 24
    heads: int = 14
    kv_heads: int = 2
    intermediate: int = 4864
    vocab: int = 151_936
    max_len: int = 32_768
    precision: str = "bf16-mixed"
    steps: int = 5
    batch: int = 8  # prompts per step
    group: int = 8  # samples per prompt (G)
    max_new_tokens: int = 128
    decode_seqs: int = 64
    decode_tokens: int = 128
    seed: int = 0


SMOKE = Settings(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=256, max_len=512,
                 precision="fp32", steps=2, batch=2, group=4, max_new_tokens=8, decode_seqs=8, decode_tokens=8)


class StepError(Exception):
    """A step that failed, with what it printed last."""


@dataclass
class Record:
    """What the check writes to `--out`; `errors` holds one entry per failed step."""

    mode: str
    settings: dict
    environment: dict = field(default_factory=dict)
    device: dict = field(default_factory=dict)
    model: dict = field(default_factory=dict)
    backends: dict = field(default_factory=dict)
    decode: dict = field(default_factory=dict)
    push: dict = field(default_factory=dict)
    errors: list = field(default_factory=list)

    def step(self, name: str, fn, into: dict):
        """Runs `fn()`, puts its dict result into `into`; a failure is noted there and in `errors`, and is None."""
        t0 = time.perf_counter()
        try:
            into.update(fn())
            into.update(ok=True, seconds=round(time.perf_counter() - t0, 2))
            return into
        except Exception as err:  # any failure is a finding; the other steps still run
            text = str(err) if isinstance(err, StepError) else f"{type(err).__name__}: {err}"
            into.update(ok=False, error=text, seconds=round(time.perf_counter() - t0, 2))
            self.errors.append({"step": name, "error": text})
            print(f"gpu_check: {name} failed: {text.splitlines()[-1] if text else ''}", file=sys.stderr)
            return None


# -- steps run in their own process (`--worker`) ------------------------------------------------------------------
def build_model(path: Path, s: Settings) -> dict:
    """A random Qwen2 of the settings' shape and the character tokenizer, saved to `path`; and the task's prompts'
    lengths."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from posttrain.models.embedded import build_tokenizer

    tok = build_tokenizer(s.vocab)
    config = Qwen2Config(vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate,
                         num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                         tie_word_embeddings=True, rope_theta=1e6, max_position_embeddings=s.max_len,
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(s.seed)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # a GPU initialises 0.5B in a moment
        model = Qwen2ForCausalLM(config)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    lengths = [len(ids) for ids in task_prompts(path, s)]
    return {"path": str(path), "parameters": sum(p.numel() for p in model.parameters()), "vocab": len(tok),
            "config": {k: getattr(config, k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                       "num_key_value_heads", "intermediate_size", "vocab_size",
                                                       "tie_word_embeddings")},
            "prompt_tokens": {"max": max(lengths), "mean": statistics.mean(lengths)}}


def task_prompts(model: Path, s: Settings) -> list[list[int]]:
    """The token ids of the training prompts a run with these settings draws from (the embedded task)."""
    from posttrain import config
    from posttrain.data.rows import prompt_ids
    from posttrain.models.loading import load_tokenizer
    from posttrain.sources import run_splits

    cfg, _ = config.load("grpo_math", run_overrides(model, s))
    return prompt_ids(load_tokenizer(model, "model.path"), run_splits(cfg)[0], cfg.data)


def time_decode(model: Path, s: Settings) -> dict:
    """posttrain's HF decode loop on `decode_seqs` sequences (prompts × G) × `decode_tokens` new tokens, as a run
    samples (the trained weights' dtype, under bf16 autocast in bf16-mixed); one untimed call first."""
    import torch

    from posttrain import rollout
    from posttrain.models.loading import load, stop_token_ids
    from posttrain.schema import RolloutConfig, weights_dtype

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(s.seed)
    policy, tok = load(model, dtype=weights_dtype(s.precision, trained=True))
    policy.to(device)
    engine = rollout.get("hf").start(rollout.Setup(
        policy=policy, model_path=model, pad_id=tok.pad_token_id, stop_ids=stop_token_ids(policy, tok),
        sampling=RolloutConfig(max_new_tokens=s.decode_tokens), precision=s.precision, seed=s.seed,
        max_seqs=s.decode_seqs))
    prompts = task_prompts(model, s)[: max(1, s.decode_seqs // s.group)]
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if s.precision == "bf16-mixed"
                else contextlib.nullcontext())
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with autocast:
        engine.generate(prompts, s.group, max_new_tokens=s.decode_tokens)  # untimed: kernels, allocator, caches
        sync()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        batch = engine.generate(prompts, s.group, max_new_tokens=s.decode_tokens)
        sync()
        seconds = time.perf_counter() - t0
    tokens = float(batch.mask.sum())
    out = {"engine": type(engine).name, "sequences": len(batch), "prompt_tokens": batch.prompt_len,
           "max_new_tokens": s.decode_tokens, "generated_tokens": tokens, "decode_seconds": seconds,
           "tokens_per_s": tokens / seconds, "precision": s.precision, "device": str(device)}
    if device.type == "cuda":
        out["peak_cuda_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def device_info() -> dict:
    """The device the runs use, and the versions of torch and its CUDA."""
    import torch

    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    if not torch.cuda.is_available():
        with contextlib.suppress(OSError):
            cpu = Path("/proc/cpuinfo").read_text()
            info["name"] = next((line.split(":", 1)[1].strip() for line in cpu.splitlines()
                                 if line.startswith("model name")), None)
        return {"name": platform.machine(), **info, "type": "cpu", "threads": torch.get_num_threads()}
    props = torch.cuda.get_device_properties(0)
    fields = {k: getattr(props, k) for k in dir(props) if not k.startswith("_")}
    plain = {k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in fields.items() if not callable(v)}
    return {**info, "type": "cuda", "name": props.name, "count": torch.cuda.device_count(),
            "capability": list(torch.cuda.get_device_capability(0)), "cudnn": torch.backends.cudnn.version(),
            "bf16_supported": torch.cuda.is_bf16_supported(), "properties": plain}


def time_push(model: Path, s: Settings) -> dict:
    """One rollout worker (rollout.placement=separate) on the GPU, started as a run starts it, and the trainer beside
    it pushing the model's weights as a run does after each step: `pushes` numbered versions in 64 MiB buckets, each
    timed to the worker's having every bucket, then one sampling request on the last version. With two GPUs or more the
    trainer's weights sit on GPU 0 and go to the worker's (the last) over NCCL; with one, the worker shares it and they
    go over gloo from CPU buckets, as from a trainer on CPU; with none (--smoke), a CPU worker over gloo."""
    import torch

    from posttrain.models.loading import load, stop_token_ids
    from posttrain.rollout.workers import WorkerPool, WorkerSpec
    from posttrain.schema import RolloutConfig, weights_dtype

    devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    transport = "nccl" if devices >= 2 else "gloo"
    trainer = torch.device("cuda", 0) if devices else torch.device("cpu")
    if devices:
        torch.cuda.set_device(trainer)
    dtype = weights_dtype(s.precision, trained=True)
    policy, tok = load(model, dtype=dtype)
    policy.to(trainer)
    spec = WorkerSpec(engine="hf", model_path=str(model), dtype=str(dtype).removeprefix("torch."), precision=s.precision,
                      lora=None, sampling=RolloutConfig(max_new_tokens=s.max_new_tokens), pad_id=tok.pad_token_id,
                      stop_ids=tuple(stop_token_ids(policy, tok)), seed=s.seed, max_seqs=s.batch * s.group, threads=1,
                      timeout_s=120.0, gpus=1 if devices else 0, transport=transport)
    t0 = time.perf_counter()
    pool = WorkerPool(spec, 1, cpus=None, shared_rng=False, max_restarts=0, bucket_mb=64.0,
                      gpus=[[devices - 1]] if devices else None)
    start_s = time.perf_counter() - t0
    try:
        seconds = []
        for _ in range(4):  # the first lays the buckets out (and copies every weight once more)
            t0 = time.perf_counter()
            pool.load_weights((name, p.detach()) for name, p in policy.named_parameters())  # as a run sends them
            pool.version += 1
            seconds.append(time.perf_counter() - t0)
        prompts = task_prompts(model, s)[: s.batch]
        batch = pool.generate(prompts, s.group, max_new_tokens=s.max_new_tokens)
        report = pool.report()
    finally:
        pool.close()
    mib = report["push_mib"]
    steady = statistics.median(seconds[1:])
    return {"transport": transport, "trainer_device": str(trainer), "worker_device": report["devices"][0],
            "worker_start_s": start_s, "push_mib": mib, "push_seconds": seconds, "push_median_s": steady,
            "mib_per_s": mib / steady, "sampled_rows": len(batch), "sampled_version": int(batch.version.max()),
            "restarts": report["restarts"]}


WORKERS = {"build": build_model, "decode": time_decode, "push": time_push}


# -- the driver -------------------------------------------------------------------------------------------------
def run_overrides(model: Path, s: Settings, backend: str = "ddp", out: Path | None = None) -> list[str]:
    """`posttrain run recipe=grpo_math` overrides of a check run: eval off, one micro-batch per step."""
    return [f"model.path={model}", f"train.backend={backend}", f"train.precision={s.precision}",
            f"train.steps={s.steps}", f"train.batch_size={s.batch}", f"train.micro_batch_size={s.batch * s.group}",
            f"algorithm.group_size={s.group}", f"rollout.max_new_tokens={s.max_new_tokens}", "eval.num_problems=0",
            f"seed={s.seed}", *([f"output_dir={out}"] if out else [])]


def call(cmd: list[str], log: Path, timeout: float, env: dict) -> str:
    """Runs `cmd` in its own process group (killed whole on timeout), its output in `log`; returns its stdout."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=f, text=True, env=env, cwd=log.parent,
                                start_new_session=True)
        try:
            stdout, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise StepError(f"timed out after {timeout:.0f} s: {' '.join(cmd[:4])} ... (log: {log})") from None
        f.write(stdout)
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").strip().splitlines()[-15:])
        raise StepError(f"exit status {proc.returncode}: {' '.join(cmd[:4])} ...\n{tail}")
    return stdout


def worker(name: str, model: Path, s: Settings, log: Path, timeout: float, env: dict) -> dict:
    """`WORKERS[name](model, s)` in a process of its own; its result."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name, str(model), "--settings",
           json.dumps(asdict(s))]
    return json.loads(call(cmd, log, timeout, env).strip().splitlines()[-1])


def medians(metrics: list[dict]) -> tuple[dict, dict, int]:
    """(medians of MEDIANS, tokens/s by phase, steps counted) over the steps after the first (or the only one)."""
    rows = metrics[1:] or metrics
    med = {k: statistics.median(m[k] for m in rows) for k in MEDIANS if all(k in m for m in rows)}
    rates = {phase: statistics.median(m[n] / m[t] for m in rows) for phase, (n, t) in PHASES.items()
             if all(n in m and m.get(t) for m in rows)}
    rates["step"] = med.get("tokens_per_s")
    return med, rates, len(rows)


def train_run(model: Path, s: Settings, backend: str, work: Path, timeout: float, env: dict) -> dict:
    """One `posttrain run`, and what its metrics.jsonl and summary.json say."""
    out = work / f"run-{backend}"
    call([sys.executable, "-m", "posttrain", "run", "recipe=grpo_math", *run_overrides(model, s, backend, out), "-q"],
         work / f"run-{backend}.log", timeout, env)
    summary = json.loads((out / "summary.json").read_text())
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    if summary.get("backend") != backend or summary.get("world_size") != 1:
        raise StepError(f"ran as backend={summary.get('backend')} on {summary.get('world_size')} process(es), "
                        f"not {backend} on 1")
    med, rates, n = medians(metrics)
    mem = summary.get("memory", {})
    source = "cuda_peak_allocated_mb" if "cuda_peak_allocated_mb" in mem else "cpu_peak_rss_mb"
    keys = ("backend", "world_size", "precision", "algorithm", "rollout_engine", "steps", "wall_seconds", "parameters",
            "peak_rss_mb", "peak_cuda_allocated_mb")
    return {"summary": {k: summary.get(k) for k in keys},
            "steps_in_medians": n, "medians": med, "tokens_per_s": rates,
            "memory": {"peak_source": source, "peak_mb_by_phase": mem.get(source, {}),
                       "roles_bytes": mem.get("roles_bytes", {})}}


def compare_estimate(model: Path, s: Settings, backend: str, prompt_len: int, record: dict) -> dict:
    """`posttrain estimate`'s rows for this run, and the run's measured memory set against them."""
    from posttrain import config
    from posttrain.apps import estimate as est

    cfg, _ = config.load("grpo_math", run_overrides(model, s, backend))
    settings = {"gpus": 1, "batch": s.batch, "group": s.group, "prompt_len": prompt_len,
                "response_len": s.max_new_tokens, "grad_ckpt": False, "beta": cfg.algorithm.beta, "rollout": "hf",
                "dtype": {"fp32": "fp32", "fp16-mixed": "fp16"}.get(s.precision, "bf16"), "backend": backend}
    e = est.estimate(est.model_spec(str(model)), "grpo", **settings)
    states = sum(r.gpu_bytes for r in e.rows if r.role not in est.TRANSIENT)
    out = {"settings": settings, "rows_gpu_bytes": {r.role: r.gpu_bytes for r in e.rows},
           "model_states_bytes": states, "total_gpu_bytes": e.gpu_total}
    mem = record.get("memory")
    if mem:  # the run got that far
        measured = sum(mem["roles_bytes"].get(k, 0) for k in STATE_ROLES)
        peak = max(mem["peak_mb_by_phase"].values(), default=0.0) * 2**20
        out["vs_measured"] = {
            "model_states": {"measured_bytes": measured, "estimated_bytes": states, "ratio": measured / states},
            "peak": {"measured_bytes": peak, "measured_from": mem["peak_source"], "estimated_bytes": e.gpu_total,
                     "ratio": peak / e.gpu_total}}
    return out


def summary_lines(rec: Record, out: Path, seconds: float) -> list[str]:
    d, s, m = rec.device, rec.settings, rec.model
    lines = [f"gpu_check ({rec.mode}): {d.get('name', '?')} ({d.get('type', '?')}), torch {d.get('torch', '?')}, "
             f"CUDA {d.get('cuda')}; model {m.get('parameters', 0) / 1e6:.1f}M parameters, {s['precision']}, "
             f"{s['batch']} prompts x G {s['group']} x {s['max_new_tokens']} tokens, {s['steps']} steps",
             f"{'backend':<8}{'tok/s: rollout':>15}{'score':>9}{'update':>9}{'step':>9}   "
             "MiB measured / estimated: model states, peak"]
    for name, b in rec.backends.items():
        if not b.get("ok"):
            lines.append(f"{name:<8}failed: {b.get('error', '').splitlines()[0] if b.get('error') else '?'}")
            continue
        r, cmp = b["tokens_per_s"], b.get("estimate", {}).get("vs_measured", {})
        rates = f"{r.get('rollout') or 0:>15,.0f}" + "".join(f"{r.get(k) or 0:>9,.0f}" for k in ("score", "update",
                                                                                                 "step"))
        mem = ", ".join(f"{c['measured_bytes'] / 2**20:,.0f} / {c['estimated_bytes'] / 2**20:,.0f}"
                        for c in (cmp.get("model_states"), cmp.get("peak")) if c)
        if cmp.get("peak", {}).get("measured_from") == "cpu_peak_rss_mb":
            mem += " (peak: the process's RSS)"
        lines.append(f"{name:<8}{rates}   {mem}")
    if rec.decode.get("ok"):
        x = rec.decode
        lines.append(f"decode (HF loop): {x['sequences']} x {x['max_new_tokens']} tokens: {x['generated_tokens']:.0f} "
                     f"tokens in {x['decode_seconds']:.2f} s = {x['tokens_per_s']:,.0f} tok/s")
    if rec.push.get("ok"):
        x = rec.push
        lines.append(f"weight push to a rollout worker on {x['worker_device']} from {x['trainer_device']} over "
                     f"{x['transport']}: {x['push_mib']:,.1f} MiB in {x['push_median_s']:.3f} s (median of 3 after "
                     f"the first) = {x['mib_per_s']:,.0f} MiB/s; worker started in {x['worker_start_s']:.1f} s")
    verdict = "ok" if not rec.errors else f"{len(rec.errors)} failed: {', '.join(e['step'] for e in rec.errors)}"
    lines.append(f"wrote {out} in {seconds:.0f} s: {verdict}")
    return lines


def check(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    s = SMOKE if args.smoke else Settings()
    s = replace(s, **{k: v for k, v in (("steps", args.steps), ("batch", args.batch_size), ("group", args.group_size),
                                         ("max_new_tokens", args.max_new_tokens)) if v is not None})
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if args.smoke:
        env["CUDA_VISIBLE_DEVICES"] = os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU, even on a GPU machine
        env.setdefault("OMP_NUM_THREADS", "1")  # a tiny model gains nothing from more, and stalls on a busy core
    import importlib.util

    if importlib.util.find_spec("posttrain") is None:  # not installed: the checkout this script sits in
        sys.path.insert(0, str(REPO))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    out = Path(args.out).resolve()
    work = Path(args.workdir).resolve() if args.workdir else Path(tempfile.mkdtemp(prefix="gpu_check-"))
    work.mkdir(parents=True, exist_ok=True)
    env["POSTTRAIN_CACHE"] = str(work / "cache")
    rec = Record(mode="smoke" if args.smoke else "gpu", settings=asdict(s))
    try:
        rec.step("environment", environment, rec.environment)
        rec.step("device", device_info, rec.device)
        if not args.smoke and rec.device.get("type") != "cuda":
            rec.errors.append({"step": "device", "error": "no CUDA device: the GPU check needs one (or --smoke)"})
        else:
            model = work / "model"
            timeout = args.timeout
            rec.step("model", lambda: worker("build", model, s, work / "build.log", timeout, env), rec.model)
            prompt_len = rec.model.get("prompt_tokens", {}).get("max", 0)
            for backend in args.backends.split(","):
                b = rec.backends[backend] = {}
                rec.step(f"run:{backend}", lambda x=backend: train_run(model, s, x, work, timeout, env), b)
                b["estimate"] = {}
                rec.step(f"estimate:{backend}", lambda x=backend, b=b: compare_estimate(model, s, x, prompt_len, b),
                         b["estimate"])
            rec.step("decode", lambda: worker("decode", model, s, work / "decode.log", timeout, env), rec.decode)
            rec.step("push", lambda: worker("push", model, s, work / "push.log", timeout, env), rec.push)
    finally:
        seconds = time.perf_counter() - t_start
        data = {"ok": not rec.errors, "wall_seconds": round(seconds, 1), "workdir": str(work) if args.workdir else None,
                **asdict(rec)}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(data, indent=2) + "\n")
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    print("\n".join(summary_lines(rec, out, seconds)))
    return 0 if not rec.errors else 1


def environment() -> dict:
    """Python, the posttrain that runs (and how it was installed), and the versions of its main dependencies."""
    import importlib.metadata as md

    import posttrain

    versions = {}
    for name in ("posttrain", *ON_GPU_MACHINE, "omegaconf", "math-verify"):
        try:
            versions[name] = md.version(name)
        except md.PackageNotFoundError:
            versions[name] = None
    return {"python": sys.version.split()[0], "executable": sys.executable, "platform": platform.platform(),
            "posttrain_path": str(Path(posttrain.__file__).parent), "versions": versions,
            "installed_by": os.environ.get("GPU_CHECK_INSTALL", "nothing (--no-install)")}


# -- --prepare: the wheel folder ----------------------------------------------------------------------------------
def pip(*args: str, quiet: bool = True) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args, *(["-q"] if quiet else [])], check=True)


def resolve(requirements: list[str], python: str, tmp: Path) -> dict[str, str]:
    """{name: version} of everything `requirements` install on CPython `python` (binary wheels only)."""
    report = tmp / f"report-{python}-{len(list(tmp.iterdir()))}.json"
    pip("install", "--dry-run", "--ignore-installed", "--target", str(tmp / "target"), "--python-version", python,
        "--only-binary=:all:", "--report", str(report), *requirements)
    return {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"]
            for i in json.loads(report.read_text())["install"]}


def torch_stack(name: str) -> bool:
    return name in TORCH_STACK or name.startswith(("nvidia-", "cuda-"))


def requirement_name(req: str) -> str:
    return re.split(r"[\s\[<>=!~;(]", req, maxsplit=1)[0].lower().replace("_", "-")


def prepare(dest: Path, full: bool, pythons: list[str]) -> int:
    """Writes to `dest` the posttrain wheel, the wheels of its dependencies and runtime.txt (see gpu_check.sh)."""
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        src = tmp / "src"  # a copy, so that building leaves no build/ or egg-info in the checkout
        shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".git", ".venv*", "venv", "runs", "build", "dist",
                                                                 "*.egg-info", "__pycache__", ".*_cache"))
        for old in dest.glob("posttrain-*.whl"):
            old.unlink()
        pip("wheel", "--no-deps", "-w", str(dest), str(src))
        wheel = next(dest.glob("posttrain-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
        requires = [line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Requires-Dist:")]
        requires = [r for r in requires if "extra ==" not in r]
        runtime = [r for r in requires if requirement_name(r) not in NOT_AT_RUNTIME]
        (dest / "runtime.txt").write_text("# posttrain's dependencies that the GPU check imports\n"
                                          + "".join(f"{r}\n" for r in runtime))
        (tmp / "r").mkdir()
        for python in pythons:
            pins = resolve([r for r in runtime if requirement_name(r) not in ON_GPU_MACHINE], python, tmp / "r")
            if full:  # everything but torch's own closure, which the GPU machine has with torch
                torch_req = next(r for r in requires if requirement_name(r) == "torch")
                base = resolve([torch_req], python, tmp / "r")
                pins |= {k: v for k, v in resolve([str(wheel)], python, tmp / "r").items() if k not in base}
            pins = sorted(f"{k}=={v}" for k, v in pins.items() if k != "posttrain" and not torch_stack(k))
            pip("download", "--no-deps", "--only-binary=:all:", "--python-version", python, "-d", str(dest), *pins)
    size = sum(p.stat().st_size for p in dest.iterdir() if p.is_file())
    print(f"gpu_check: {len(list(dest.glob('*.whl')))} wheels in {dest}, {size / 2**20:.1f} MiB "
          f"({'with' if full else 'without'} {', '.join(NOT_AT_RUNTIME)} and transformers/accelerate/peft; "
          f"CPython {', '.join(pythons)})")
    return 0


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "),
                                epilog="Usually run through bench/gpu_check.sh, which installs posttrain first.")
    p.add_argument("--out", default="gpu_check.json", help="the JSON record (default: gpu_check.json)")
    p.add_argument("--smoke", action="store_true", help="CPU, a tiny model and tiny settings (about 30 s)")
    p.add_argument("--no-install", action="store_true", help="use the posttrain installed here (gpu_check.sh)")
    p.add_argument("--workdir", help="keep the model, runs and logs there (default: a temporary folder, removed)")
    p.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated (default: ddp,fsdp2)")
    p.add_argument("--steps", type=int, help="GRPO steps per backend (default: 5; smoke 2)")
    p.add_argument("--batch-size", type=int, help="prompts per step (default: 8; smoke 2)")
    p.add_argument("--group-size", type=int, help="samples per prompt, G (default: 8; smoke 4)")
    p.add_argument("--max-new-tokens", type=int, help="rollout tokens per sample (default: 128; smoke 8)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds each step may take (default: 120)")
    p.add_argument("--prepare", metavar="DIR", help="write the wheel folder to DIR instead of checking")
    p.add_argument("--full", action="store_true", help="with --prepare: every dependency but torch's own")
    p.add_argument("--pythons", default="3.10,3.11,3.12,3.13",
                   help="with --prepare: CPython versions to fetch wheels for (default: 3.10,3.11,3.12,3.13)")
    p.add_argument("--worker", nargs=2, metavar=("STEP", "MODEL_DIR"), help=argparse.SUPPRESS)
    p.add_argument("--settings", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        name, model = args.worker
        print(json.dumps(WORKERS[name](Path(model).resolve(), Settings(**json.loads(args.settings)))))
        return 0
    if args.prepare:
        return prepare(Path(args.prepare).resolve(), args.full, args.pythons.split(","))
    return check(args)


if __name__ == "__main__":
    sys.exit(main())
