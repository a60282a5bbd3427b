"""Your own reward functions, loaded from a local Python file by path: `rewards.custom: {path/to/file.py:function: w}`.

A custom reward is an ordinary reward function: lists `(completions, answers, prompts)` in, one float (or None: could
not score) per completion out, and a keyword `answer_format` when it declares one. The file is imported once when the
config is loaded, to check the entry, and once in each reward worker (`posttrain.rewards.base`), which calls the
function on one completion at a time. The file is your code, trusted as the recipe is; completions reach it as data.
Its directory is not put on `sys.path`, so it imports installed packages, not modules beside it.

In metrics it is `reward/<file stem>.<function>`, e.g. `reward/my_rewards.brevity`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from posttrain.core.errors import ConfigError
from posttrain.core.files import import_file, load_entry

PREFIX = "posttrain_custom_reward"  # the module name of a reward's file: PREFIX_<hash of its path>


@dataclass(frozen=True)
class FileFunction:
    """The function `name` of the Python file at `path` (absolute). It pickles as these two strings, so it reaches a
    worker as a reference, and each process imports the file once, on first use."""

    path: str
    name: str

    @property
    def label(self) -> str:
        """Its name in metrics: the file's stem and the function's name."""
        return f"{Path(self.path).stem}.{self.name}"

    def function(self):
        return getattr(import_file(self.path, PREFIX), self.name)

    def warm(self, **context) -> None:
        """Imports the file (a reward worker calls this as it starts, outside the bound on each call)."""
        self.function()

    def __call__(self, *args, **kwargs):
        return self.function()(*args, **kwargs)


def load(entry: str) -> FileFunction:
    """The function that `entry` ("path/to/file.py:function") names, its file imported now to check it.

    Raises:
        ConfigError: naming `rewards.custom.<entry>`, when the entry is not `path:function`, the file is missing or
            fails to import, or it has no function of that name.
    """
    key = f"rewards.custom.{entry}"
    file, name, function = load_entry(entry, key, PREFIX, "path/to/file.py:function")
    if not callable(function):
        raise ConfigError(f"{key}: '{file}' defines no function {name!r}")
    return FileFunction(file, name)
