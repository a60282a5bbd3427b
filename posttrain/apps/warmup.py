"""The SFT warm-up of the embedded tiny model, run once and cached.

RL needs a policy that sometimes succeeds. With no model given, posttrain builds the tiny Llama of
`posttrain.models.embedded`, trains it with SFT on the embedded task for `warmup.steps` steps, and keeps the result under
the cache directory, keyed by everything that shapes it; every recipe then starts from the same weights.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path

from posttrain.algorithms.sft import SFTConfig
from posttrain.config import run_device
from posttrain.core import precision
from posttrain.models.embedded import build_model_dir
from posttrain.schema import DataConfig, EvalConfig, ModelConfig, RunConfig, TrainConfig, cache_root
from posttrain.train import run

VERSION = 1  # bump when the embedded model or task changes, so stale caches are not reused


def warmup_config(cfg: RunConfig, init_dir: Path, out_dir: Path) -> RunConfig:
    """The SFT run that warms the tiny model up: the embedded task of `cfg`, the warm-up's own settings."""
    w, d = cfg.warmup, cfg.data
    task = DataConfig(template=d.template, difficulty=d.difficulty, max_operand=d.max_operand, train_size=d.train_size,
                      test_size=d.test_size, seed=d.seed)
    return RunConfig(
        description="SFT warm-up of the embedded tiny model", output_dir=str(out_dir), overwrite=True, seed=0,
        model=ModelConfig(path=str(init_dir)), data=task, algorithm=SFTConfig(),
        train=TrainConfig(steps=w.steps, batch_size=w.batch_size, micro_batch_size=w.batch_size, lr=w.lr,
                          warmup_steps=w.steps // 10, loss_agg="token_mean", precision=w.precision),
        eval=EvalConfig(num_problems=0),
    )


def ensure(cfg: RunConfig, quiet: bool = False) -> tuple[Path, dict]:
    """The warmed-up model directory for `cfg`, trained now if it is not cached. Returns (path, info)."""
    w, d = cfg.warmup, cfg.data
    warm = {k: v for k, v in dataclasses.asdict(w).items() if k != "cache_dir"}
    # keyed by the precision that runs: `auto` warms up in bf16 on one machine and in fp32 on another
    warm["precision"] = precision.resolve(w.precision, run_device()).precision
    key_fields = {"version": VERSION, "warmup": warm,
                  "task": [d.template, d.difficulty, d.max_operand, d.train_size, d.test_size, d.seed]}
    key = hashlib.sha256(json.dumps(key_fields, sort_keys=True).encode()).hexdigest()[:12]
    out = cache_root(cfg) / f"warmup-{key}"
    if (out / "model" / "config.json").is_file():
        return out / "model", {"cached": True, "path": str(out / "model")}
    if not quiet:
        print(f"posttrain: warming up the embedded tiny model with {w.steps} SFT steps (cached in {out})",
              file=sys.stderr)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        init = build_model_dir(Path(tmp) / "init", hidden=w.hidden, layers=w.layers, seed=0)
        run(warmup_config(cfg, init, out), {"warmup": key_fields}, quiet=quiet)
    return out / "model", {"cached": False, "path": str(out / "model"), "seconds": time.perf_counter() - t0}
