"""`run`: a whole training run, from a validated config to a finished run directory.

It sets the run up (backend, seed, engine) and calls its parts: the engine for each step, the tracker for
metrics.jsonl and the progress bar, the evaluation schedule, and the checkpoints. The run works in
`<output_dir>.partial` and moves into place only when it has finished (`RunDir`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

from accelerate.utils import set_seed

from posttrain import backends
from posttrain.config import algorithm_of, run_device, settle_precision
from posttrain.core import precision
from posttrain.core.errors import ConfigError, TrainingError
from posttrain.core.heap import limit_malloc_arenas
from posttrain.core.threads import ThreadFit
from posttrain.data.lengths import long_prompts
from posttrain.rollout.base import Workers
from posttrain.schema import RunConfig
from posttrain.sources import run_splits
from posttrain.train import checkpoint as checkpoints
from posttrain.train.build import build
from posttrain.train.checkpoint import Checkpoints
from posttrain.train.evaluation import Schedule
from posttrain.train.plan import Machine, plan
from posttrain.train.rundir import RunDir, write_json
from posttrain.train.tracking import Tracker


def run(cfg: RunConfig, resolved: dict, *, model_path: str | Path | None = None,
        splits: tuple[list[dict], list[dict]] | None = None, summary: dict | None = None,
        quiet: bool = False, teacher_path: str | Path | None = None) -> dict | None:
    """Trains as `cfg` says and writes the run directory.

    Args:
        cfg, resolved: the validated config, and its resolved tree (written as config.yaml).
        model_path: the starting policy; None: `cfg.model.path`.
        splits: (training rows, held-out rows) already loaded; None loads them.
        summary: entries to start summary.json with (the warm-up that made the model, say).
        teacher_path: the distillation teacher, where the method has one; None: `cfg.model.teacher_path`.

    Returns:
        The summary on the main process, None on the others.
    """
    t_start = time.perf_counter()
    limit_malloc_arenas()  # a no-op when already set; for runs started from Python rather than the CLI
    run_dir = RunDir(cfg.output_dir, cfg.overwrite, cfg.resume)  # refuse a non-empty output_dir before any work
    model_path = model_path or cfg.model.path
    if model_path is None:
        raise ConfigError("model.path: null; give a model directory (`posttrain run` warms up the embedded one)")
    requested = cfg.train.precision
    cfg, chose = settle_precision(cfg)  # `auto` resolved for this device; config.yaml keeps what was asked
    machine = Machine.here(cfg, chose)
    run_plan = plan(cfg, machine)  # how the run is assembled, decided once
    threads = ThreadFit(run_plan.threads)  # before any model is built: torch's pool has the size it will use
    backend = backends.get(cfg.train.backend)(precision=cfg.train.precision, offload=cfg.train.offload)
    if backend.world_size != run_plan.world_size:  # a launcher that does not set WORLD_SIZE: the processes it made
        run_plan = plan(cfg, dataclasses.replace(machine, world_size=backend.world_size))
    checkpoint, skipped = checkpoints.find(cfg.resume, run_dir.path, cfg.overwrite)
    state = checkpoints.check(checkpoint, model_path, resolved, backend.world_size) if checkpoint else None
    main = backend.is_main
    for notice in skipped if main else ():  # damaged newer checkpoints, passed over for the newest that verifies
        print(f"posttrain: notice: {notice}", file=sys.stderr)
    summary = {"algorithm": algorithm_of(cfg).name, **(summary or {}), "world_size": backend.world_size,
               "backend": backend.name, "precision": cfg.train.precision, "precision_requested": requested,
               "threads": threads.threads}
    splits = splits or run_splits(cfg)  # bad data fails here, before any training
    set_seed(cfg.seed)
    engine = build(cfg, model_path, backend, splits, run_plan, teacher_path=teacher_path or cfg.model.teacher_path)
    try:
        summary["plan"] = run_plan.to_dict()  # what `posttrain explain` prints for this config, on this machine
        summary["rollout_engine"] = engine.rollout.name  # the engine that really started
        summary["weight_sync"] = run_plan.rollout.weight_sync  # none (colocated), full, merged (LoRA) or adapter
        summary["placement"] = run_plan.rollout.placement
        summary["reference_on"] = run_plan.reference_on  # trainer, workers, or None where the method has none
        summary["packed"] = engine.packed  # train.packing as it runs (false where the model cannot confine attention)
        summary["parameters"] = engine.parameters  # trained and total: under LoRA, the adapters against the whole
        if cfg.model.lora.r:  # what model/, an adapter, needs to load: its base (README, "LoRA")
            summary["adapter_base"] = {"path": str(Path(model_path).resolve()),
                                       "copy": checkpoints.BASE_COPY if cfg.model.path is None else None}
        start, elapsed = 0, 0.0  # steps done and seconds spent before this process started (a resumed run)
        if checkpoint is not None:
            start, elapsed = state["step"], state["wall_seconds"]
            engine.resume_at(start, tuple(state["skipped"]))  # first: the rollout engine's version is the steps done
            checkpoints.restore(checkpoint, engine)
            summary.update(state["evaluations"], resumed_from={"checkpoint": str(checkpoint), "step": start})
        backend.barrier()
        out = (run_dir.reopen(resolved) if checkpoint is not None else run_dir.create(resolved)) if main \
            else run_dir.path
        if main:
            if checkpoint is not None:
                keep_metrics_until(out / "metrics.jsonl", start)
            if requested == "auto" and not quiet:  # once the models have loaded: bad input stays one line
                print(f"posttrain: train.precision=auto runs {chose.precision}: {chose.reason}", file=sys.stderr)
            elif requested != "auto" and (warning := precision.emulation_warning(cfg.train.precision, run_device())):
                print(f"posttrain: warning: {warning}", file=sys.stderr)
            if warning := long_prompts(engine.tokenizer, *splits, cfg):  # once, over the data, not in the loop
                print(f"posttrain: warning: {warning}", file=sys.stderr)
            if cfg.train.packing and not engine.packed:
                print(f"posttrain: notice: train.packing: {engine.model_type} attention cannot be kept inside each of "
                      "several sequences in one row here; micro-batches run padded", file=sys.stderr)
            if not quiet:
                which = f"resuming from step {start} ({checkpoint}) of the {summary['algorithm']} run" \
                    if checkpoint is not None else f"{summary['algorithm']} run from the start"  # resume=auto says which
                print(f"posttrain: {which}, writing to {out} (moved to {run_dir.final} when done)", file=sys.stderr)
        samples = out / ("samples.jsonl" if main else f"samples.rank{backend.rank}.jsonl")
        if cfg.train.log_samples and checkpoint is not None:
            keep_metrics_until(samples, start)  # the lines of steps after the checkpoint are logged again
        backend.barrier()
        t = cfg.train
        steps, schedule, saver = t.steps, Schedule(cfg.eval, t.steps), Checkpoints(out, t.save_every, t.keep_checkpoints)
        stopper, done, stopped_at = engine.controllers.early_stop, start, None  # restored with the checkpoint
        if stopper.checkpoint:
            saver.protected = out / "checkpoints" / stopper.checkpoint
        if schedule.on and checkpoint is None:
            summary["eval_before"] = engine.evaluate()
        with Tracker(out / "metrics.jsonl" if main else None, steps, show=not quiet, start=start, report_to=cfg.trackers,
                     config=resolved, name=run_dir.final.name) as tracker:
            for step in range(start + 1, steps + 1):
                metrics = {"step": step, **engine.step()}
                metrics["threads"] = threads.threads  # the step's; the next one's are fitted to the load seen in it
                threads.update()
                stopper.track(metrics)
                best = False
                if schedule.in_loop(step):
                    summary["eval_after"] = engine.evaluate()  # the last one is the final evaluation
                    metrics["eval_accuracy"] = summary["eval_after"]["accuracy"]
                    best = stopper.on and stopper.judge(step, summary["eval_after"])
                metrics["wall_seconds"] = elapsed + time.perf_counter() - t_start
                tracker.log(metrics)
                if engine.samples:
                    with samples.open("a") as f:
                        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in engine.samples)
                done = step
                checkpoints.crash_point("step", step)  # fault injection: logged, not yet saved
                run_state = {"wall_seconds": metrics["wall_seconds"], "model_path": str(Path(model_path).resolve()),
                             "evaluations": {k: summary[k] for k in ("eval_before", "eval_after") if k in summary},
                             "skipped": [engine.skipped_steps, engine.skipped_in_a_row], "config": resolved}
                if best:  # where the best checkpoint is, as it will be once this step's is written
                    stopper.checkpoint = saver.path(step).name
                if t.max_skipped_steps and engine.skipped_in_a_row >= t.max_skipped_steps:
                    saved = saver.write(engine, step, run_state)
                    raise TrainingError(f"train.max_skipped_steps: {engine.skipped_in_a_row} steps in a row had a "
                                        f"non-finite loss or gradient norm and were skipped; stopped at step {step} "
                                        f"(checkpoint: {saved})")
                if best:  # the checkpoint a run that stops early rolls back to, kept whatever keep_checkpoints says
                    saver.protected = saver.write(engine, step, run_state)
                elif saver.due(step):
                    saver.write(engine, step, run_state)
                backend.barrier()
                if stopper.stop:
                    stopped_at = step
                    break
        if schedule.after_loop:
            summary["eval_after"] = engine.evaluate()
        if stopper.on:
            summary["early_stop"] = stopper.summary(stopped_at)
            if stopper.best_step is not None and stopper.best_step != done:  # roll back to the best evaluation's model
                engine.load_training_state(saver.protected / checkpoints.TRAINING_STATE)
                summary["eval_after"] = stopper.best_evaluation
        saver.final(engine)
        if isinstance(engine.rollout, Workers):  # the workers that really ran, and how often one was restarted
            summary["rollout_workers"] = {**engine.rollout.report(), "max_staleness": cfg.rollout.max_staleness}
        summary.update(steps=done, wall_seconds=elapsed + time.perf_counter() - t_start, **engine.phases.run_peak(),
                       memory={"roles_bytes": engine.roles.peak, **engine.phases.summary()},
                       output_dir=str(run_dir.final))
        if main:
            write_json(out / "summary.json", summary)
            run_dir.commit()
        backend.barrier()
        return summary if main else None
    finally:
        engine.close()  # rollout workers and the producer, when there are any


def keep_metrics_until(path: Path, step: int) -> None:
    """Drops the lines of metrics.jsonl (or samples.jsonl) after `step` (logged after the checkpoint a run resumes
    from), so the resumed run's lines follow without a gap or a repeat. Written whole, then renamed."""
    if not path.is_file():
        return
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    kept = [line for line in lines if json.loads(line)["step"] <= step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)
