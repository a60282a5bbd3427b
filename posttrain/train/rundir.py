"""Run directories: a run writes into `<output_dir>.partial` and takes the place of `output_dir` only when it has
finished, so a failed or interrupted run never leaves a half-written directory where a good one was."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from posttrain.core.errors import ConfigError


class RunDir:
    def __init__(self, output_dir: str | Path, overwrite: bool, resume: bool | str = False):
        self.final = Path(output_dir)
        if self.final.exists() and not self.final.is_dir():
            raise ConfigError(f"output_dir: '{self.final}' is a file, not a directory")
        if resume and (self.final / "summary.json").is_file() and not overwrite:
            raise ConfigError(f"resume: '{self.final}' holds a finished run; nothing to resume (overwrite=true "
                              "replaces it with the resumed one)")
        if self.final.is_dir() and any(self.final.iterdir()) and not overwrite:
            raise ConfigError(f"output_dir: '{self.final}' is not empty; pass overwrite=true or another output_dir=…")
        self.path = self.final.with_name(self.final.name + ".partial")
        if not resume and not overwrite and any((self.path / "checkpoints").glob("step_*/trainer_state.json")):
            raise ConfigError(f"output_dir: '{self.path}' holds an interrupted run's checkpoints; resume=true "
                              "continues it, overwrite=true starts afresh and discards them")

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
        """Moves the finished run into place; an existing `output_dir` is removed only after that move."""
        old = self.final.with_name(self.final.name + ".old")
        if self.final.exists():
            if old.exists():
                shutil.rmtree(old)
            self.final.rename(old)
        self.path.rename(self.final)
        if old.exists():
            shutil.rmtree(old)
        return self.final


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
