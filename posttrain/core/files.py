"""Python files the user names by path (`rewards.custom`, `env.name=path.py:Class`), imported as modules of their own."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from functools import cache
from types import ModuleType


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
