"""The SFT warm-up of the embedded tiny model, run once and cached.

RL needs a policy that sometimes succeeds. With no model given, posttrain builds the tiny Llama of
`posttrain.models.embedded`, trains it with SFT on the embedded task for `warmup.steps` steps, and keeps the result under
the cache directory, keyed by everything that shapes it (the run's `seed` among them: another seed, another warm-up);
every recipe with that seed then starts from the same weights.

On the arithmetic task the warm-up imitates a teacher that slips on the steps whose result is not one digit
(`posttrain.data.embedded.taught`), and it trains until it has converged on that teacher, its learning rate decaying to
0: the warmed-up model is weak because of what it was taught, not because it was stopped part way, so its held-out
accuracy is the same whatever threads, precision or CPU class computed it (docs/embedded.md has the figures), and the
comparisons of methods that start from it measure the methods rather than the rounding.

A warm-up writes `warmup-<key>.partial` and holds an exclusive lock on `warmup-<key>.lock` while it does (`flock`):
a second process with the same key waits for it and then finds the model cached, and a `.partial` whose lock nobody
holds was left by a warm-up that was interrupted, and is removed at the next start (`clean_stale`), once it is known to
be a run directory posttrain wrote.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

from posttrain.algorithms.sft import SFTConfig
from posttrain.config import run_device
from posttrain.core import precision
from posttrain.core.errors import ConfigError, TrainingError, UserError
from posttrain.core.launch import forget_launcher, launched
from posttrain.data.embedded import taught
from posttrain.models.embedded import build_model_dir
from posttrain.schema import DataConfig, EvalConfig, ModelConfig, RunConfig, TrainConfig, WarmupConfig, cache_root
from posttrain.sources import run_splits
from posttrain.train import run
from posttrain.train.rundir import removable

try:
    import fcntl
except ImportError:  # Windows: no flock; warm-ups are not locked there, and nothing is cleaned
    fcntl = None

VERSION = 2  # bump when the embedded model or task changes, so stale caches are not reused
PARTIAL = re.compile(r"warmup-([0-9a-f]{12})\.partial")
DESCRIPTION = "SFT warm-up of the embedded tiny model"  # its config.yaml says so (older_warmup reads it)


def warmup_config(cfg: RunConfig, init_dir: Path, out_dir: Path) -> RunConfig:
    """The SFT run that warms the tiny model up: the embedded task of `cfg` (its reasoning-gym task, if it trains on
    one), the warm-up's own settings, `cfg`'s seed."""
    w, d = cfg.warmup, cfg.data
    gym = d.gym_task is not None
    task = DataConfig(preset=d.preset if gym else None, task_options=d.task_options, template=d.template, task=d.task,
                      difficulty=d.difficulty, max_operand=d.max_operand, train_size=d.train_size,
                      test_size=d.test_size, seed=d.seed)
    return RunConfig(
        description=DESCRIPTION, output_dir=str(out_dir), overwrite=True, seed=cfg.seed,
        model=ModelConfig(path=str(init_dir)), data=task, algorithm=SFTConfig(),
        train=TrainConfig(steps=w.steps, batch_size=w.batch_size, micro_batch_size=w.batch_size, lr=w.lr,
                          warmup_steps=w.steps // 10, lr_schedule="cosine", loss_agg="token_mean",
                          precision=w.precision, threads=cfg.train.threads),
        eval=EvalConfig(num_problems=0),
    )


def ensure(cfg: RunConfig, quiet: bool = False) -> tuple[Path, dict]:
    """The warmed-up model directory for `cfg`, trained now if it is not cached. Returns (path, info)."""
    w, d = cfg.warmup, cfg.data
    warm = {k: v for k, v in dataclasses.asdict(w).items() if k != "cache_dir"}
    # keyed by the precision that runs: `auto` warms up in bf16 on one machine and in fp32 on another
    warm["precision"] = precision.resolve(w.precision, run_device()).precision
    key_fields = {"version": VERSION, "warmup": warm, "seed": cfg.seed,
                  "task": [d.template, d.difficulty, d.max_operand, d.train_size, d.test_size, d.seed]}
    if d.task != "arithmetic":  # the arithmetic task's keys are those from before there were others
        key_fields["task"].append(d.task)
    if d.gym_task is not None:  # its rows are what that release of reasoning-gym generates
        key_fields["task"].append([d.preset, d.task_options, importlib.metadata.version("reasoning-gym")])
    key = hashlib.sha256(json.dumps(key_fields, sort_keys=True).encode()).hexdigest()[:12]
    root = cache_root(cfg)
    out = root / f"warmup-{key}"
    clean_stale(root)
    cached = (out / "model", {"cached": True, "path": str(out / "model")})
    if (out / "model" / "config.json").is_file():
        return cached
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = _lock(root / f"warmup-{key}.lock", wait=False)
        if lock is None:
            if not quiet:
                print(f"posttrain: waiting for another process's warm-up of the same model ({out})", file=sys.stderr)
            lock = _lock(root / f"warmup-{key}.lock", wait=True)
    except OSError as err:
        raise ConfigError(f"warmup.cache_dir: cannot write the warm-up cache '{root}' ({err.strerror or err}); set "
                          "warmup.cache_dir or $POSTTRAIN_CACHE to a writable directory") from None
    with lock:
        if (out / "model" / "config.json").is_file():  # the other process's, finished while this one waited
            return cached
        if not quiet:
            print(f"posttrain: warming up the embedded tiny model with {w.steps} SFT steps (cached in {out})",
                  file=sys.stderr)
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            init = build_model_dir(Path(tmp) / "init", hidden=w.hidden, layers=w.layers, seed=cfg.seed)
            warm_cfg = warmup_config(cfg, init, out)
            # one of several training processes (torchrun): the warm-up is one process's run, in a process that
            # does not join the others (they wait on the lock meanwhile)
            (alone if launched() else run)(warm_cfg, {"warmup": key_fields}, splits=warmup_splits(warm_cfg, w),
                                           quiet=quiet)
    return out / "model", {"cached": False, "path": str(out / "model"), "seconds": time.perf_counter() - t0}


def needs_teacher(cfg: RunConfig) -> bool:
    """Whether the run's method learns from a teacher's log-probs (on-policy distillation)."""
    from posttrain.config import algorithm_of

    return "teacher_logp" in algorithm_of(cfg).needs(cfg.algorithm)


def teacher(cfg: RunConfig) -> Path | None:
    """`model.teacher_path` where the method has a teacher, checked to be a model directory before any work (a warm-up
    included); None where it has none, or where the embedded default builds its own (`ensure_teacher`). A real
    policy (`model.path`) without a teacher is refused: there is no embedded teacher for its tokens."""
    from posttrain.models.loading import model_dir

    if not needs_teacher(cfg):
        return None
    if cfg.model.teacher_path is None:
        if cfg.model.path is not None:
            raise ConfigError("model.teacher_path: distillation learns from a teacher's log-probs; give a local "
                              "checkpoint whose tokenizer is the policy's (only the embedded default builds its own)")
        return None
    return model_dir(cfg.model.teacher_path, "model.teacher_path")


def ensure_teacher(cfg: RunConfig, quiet: bool = False) -> tuple[Path, dict]:
    """The embedded teacher of on-policy distillation, trained now if it is not cached: the warm-up of `cfg` with a
    teacher that never slips (`warmup.teacher_accuracy=1`), so a model of the same size and tokenizer that has learnt
    the task as the warm-up would have learnt it from worked solutions without slips. Cached like the warm-up, under
    its own key. Returns (path, info)."""
    taught_well = dataclasses.replace(cfg, warmup=dataclasses.replace(cfg.warmup, teacher_accuracy=1.0))
    if not quiet:
        print("posttrain: the distillation teacher is the embedded model warmed up on worked solutions that never slip",
              file=sys.stderr)
    return ensure(taught_well, quiet=quiet)


def warmup_splits(warm_cfg: RunConfig, w: WarmupConfig) -> tuple[list[dict], list[dict]]:
    """The warm-up's (training, held-out) rows: on the arithmetic task with `teacher_accuracy` < 1, the teacher's
    worked solutions of each training question (`posttrain.data.embedded.taught`); else the task's rows as they are."""
    train, test = run_splits(warm_cfg)
    d = warm_cfg.data
    if d.preset == "embedded" and d.task == "arithmetic" and w.teacher_accuracy < 1:
        train = taught(train, w.teacher_accuracy, w.demonstrations, warm_cfg.seed)
    return train, test


def alone(cfg: RunConfig, resolved: dict, splits=None, quiet: bool = False) -> None:
    """`run` in a process of its own that has forgotten the launcher's variables: a training process started by
    torchrun warms the model up without the other processes, which would otherwise be waited for."""
    import multiprocessing

    process = multiprocessing.get_context("spawn").Process(target=_run_alone, args=(cfg, resolved, splits, quiet),
                                                           name="posttrain-warmup")
    process.start()
    process.join()
    if process.exitcode != 0:
        raise TrainingError(f"the warm-up of the embedded model failed (exit code {process.exitcode}; the line "
                            "above says why)")


def _run_alone(cfg: RunConfig, resolved: dict, splits, quiet: bool) -> None:
    forget_launcher()
    try:
        run(cfg, resolved, splits=splits, quiet=quiet)
    except UserError as err:  # one line, as the command itself prints it
        print(f"posttrain: error: {err}", file=sys.stderr)
        sys.exit(2)


def clean_stale(root: Path) -> list[Path]:
    """Removes the `warmup-<key>.partial` directories that interrupted warm-ups left in the cache `root`; returns them.

    A warm-up holds the lock on `warmup-<key>.lock` while it writes its `.partial`, so a `.partial` whose lock can be
    taken has no writer left: the kernel drops a lock when its process ends, killed or not. A lock rather than a pid
    in the name (pids are reused, and mean nothing to another container or machine sharing the cache) or an age (a
    slow warm-up outlasts any limit, and a directory's time does not change while files deeper in it are written).
    A `.partial` that is not a run directory posttrain wrote (`removable`) stays, whatever its name.
    """
    removed = []
    for partial in sorted(root.glob("warmup-*.partial")) if fcntl is not None and root.is_dir() else ():
        if not (match := PARTIAL.fullmatch(partial.name)) or not (removable(partial) or older_warmup(partial)):
            continue  # not a warm-up's run directory (`posttrain.train.rundir.removable`): not posttrain's to remove
        try:
            lock = _lock(root / f"warmup-{match[1]}.lock", wait=False)
        except OSError:  # a cache this process cannot write: leave it as it is
            continue
        if lock is None:  # being written now
            continue
        with lock:
            shutil.rmtree(partial, ignore_errors=True)
        removed.append(partial)
    return removed


def older_warmup(partial: Path) -> bool:
    """Whether `partial`, in the cache, is a warm-up's run directory written before run directories were marked
    (`posttrain.train.rundir.ours`): its config.yaml is a warm-up's. Left alone, it would stop every warm-up of its
    key, whose own run directory may replace only what posttrain wrote."""
    try:
        text = (partial / "config.yaml").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False
    return f"description: {DESCRIPTION}\n" in text


def _lock(path: Path, wait: bool):
    """`path` opened and locked exclusively (`flock`: released when the file is closed or its process ends), or None
    when `wait` is false and the lock is not this process's: another holds it, or the filesystem has no locks (some
    network ones), where waiting gets the file unlocked, as it is without fcntl."""
    f = open(path, "a")
    if fcntl is None:
        return f
    try:
        fcntl.flock(f, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except OSError:  # BlockingIOError: held by another process; others: no locks here
        if wait:
            return f
        f.close()
        return None
    return f
