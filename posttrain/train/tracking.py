"""Tracking a run: one JSON object per step in metrics.jsonl, and a progress bar (step, reward, KL, loss, tokens/s)
on the terminal (stderr). Only the main process tracks; the others pass `path=None` and show nothing.
"""

from __future__ import annotations

import json
import sys
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

FIELDS = (("reward", "reward {:.3f}"), ("kl", "kl {:.4f}"), ("loss", "loss {:.4f}"), ("tokens_per_s", "{:.0f} tok/s"))
FIGURES_WIDTH = 80  # about what a line takes without its bar: the unit, the step count, the figures and the times
BAR_WIDTH = 40


class Figures(ProgressColumn):
    """The latest figures. On a narrow terminal this is the column that gives way, cut with an ellipsis rather than
    wrapped, so that the step count and the times beside it are always shown whole."""

    def render(self, task) -> Text:
        return Text(task.fields["info"], no_wrap=True, overflow="ellipsis")


class Progress:
    """A live bar on a terminal; a plain line every tenth of the run otherwise (logs, CI)."""

    def __init__(self, total: int, enabled: bool = True, unit: str = "step"):
        self.total, self.enabled, self.unit = total, enabled, unit
        self.console = Console(stderr=True)
        self.live = enabled and self.console.is_terminal
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


class Tracker:
    """Writes each step's metrics to `path` (flushed per step) and shows them on the progress bar.

    Args:
        path: metrics.jsonl, or None on processes that do not track.
        total: steps of the run.
        show: whether to show progress (off with --quiet).
        append: add to the lines `path` holds (a resumed run) rather than start it afresh.
    """

    def __init__(self, path: Path | None, total: int, show: bool, append: bool = False):
        self.path, self.append = path, append
        self.progress = Progress(total, enabled=path is not None and show)
        self.file = None

    def __enter__(self) -> Tracker:
        if self.path is not None:
            self.file = open(self.path, "a" if self.append else "w")  # a resumed run adds to its lines
        self.progress.__enter__()
        return self

    def log(self, metrics: dict) -> None:
        if self.file is not None:
            self.file.write(json.dumps(metrics) + "\n")
            self.file.flush()
        self.progress.update(metrics)

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)
        if self.file is not None:
            self.file.close()
