"""Where a command's outputs go, checked before any work: a run, a comparison or an evaluation that can only fail
to write its results at the end, after minutes of work, should fail before it starts.

The checks cover what stops a run's final move (`posttrain.train.rundir`) and any write: a directory the results cannot
take the place of (the current one, one above it, the root, posttrain's own code), a parent that is a file, and a
directory that cannot be written in.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from posttrain.core.errors import ConfigError

CODE = Path(__file__).resolve().parents[1]  # the posttrain package


def check_output_dir(output_dir: str | Path, key: str = "output_dir", example: str = "runs/run") -> Path:
    """`output_dir` as a path, once it names a directory of its own whose parent can be written.

    Raises:
        ConfigError: naming `key` and the path: empty, the current directory, the root, a directory above the
            current one or holding posttrain's code, or one that cannot be created (`check_writable`).
    """
    text = str(output_dir)
    if not text.strip():
        raise ConfigError(f"{key}: empty; name a directory, e.g. {key}={example}")
    path = Path(text)
    where, here = path.resolve(), Path.cwd().resolve()
    what = ("the current directory" if where == here else "the root directory" if where == Path(where.anchor)
            else "a directory above the current one" if where in here.parents
            else "posttrain's own code" if where == CODE
            else "a directory that holds posttrain's own code" if where in CODE.parents else None)
    if what:
        raise ConfigError(f"{key}: '{text}' is {what}; the results need a directory of their own: name a "
                          f"subdirectory, e.g. {key}={example}")
    check_writable(path, key)
    return path


def check_writable(path: Path, key: str) -> None:
    """Refuses `path` when it cannot be made: a directory above it is a file, or the nearest one that exists cannot
    be written in. That one is probed the way a run uses it (a directory made, renamed, removed), so a read-only
    filesystem or a missing permission shows now rather than after the work; `os.access` says yes to root.

    Raises:
        ConfigError: naming `key`, `path` and the directory that stops it.
    """
    above = next(p for p in (path.parent, *path.parent.parents) if os.path.exists(p))
    if not above.is_dir():
        raise ConfigError(f"{key}: cannot create '{path}': '{above}' is a file, not a directory")
    try:
        probe = Path(tempfile.mkdtemp(prefix=f".{path.name}.probe-", dir=above))
        try:
            probe = probe.rename(probe.with_name(probe.name + "-moved"))
        finally:
            probe.rmdir()
    except OSError as err:
        raise ConfigError(f"{key}: cannot create '{path}' in '{above}' ({err.strerror or err}); choose another "
                          f"{key} or make '{above}' writable") from None
