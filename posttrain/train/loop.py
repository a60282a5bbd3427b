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
        quiet: bool = False, teacher_path: str | Path | None = None, rewards: dict | None = None) -> dict | None:
    """Trains as `cfg` says and writes the run directory: a `Training`, stepped to its end.

    Args:
        cfg, resolved: the validated config, and its resolved tree (written as config.yaml).
        model_path: the starting policy; None: `cfg.model.path`.
        splits: (training rows, held-out rows) already loaded; None loads them.
        summary: entries to start summary.json with (the warm-up that made the model, say).
        teacher_path: the distillation teacher, where the method has one; None: `cfg.model.teacher_path`.
        rewards: Python reward functions by name, with their weights (posttrain.judge.Judge's `functions`).

    Returns:
        The summary on the main process, None on the others.
    """
    with Training(cfg, resolved, model_path=model_path, splits=splits, summary=summary, quiet=quiet,
                  teacher_path=teacher_path, rewards=rewards) as training:
        while not training.done:
            training.step()
        return training.finish()


class Training:
    """A run, one step at a time: made, it has set the run up (backend, seed, engine, the run directory in
    `<output_dir>.partial`, the evaluation before); each `step` trains, logs, evaluates and checkpoints as the schedule
    says; `finish` evaluates after, saves the model, writes summary.json and moves the run directory into place.
    `close` (or leaving the `with` block) releases the rollout workers, the producer and the trackers, finished or not;
    a run closed before `finish` stays in `<output_dir>.partial`, its checkpoints there for `resume=auto`.

    Arguments as `run`'s.
    """

    def __init__(self, cfg: RunConfig, resolved: dict, *, model_path: str | Path | None = None,
                 splits: tuple[list[dict], list[dict]] | None = None, summary: dict | None = None,
                 quiet: bool = False, teacher_path: str | Path | None = None, rewards: dict | None = None):
        self.t_start = time.perf_counter()
        limit_malloc_arenas()  # a no-op when already set; for runs started from Python rather than the CLI
        self.run_dir = run_dir = RunDir(cfg.output_dir, cfg.overwrite, cfg.resume)  # a non-empty output_dir: refused
        model_path = model_path or cfg.model.path
        if model_path is None:
            raise ConfigError("model.path: null; give a model directory (`posttrain run` warms up the embedded one)")
        self.model_path, self.resolved, self.quiet = model_path, resolved, quiet
        requested = cfg.train.precision
        cfg, chose = settle_precision(cfg)  # `auto` resolved for this device; config.yaml keeps what was asked
        self.cfg = cfg
        machine = Machine.here(cfg, chose)
        run_plan = plan(cfg, machine)  # how the run is assembled, decided once
        self.threads = threads = ThreadFit(run_plan.threads)  # before any model is built: torch's pool has its size
        self.backend = backend = backends.get(cfg.train.backend)(precision=cfg.train.precision,
                                                                 offload=cfg.train.offload)
        if backend.world_size != run_plan.world_size:  # a launcher that does not set WORLD_SIZE: the processes it made
            run_plan = plan(cfg, dataclasses.replace(machine, world_size=backend.world_size))
        checkpoint, skipped = checkpoints.find(cfg.resume, run_dir.path, cfg.overwrite)
        state = checkpoints.check(checkpoint, model_path, resolved, backend.world_size) if checkpoint else None
        self.main = main = backend.is_main
        for notice in skipped if main else ():  # damaged newer checkpoints, passed over for the newest that verifies
            print(f"posttrain: notice: {notice}", file=sys.stderr)
        self.summary = summary = {
            "algorithm": algorithm_of(cfg).name, **(summary or {}), "world_size": backend.world_size,
            "backend": backend.name, "precision": cfg.train.precision, "precision_requested": requested,
            "threads": threads.threads}
        splits = splits or run_splits(cfg)  # bad data fails here, before any training
        set_seed(cfg.seed)
        self.engine = build(cfg, model_path, backend, splits, run_plan,
                            teacher_path=teacher_path or cfg.model.teacher_path, rewards=rewards)
        self.tracker = None
        try:
            self._start(run_plan, checkpoint, state, requested, chose, splits)
        except BaseException:
            self.close()
            raise

    def _start(self, run_plan, checkpoint, state, requested, chose, splits) -> None:
        cfg, engine, backend, summary, run_dir, main = (self.cfg, self.engine, self.backend, self.summary,
                                                        self.run_dir, self.main)
        summary["plan"] = run_plan.to_dict()  # what `posttrain explain` prints for this config, on this machine
        summary["rollout_engine"] = engine.rollout.name  # the engine that really started
        summary["weight_sync"] = run_plan.rollout.weight_sync  # none (colocated), full, merged (LoRA) or adapter
        summary["placement"] = run_plan.rollout.placement
        summary["reference_on"] = run_plan.reference_on  # trainer, workers, or None where the method has none
        summary["packed"] = engine.packed  # train.packing as it runs (false where the model cannot confine attention)
        summary["parameters"] = engine.parameters  # trained and total: under LoRA, the adapters against the whole
        if cfg.model.lora.r:  # what model/, an adapter, needs to load: its base (README, "LoRA")
            summary["adapter_base"] = {"path": str(Path(self.model_path).resolve()),
                                       "copy": checkpoints.BASE_COPY if cfg.model.path is None else None}
        start, self.elapsed = 0, 0.0  # steps done and seconds spent before this process started (a resumed run)
        if checkpoint is not None:
            start, self.elapsed = state["step"], state["wall_seconds"]
            engine.resume_at(start, tuple(state["skipped"]))  # first: the rollout engine's version is the steps done
            checkpoints.restore(checkpoint, engine)
            summary.update(state["evaluations"], resumed_from={"checkpoint": str(checkpoint), "step": start})
        backend.barrier()
        self.out = out = (run_dir.reopen(self.resolved) if checkpoint is not None else
                          run_dir.create(self.resolved)) if main else run_dir.path
        if main:
            if checkpoint is not None:
                keep_metrics_until(out / "metrics.jsonl", start)
            if requested == "auto" and not self.quiet:  # once the models have loaded: bad input stays one line
                print(f"posttrain: train.precision=auto runs {chose.precision}: {chose.reason}", file=sys.stderr)
            elif requested != "auto" and (warning := precision.emulation_warning(cfg.train.precision, run_device())):
                print(f"posttrain: warning: {warning}", file=sys.stderr)
            if warning := long_prompts(engine.tokenizer, *splits, cfg):  # once, over the data, not in the loop
                print(f"posttrain: warning: {warning}", file=sys.stderr)
            if cfg.train.packing and not engine.packed:
                print(f"posttrain: notice: train.packing: {engine.model_type} attention cannot be kept inside each of "
                      "several sequences in one row here; micro-batches run padded", file=sys.stderr)
            if not self.quiet:
                which = f"resuming from step {start} ({checkpoint}) of the {summary['algorithm']} run" \
                    if checkpoint is not None else f"{summary['algorithm']} run from the start"  # resume=auto says which
                print(f"posttrain: {which}, writing to {out} (moved to {run_dir.final} when done)", file=sys.stderr)
        self.samples = out / ("samples.jsonl" if main else f"samples.rank{backend.rank}.jsonl")
        if cfg.train.log_samples and checkpoint is not None:
            keep_metrics_until(self.samples, start)  # the lines of steps after the checkpoint are logged again
        backend.barrier()
        t = cfg.train
        self.schedule, self.saver = Schedule(cfg.eval, t.steps), Checkpoints(out, t.save_every, t.keep_checkpoints)
        self.stopper, self.step_done, self.stopped_at = engine.controllers.early_stop, start, None  # as checkpointed
        self.stopped = False
        if self.stopper.checkpoint:
            self.saver.protected = out / "checkpoints" / self.stopper.checkpoint
        if self.schedule.on and checkpoint is None:
            summary["eval_before"] = engine.evaluate()
        self.tracker = Tracker(out / "metrics.jsonl" if main else None, t.steps, show=not self.quiet, start=start,
                               report_to=cfg.trackers, config=self.resolved, name=run_dir.final.name).__enter__()

    @property
    def done(self) -> bool:
        """Whether the run has no step left: every step of train.steps done, or stopped early."""
        return self.stopped or self.step_done >= self.cfg.train.steps

    def step(self) -> dict:
        """The next step: trained, logged to metrics.jsonl (and the trackers), evaluated and checkpointed as the
        config says. Returns its metrics, as metrics.jsonl holds them."""
        if self.done:
            raise TrainingError(f"train.steps: the run has done its {self.step_done} steps; nothing is left to step")
        engine, saver, stopper, summary = self.engine, self.saver, self.stopper, self.summary
        step = self.step_done + 1
        metrics = {"step": step, **engine.step()}
        metrics["threads"] = self.threads.threads  # the step's; the next one's are fitted to the load seen in it
        self.threads.update()
        stopper.track(metrics)
        best = False
        if self.schedule.in_loop(step):
            summary["eval_after"] = engine.evaluate()  # the last one is the final evaluation
            metrics["eval_accuracy"] = summary["eval_after"]["accuracy"]
            best = stopper.on and stopper.judge(step, summary["eval_after"])
        metrics["wall_seconds"] = self.elapsed + time.perf_counter() - self.t_start
        self.tracker.log(metrics)
        if engine.samples:
            with self.samples.open("a") as f:
                f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in engine.samples)
        self.step_done = step
        checkpoints.crash_point("step", step)  # fault injection: logged, not yet saved
        run_state = {"wall_seconds": metrics["wall_seconds"], "model_path": str(Path(self.model_path).resolve()),
                     "evaluations": {k: summary[k] for k in ("eval_before", "eval_after") if k in summary},
                     "skipped": [engine.skipped_steps, engine.skipped_in_a_row], "config": self.resolved}
        if best:  # where the best checkpoint is, as it will be once this step's is written
            stopper.checkpoint = saver.path(step).name
        t = self.cfg.train
        if t.max_skipped_steps and engine.skipped_in_a_row >= t.max_skipped_steps:
            saved = saver.write(engine, step, run_state)
            raise TrainingError(f"train.max_skipped_steps: {engine.skipped_in_a_row} steps in a row had a "
                                f"non-finite loss or gradient norm and were skipped; stopped at step {step} "
                                f"(checkpoint: {saved})")
        if best:  # the checkpoint a run that stops early rolls back to, kept whatever keep_checkpoints says
            saver.protected = saver.write(engine, step, run_state)
        elif saver.due(step):
            saver.write(engine, step, run_state)
        self.backend.barrier()
        if stopper.stop:
            self.stopped_at, self.stopped = step, True
        return metrics

    def finish(self) -> dict | None:
        """Ends the run: the evaluation after, the early stop's roll-back, model/, summary.json, and the run directory
        moved into place. Returns the summary on the main process, None on the others."""
        engine, summary, saver, stopper = self.engine, self.summary, self.saver, self.stopper
        self.close_tracker()
        if self.schedule.after_loop:
            summary["eval_after"] = engine.evaluate()
        if stopper.on:
            summary["early_stop"] = stopper.summary(self.stopped_at)
            if stopper.best_step is not None and stopper.best_step != self.step_done:  # roll back to the best model
                engine.load_training_state(saver.protected / checkpoints.TRAINING_STATE)
                summary["eval_after"] = stopper.best_evaluation
        saver.final(engine)
        if isinstance(engine.rollout, Workers):  # the workers that really ran, and how often one was restarted
            summary["rollout_workers"] = {**engine.rollout.report(), "max_staleness": self.cfg.rollout.max_staleness}
        summary.update(steps=self.step_done, wall_seconds=self.elapsed + time.perf_counter() - self.t_start,
                       **engine.phases.run_peak(), memory={"roles_bytes": engine.roles.peak, **engine.phases.summary()},
                       output_dir=str(self.run_dir.final))
        if self.main:
            write_json(self.out / "summary.json", summary)
            self.run_dir.commit()
        self.backend.barrier()
        return summary if self.main else None

    def close_tracker(self) -> None:
        if self.tracker is not None:
            tracker, self.tracker = self.tracker, None
            tracker.__exit__(None, None, None)

    def close(self) -> None:
        """Releases the rollout workers, the producer and the trackers (the bar stopped, metrics.jsonl closed)."""
        try:
            self.close_tracker()
        finally:
            self.engine.close()  # rollout workers and the producer, when there are any

    def __enter__(self) -> Training:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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
