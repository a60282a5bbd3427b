"""`run`: a whole training run, from a validated config to a finished run directory.

It sets the run up (backend, seed, engine) and calls its parts: the engine for each step, the tracker for
metrics.jsonl and the progress bar, the evaluation schedule, and the checkpoints. The run works in
`<output_dir>.partial` and moves into place only when it has finished (`RunDir`).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from accelerate.utils import set_seed

from posttrain import backends
from posttrain.config import algorithm_of
from posttrain.core.errors import ConfigError
from posttrain.core.heap import limit_malloc_arenas
from posttrain.schema import RunConfig
from posttrain.sources import run_splits
from posttrain.train.checkpoint import Checkpoints
from posttrain.train.engine import Engine
from posttrain.train.evaluation import Schedule
from posttrain.train.rundir import RunDir, write_json
from posttrain.train.tracking import Tracker


def run(cfg: RunConfig, resolved: dict, *, model_path: str | Path | None = None,
        splits: tuple[list[dict], list[dict]] | None = None, summary: dict | None = None,
        quiet: bool = False) -> dict | None:
    """Trains as `cfg` says and writes the run directory.

    Args:
        cfg, resolved: the validated config, and its resolved tree (written as config.yaml).
        model_path: the starting policy; None: `cfg.model.path`.
        splits: (training rows, held-out rows) already loaded; None loads them.
        summary: entries to start summary.json with (the warm-up that made the model, say).

    Returns:
        The summary on the main process, None on the others.
    """
    t_start = time.perf_counter()
    limit_malloc_arenas()  # a no-op when already set; for runs started from Python rather than the CLI
    run_dir = RunDir(cfg.output_dir, cfg.overwrite)  # refuse a non-empty output_dir before any work
    model_path = model_path or cfg.model.path
    if model_path is None:
        raise ConfigError("model.path: null; give a model directory (`posttrain run` warms up the embedded one)")
    backend = backends.get(cfg.train.backend)(precision=cfg.train.precision, offload=cfg.train.offload)
    main = backend.is_main
    summary = {"algorithm": algorithm_of(cfg).name, **(summary or {}), "world_size": backend.world_size,
               "backend": backend.name}
    splits = splits or run_splits(cfg)  # bad data fails here, before any training
    set_seed(cfg.seed)
    engine = Engine(cfg, model_path, backend, splits)
    summary["rollout_engine"] = engine.rollout.name  # the engine that really started
    summary["weight_sync"] = engine.weight_sync  # none (colocated), full, or merged (LoRA)
    summary["parameters"] = engine.parameters  # trained and total: under LoRA, the adapters against the whole
    out = run_dir.create() if main else run_dir.path
    if main:
        import yaml

        (out / "config.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False, allow_unicode=True))
        if not quiet:
            print(f"posttrain: {summary['algorithm']} run writing to {out} (moved to {run_dir.final} when done)",
                  file=sys.stderr)
    backend.barrier()
    steps, schedule, checkpoints = cfg.train.steps, Schedule(cfg.eval, cfg.train.steps), Checkpoints(out,
                                                                                                   cfg.train.save_every)
    if schedule.on:
        summary["eval_before"] = engine.evaluate()
    with Tracker(out / "metrics.jsonl" if main else None, steps, show=not quiet) as tracker:
        for step in range(1, steps + 1):
            metrics = {"step": step, **engine.step()}
            if schedule.in_loop(step):
                summary["eval_after"] = engine.evaluate()  # the last one is the final evaluation
                metrics["eval_accuracy"] = summary["eval_after"]["accuracy"]
            metrics["wall_seconds"] = time.perf_counter() - t_start
            tracker.log(metrics)
            checkpoints.after_step(engine, step)
            backend.barrier()
    if schedule.after_loop:
        summary["eval_after"] = engine.evaluate()
    checkpoints.final(engine)
    summary.update(steps=steps, wall_seconds=time.perf_counter() - t_start, **engine.phases.run_peak(),
                   memory={"roles_bytes": engine.roles.peak, **engine.phases.summary()},
                   output_dir=str(run_dir.final))
    if main:
        write_json(out / "summary.json", summary)
        run_dir.commit()
    backend.barrier()
    return summary if main else None
