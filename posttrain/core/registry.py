"""Registries: a table from name to plugin, shared by methods, rewards, rollout engines, backends and data sources.

One decorator adds an entry (a second entry under the same name is an error); `find` looks a name up, and an unknown
name is a `ConfigError` naming the config key, the nearest known name and every known one.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Any

from posttrain.core.errors import ConfigError


class Registry(dict):
    """Name -> plugin (a class, or a function for rewards), in registration order.

    Args:
        kind: what an entry is, for messages ("algorithm", "reward", ...).
        key: the config key that names an entry ("algorithm.name", ...).
    """

    def __init__(self, kind: str, key: str):
        super().__init__()
        self.kind, self.key = kind, key

    def register(self, name: str) -> Callable[[Any], Any]:
        """Decorator adding an entry under `name`; a class entry also gets `name` as its attribute."""

        def add(entry):
            if name in self:
                raise ValueError(f"{self.kind} {name!r} is registered twice ({self[name].__module__}, "
                                 f"{entry.__module__})")
            if isinstance(entry, type):
                entry.name = name
            self[name] = entry
            return entry

        return add

    def find(self, name: str, key: str | None = None) -> Any:
        """The entry registered as `name`; otherwise a ConfigError naming `key` (default: the registry's)."""
        if name not in self:
            near = difflib.get_close_matches(str(name), self, n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise ConfigError(f"{key or self.key}: unknown {self.kind} {name!r}; {hint}known: {', '.join(sorted(self))}")
        return self[name]
