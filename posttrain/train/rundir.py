"""Run directories: a run writes into `<output_dir>.partial` and takes the place of `output_dir` only when it has
finished, so a failed or interrupted run never leaves a half-written directory where a good one was. What could stop
that final move is checked when a `RunDir` is made, before any work (`posttrain.core.outputs`, and a mount point).

posttrain removes only directories it can tell it wrote: a run directory's config.yaml, written as the directory is
made, opens with `HEADER`. A `<output_dir>.partial` or `<output_dir>.old` holding anything else, or an `output_dir`
that `overwrite=true` would replace, is refused before any work (an empty directory holds nothing to lose). The mark
is the first line of a file every run directory has anyway, so the directory holds nothing it did not hold before.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from posttrain.core.errors import ConfigError, TrainingError
from posttrain.core.outputs import check_output_dir

CONFIG = "config.yaml"
HEADER = "# posttrain run directory: the resolved config of the run written here"  # config.yaml's first line


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
        if overwrite and not removable(self.final):
            raise ConfigError(f"output_dir: '{self.final}' is not a posttrain run's directory (its {CONFIG} does not "
                              "open with posttrain's line); overwrite=true replaces only a run's: move the files away "
                              "or choose another output_dir")
        self.path = self.final.with_name(self.final.name + ".partial")
        self.old = self.final.with_name(self.final.name + ".old")
        for side in (self.path, self.old):
            if side.exists() and not side.is_dir():
                raise ConfigError(f"output_dir: '{side}', where the run goes on its way to '{self.final}', is a "
                                  "file; move it away or choose another output_dir")
        if not removable(self.path) and not (resume is not False and not overwrite and resumable(self.path)):
            raise ConfigError(f"output_dir: '{self.path}', where the run is written on its way to '{self.final}', "
                              "holds files posttrain did not write; move them away or choose another output_dir")
        if not removable(self.old):
            raise ConfigError(f"output_dir: '{self.old}', where the previous '{self.final}' is set aside while the "
                              "run takes its place, holds files posttrain did not write; move them away or choose "
                              "another output_dir")
        if (self.path / "summary.json").is_file() and not overwrite:
            raise ConfigError(f"output_dir: '{self.path}' holds a finished run that was not moved into place; rename "
                              f"it to '{self.final}', or pass overwrite=true to discard it")
        if not resume and not overwrite and resumable(self.path):
            raise ConfigError(f"output_dir: '{self.path}' holds an interrupted run's checkpoints; resume=auto or "
                              "true continues it, overwrite=true starts afresh and discards them")
        if os.path.ismount(self.final):
            raise ConfigError(f"output_dir: '{self.final}' is a mount point: the finished run, written beside it in "
                              f"'{self.path}', cannot be moved onto it from another filesystem; name a subdirectory, "
                              f"e.g. output_dir={self.final / 'run'}")

    def create(self, resolved: dict) -> Path:
        """Empties and creates the staging directory (a previous failed run's leftovers go), with `resolved` as its
        config.yaml."""
        remove(self.path)
        self.path.mkdir(parents=True)
        write_config(self.path, resolved)
        return self.path

    def reopen(self, resolved: dict) -> Path:
        """The staging directory of an interrupted run, as it was (created if a resumed run starts a new one), without
        the temporary directories of checkpoint writes that a kill interrupted; `resolved` is its config.yaml."""
        self.path.mkdir(parents=True, exist_ok=True)
        write_config(self.path, resolved)  # first: what follows removes only what a run wrote
        for torn in (self.path / "checkpoints").glob(".step_*"):  # interrupted writes (.tmp) and removals (.old)
            shutil.rmtree(torn)
        return self.path

    def commit(self) -> Path:
        """Moves the finished run into place; an existing `output_dir` is removed only after that move.

        Raises:
            TrainingError: the move failed (the checks of `__init__` make that rare); the finished run stays whole in
                `<output_dir>.partial` and a previous `output_dir` where it was.
        """
        if not (removable(self.final) and removable(self.old)):  # files put there while the run ran
            raise TrainingError(f"output_dir: the run finished, but '{self.final}' or '{self.old}' now holds files "
                                f"posttrain did not write; the finished run is whole in '{self.path}': move it "
                                "yourself")
        try:
            if self.final.exists():
                remove(self.old)
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
        remove(self.old)
        return self.final


def ours(path: Path) -> bool:
    """Whether `path` is a run directory posttrain wrote: its config.yaml opens with `HEADER`."""
    try:
        with open(path / CONFIG, encoding="utf-8", errors="replace") as f:
            return f.readline().rstrip("\n") == HEADER
    except OSError:  # none, or not a file
        return False


def removable(path: Path) -> bool:
    """Whether posttrain may remove `path`: absent, an empty directory, or a run directory it wrote."""
    return not os.path.lexists(path) or (path.is_dir() and not path.is_symlink()
                                         and (ours(path) or not any(path.iterdir())))


def resumable(path: Path) -> bool:
    """Whether `path` holds a run's checkpoints (one of a posttrain whose config.yaml had no first line to tell it
    by): a resumed run reopens it, adding to it, and removes nothing of the user's."""
    return any((path / "checkpoints").glob("step_*/trainer_state.json"))


def remove(path: Path) -> None:
    """Removes `path` (when it exists) once it is known to be posttrain's own (`removable`).

    Raises:
        ConfigError: naming `path`, when it holds files posttrain did not write.
    """
    if not os.path.lexists(path):
        return
    if not removable(path):
        raise ConfigError(f"output_dir: '{path}' holds files posttrain did not write; move them away or choose "
                          "another output_dir")
    shutil.rmtree(path)


def write_config(path: Path, resolved: dict) -> None:
    """`resolved` as `path`/config.yaml, opening with `HEADER`, the line that marks the directory as a run's."""
    import yaml

    text = yaml.safe_dump(resolved, sort_keys=False, allow_unicode=True)
    (path / CONFIG).write_text(f"{HEADER}\n{text}")


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
