"""Tracking a run: one JSON object per step in metrics.jsonl, a progress bar (step, reward, KL, loss, tokens/s) on the
terminal (stderr), and the trackers `report_to` names, which get the same numbers through accelerate's tracker classes.
Only the main process tracks; the others pass `path=None` and show nothing.

A tracker is a function in `TRACKERS`: (run directory, run name, steps done before) -> an accelerate `GeneralTracker`,
not yet started. Its library is imported only when a run asks for it.
"""

from __future__ import annotations

import io
import json
import os
import sys
from contextlib import ExitStack, redirect_stdout
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    ProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.progress import Progress as RichProgress
from rich.table import Column
from rich.text import Text

from posttrain.config import flatten

FIELDS = (("reward", "reward {:.3f}"), ("kl", "kl {:.4f}"), ("loss", "loss {:.4f}"), ("tokens_per_s", "{:.0f} tok/s"))
FIGURES_WIDTH = 80  # about what a line takes without its bar: the unit, the step count, the figures and the times
BAR_WIDTH = 40


class Figures(ProgressColumn):
    """The latest figures. On a narrow terminal this is the column that gives way, cut with an ellipsis rather than
    wrapped, so that the step count and the times beside it are always shown whole."""

    def render(self, task) -> Text:
        return Text(task.fields["info"], no_wrap=True, overflow="ellipsis")


class Progress:
    """A live bar on a terminal, and in a Jupyter notebook where ipywidgets is installed (rich draws it there); a
    plain line every tenth of the run otherwise (logs, CI)."""

    def __init__(self, total: int, enabled: bool = True, unit: str = "step"):
        self.total, self.enabled, self.unit = total, enabled, unit
        self.console = Console(stderr=True)
        self.live = enabled and (self.console.is_terminal or self.console.is_jupyter and has_widgets())
        whole = Column(no_wrap=True)  # never cut (rich narrows every wrappable column of a line that is too long)
        room = self.console.width - FIGURES_WIDTH  # a bar only where the figures leave it room
        bar = [BarColumn(min(room, BAR_WIDTH), table_column=whole)] if room >= 10 else []
        self.bar = RichProgress(TextColumn(unit, table_column=whole), MofNCompleteColumn(table_column=whole), *bar,
                                Figures(), TimeElapsedColumn(table_column=whole), TextColumn("<", table_column=whole),
                                TimeRemainingColumn(table_column=whole), console=self.console)
        self.task = None

    def __enter__(self) -> Progress:
        if self.live:
            self.bar.start()
            self.task = self.bar.add_task("train", total=self.total, info="")
        return self

    def update(self, metrics: dict) -> None:
        if not self.enabled:
            return
        info = "  ".join(fmt.format(metrics[k]) for k, fmt in FIELDS if k in metrics)
        if self.live:
            self.bar.update(self.task, completed=metrics["step"], info=info)
        elif metrics["step"] % max(1, self.total // 10) == 0 or metrics["step"] == self.total:
            print(f"{self.unit} {metrics['step']}/{self.total}  {info}".rstrip(), file=sys.stderr, flush=True)

    def __exit__(self, *exc) -> None:
        if self.live:
            self.bar.stop()


def has_widgets() -> bool:
    """Whether ipywidgets, which rich's live display in a notebook needs, is installed."""
    import importlib.util

    return importlib.util.find_spec("ipywidgets") is not None


def tensorboard_tracker(run_dir: Path, name: str, start: int):
    """Event files in `<run dir>/tensorboard` (accelerate writes into logging_dir/run_name). A resumed run opens its
    file with purge_step = its first step, so TensorBoard drops what the interrupted run logged after its checkpoint."""
    from accelerate.tracking import TensorBoardTracker

    return TensorBoardTracker("tensorboard", run_dir, purge_step=start + 1 if start else None)


def wandb_tracker(run_dir: Path, name: str, start: int):
    """A W&B run named after the run, its files in `<run dir>/wandb` (WANDB_MODE=offline: an offline-run-* directory
    there, for `wandb sync`); project $WANDB_PROJECT, else posttrain. A resumed run is a new W&B run whose steps go on
    from the checkpoint's: W&B refuses steps below a run's last, which the interrupted run may have passed."""
    from accelerate.tracking import WandBTracker

    return WandBTracker(os.environ.get("WANDB_PROJECT") or "posttrain", dir=str(run_dir), name=name)


def trackio_tracker(run_dir: Path, name: str, start: int):
    """A trackio run named after the run in its local database ($TRACKIO_DIR, else $HF_HOME/trackio); project
    $TRACKIO_PROJECT, else posttrain. trackio's own CPU and GPU sampling is off: it gets metrics.jsonl's numbers only.
    A resumed run is a new trackio run of the same name, as under W&B."""
    from accelerate.tracking import TrackioTracker

    class Trackio(TrackioTracker):
        def store_init_configuration(self, values: dict) -> None:
            # accelerate 1.15 calls trackio.config.update(values, allow_val_change=True); trackio's config is a plain
            # dict, which stores allow_val_change as one more key
            self.run.config.update(values)

        def finish(self) -> None:
            import trackio

            trackio.finish()  # accelerate's run.finish() leaves the run current, for trackio to finish again at exit

    return Trackio(os.environ.get("TRACKIO_PROJECT") or "posttrain", name=name, auto_log_cpu=False,
                   auto_log_gpu=False)


# report_to's names (posttrain.schema.TRACKERS, which also says what each needs installed) -> a tracker
TRACKERS = {"tensorboard": tensorboard_tracker, "wandb": wandb_tracker, "trackio": trackio_tracker}


def hyperparameters(config: dict) -> dict[str, bool | str | int | float]:
    """The resolved config as trackers store it: dotted keys, scalar values; null and lists as their JSON text."""
    return {k: v if isinstance(v, (bool, str, int, float)) else json.dumps(v) for k, v in flatten(config).items()}


class Tracker:
    """Writes each step's metrics to `path` (flushed per step), shows them on the progress bar, and logs their numbers
    (all but `step`, which is their step) to each tracker of `report_to`.

    Args:
        path: metrics.jsonl, or None on processes that do not track.
        total: steps of the run.
        show: whether to show progress (off with --quiet; the trackers' own lines then go too).
        start: steps done before this process (a resumed run): `path` is added to rather than started afresh, and
            TensorBoard drops what was logged after step `start`.
        report_to: names of `TRACKERS`.
        config: the resolved config (config.yaml), stored with each tracker as `hyperparameters`.
        name: the run's name (output_dir's last part), for W&B and trackio.
    """

    def __init__(self, path: Path | None, total: int, show: bool, start: int = 0, report_to: tuple[str, ...] = (),
                 config: dict | None = None, name: str = "run"):
        self.path, self.start, self.config, self.name = path, start, config or {}, name
        self.report_to = report_to if path is not None else ()
        self.progress = Progress(total, enabled=path is not None and show)
        self.file, self.trackers, self.stack = None, [], ExitStack()

    def chatter(self):
        """Where trackers' prints go (trackio prints to stdout, which holds the run's results): stderr, or nowhere."""
        return redirect_stdout(sys.stderr if self.progress.enabled else io.StringIO())

    def __enter__(self) -> Tracker:
        with ExitStack() as stack:  # on an error, what was opened so far is closed again
            if self.path is not None:
                self.file = stack.enter_context(open(self.path, "a" if self.start else "w"))
            values = hyperparameters(self.config) if self.report_to else {}
            for name in self.report_to:  # before the live bar, which takes over the terminal
                tracker = TRACKERS[name](self.path.parent, self.name, self.start)
                with self.chatter():
                    tracker.start()
                stack.callback(self.finish, tracker)
                tracker.store_init_configuration(values)
                self.trackers.append(tracker)
            stack.enter_context(self.progress)
            self.stack = stack.pop_all()
        return self

    def finish(self, tracker) -> None:
        with self.chatter():
            tracker.finish()

    def log(self, metrics: dict) -> None:
        if self.file is not None:
            self.file.write(json.dumps(metrics) + "\n")
            self.file.flush()
        if self.trackers:
            numbers = {k: v for k, v in metrics.items()
                       if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
            for tracker in self.trackers:
                tracker.log(numbers, step=metrics["step"])
        self.progress.update(metrics)

    def __exit__(self, *exc) -> None:
        self.stack.__exit__(*exc)  # the bar stops, then the trackers finish (files closed), then metrics.jsonl closes
