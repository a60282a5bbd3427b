"""Python files the user names by path (`rewards.custom`, `env.name=path.py:Class`), imported as modules of their own."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from functools import cache
from pathlib import Path
from types import ModuleType

from posttrain.core.errors import ConfigError


@cache
def import_file(path: str, prefix: str) -> ModuleType:
    """The file at `path` (absolute) imported once per process as the module `<prefix>_<hash of the path>`, registered
    in sys.modules, where dataclasses and pickle find a module's classes (a failed import is neither cached nor
    registered). Its directory is not put on `sys.path`: it imports installed packages, not modules beside it."""
    name = f"{prefix}_{hashlib.sha256(path.encode()).hexdigest()[:12]}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"not a Python source file: {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def names_a_file(entry: str) -> bool:
    """Whether a registry key's value (`env.name`, `algorithm.name`) is a file's entry rather than a registered name:
    it holds a colon or a slash, or ends in .py (so `my_env.py` without its `:Class` is told so, not "unknown")."""
    entry = str(entry)
    return ":" in entry or "/" in entry or entry.endswith(".py")


def load_entry(entry: str, key: str, prefix: str, expected: str) -> tuple[str, str, object]:
    """(absolute path, name, the module's attribute of that name or None) for `entry` ("path/to/file.py:name"), the
    file imported now. ConfigError naming `key`: an entry not of that form (`expected` says what is), a missing
    file, or one that fails to import."""
    path, colon, name = str(entry).rpartition(":")
    if not colon and str(entry).endswith(".py"):  # the file alone: say what to add rather than "no such name"
        raise ConfigError(f"{key}: expected {expected} (got the file alone, '{entry}': add a colon and the name to "
                          "load from it)")
    if not colon or not path or not name.isidentifier():
        raise ConfigError(f"{key}: expected {expected} (got {str(entry)!r})")
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise ConfigError(f"{key}: no such file '{file}'")
    try:
        module = import_file(str(file), prefix)
    except (Exception, SystemExit) as err:
        why = (str(err).strip().splitlines() or [""])[0]
        raise ConfigError(f"{key}: importing '{file}' failed ({type(err).__name__}: {why})") from None
    return str(file), name, getattr(module, name, None)


def file_sha256(path: Path) -> str:
    """The sha256 (hex) of the file at `path`, read a MiB at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(2**20):
            digest.update(chunk)
    return digest.hexdigest()
