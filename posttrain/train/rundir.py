"""Run directories: a run writes into `<output_dir>.partial` and takes the place of `output_dir` only when it has
finished, so a failed or interrupted run never leaves a half-written directory where a good one was. What could stop
that final move is checked when a `RunDir` is made, before any work (`posttrain.core.outputs`, and a mount point)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from posttrain.core.errors import ConfigError, TrainingError
from posttrain.core.outputs import check_output_dir


class RunDir:
    def __init__(self, output_dir: str | Path, overwrite: bool, resume: bool | str = False):
        self.final = check_output_dir(output_dir)
        if self.final.exists() and not self.final.is_dir():
            raise ConfigError(f"output_dir: '{self.final}' is a file, not a directory")
        explicit = resume is True or (isinstance(resume, str) and resume != "auto")  # resume=true or a path
        if explicit and (self.final / "summary.json").is_file() and not overwrite:
            raise ConfigError(f"resume: '{self.final}' holds a finished run; nothing to resume (overwrite=true "
                              "replaces it with the resumed one)")
        if self.final.is_dir() and any(self.final.iterdir()) and not overwrite:
            raise ConfigError(f"output_dir: '{self.final}' is not empty; pass overwrite=true or another output_dir=…")
        self.path = self.final.with_name(self.final.name + ".partial")
        self.old = self.final.with_name(self.final.name + ".old")
        for side in (self.path, self.old):
            if side.exists() and not side.is_dir():
                raise ConfigError(f"output_dir: '{side}', where the run goes on its way to '{self.final}', is a "
                                  "file; move it away or choose another output_dir")
        if (self.path / "summary.json").is_file() and not overwrite:
            raise ConfigError(f"output_dir: '{self.path}' holds a finished run that was not moved into place; rename "
                              f"it to '{self.final}', or pass overwrite=true to discard it")
        if not resume and not overwrite and any((self.path / "checkpoints").glob("step_*/trainer_state.json")):
            raise ConfigError(f"output_dir: '{self.path}' holds an interrupted run's checkpoints; resume=auto or "
                              "true continues it, overwrite=true starts afresh and discards them")
        if os.path.ismount(self.final):
            raise ConfigError(f"output_dir: '{self.final}' is a mount point: the finished run, written beside it in "
                              f"'{self.path}', cannot be moved onto it from another filesystem; name a subdirectory, "
                              f"e.g. output_dir={self.final / 'run'}")

    def create(self) -> Path:
        """Empties and creates the staging directory (a previous failed run's leftovers go)."""
        if self.path.exists():
            shutil.rmtree(self.path)
        self.path.mkdir(parents=True)
        return self.path

    def reopen(self) -> Path:
        """The staging directory of an interrupted run, as it was (created if a resumed run starts a new one), without
        the temporary directories of checkpoint writes that a kill interrupted."""
        self.path.mkdir(parents=True, exist_ok=True)
        for torn in (self.path / "checkpoints").glob(".step_*"):  # interrupted writes (.tmp) and removals (.old)
            shutil.rmtree(torn)
        return self.path

    def commit(self) -> Path:
        """Moves the finished run into place; an existing `output_dir` is removed only after that move.

        Raises:
            TrainingError: the move failed (the checks of `__init__` make that rare); the finished run stays whole in
                `<output_dir>.partial` and a previous `output_dir` where it was.
        """
        try:
            if self.final.exists():
                if self.old.exists():
                    shutil.rmtree(self.old)
                self.final.rename(self.old)
            try:
                self.path.rename(self.final)
            except OSError:
                if self.old.exists() and not self.final.exists():
                    self.old.rename(self.final)  # the previous run back where it was
                raise
        except OSError as err:
            raise TrainingError(f"output_dir: the run finished, but moving it from '{self.path}' to '{self.final}' "
                                f"failed ({err.strerror or err}); the finished run is whole in '{self.path}': move "
                                "it yourself") from None
        if self.old.exists():
            shutil.rmtree(self.old)
        return self.final


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
