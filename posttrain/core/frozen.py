"""Read-only configs: a validated config is never changed by the run that reads it.

`Freezable` is a mixin for the config dataclasses (the schema's groups and each plugin's `Config`); `freeze` makes an
instance and every dataclass inside it refuse attribute writes. State that changes as a run goes lives in
controllers (posttrain.train.controllers); a changed copy is `dataclasses.replace(cfg, ...)`, which is not frozen.
"""

from __future__ import annotations

import dataclasses


class Freezable:
    def __setattr__(self, name, value):
        if self.__dict__.get("_frozen"):
            raise dataclasses.FrozenInstanceError(
                f"{type(self).__name__}.{name}: the validated config is read-only; state that changes as a run goes "
                "belongs in a controller, a changed copy is dataclasses.replace(...)")
        object.__setattr__(self, name, value)


def freeze(obj):
    """`obj` (a dataclass instance) and the dataclasses in its fields, made read-only; returns `obj`."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            freeze(getattr(obj, f.name))
        if isinstance(obj, Freezable):
            object.__setattr__(obj, "_frozen", True)
    return obj
