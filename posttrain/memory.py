"""Measured memory: bytes held by each role (weights, gradients, optimizer state, ...) and peak memory per phase.

Roles are counted from the tensors themselves (numel × element size, each storage once), so they are exact and
comparable with `posttrain.estimate`. Phase peaks are the process's peak resident memory on CPU (the kernel's
high-water mark, reset at the start of each phase through /proc/self/clear_refs) and
`torch.cuda.max_memory_allocated` on a GPU (reset likewise).
"""

from __future__ import annotations

import contextlib
import resource
from collections.abc import Iterable
from pathlib import Path

import torch


def tensor_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind `tensors`."""
    seen, total = set(), 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        key = (t.untyped_storage().data_ptr(), t.device)
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def optimizer_bytes(optimizer) -> int:
    """Bytes of an optimizer's state (AdamW: the two moments and the step counters)."""
    return tensor_bytes(v for state in optimizer.state.values() for v in state.values())


def batch_bytes(batch) -> int:
    """Bytes of every tensor a step's batch carries (ids, masks, log-probs, values, advantages)."""
    import dataclasses

    fields = [getattr(batch, f.name) for f in dataclasses.fields(batch)]
    return tensor_bytes([*fields, *batch.extra.values()])


class RoleBytes:
    """The largest number of bytes seen for each role over a run."""

    def __init__(self):
        self.peak: dict[str, int] = {}

    def observe(self, role: str, nbytes: int) -> None:
        if nbytes:
            self.peak[role] = max(self.peak.get(role, 0), nbytes)


def _rss_high_water_kb() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_rss_high_water() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class PhasePeaks:
    """Peak memory (MiB) of named phases, the largest over all times a phase ran."""

    def __init__(self):
        self.cpu_mb: dict[str, float] = {}
        self.cuda_mb: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str):
        resettable = _reset_rss_high_water()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        try:
            yield
        finally:
            kb = _rss_high_water_kb() if resettable else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            if kb is not None:
                self.cpu_mb[name] = max(self.cpu_mb.get(name, 0.0), kb / 1024)
            if torch.cuda.is_available():
                mb = torch.cuda.max_memory_allocated() / 2**20
                self.cuda_mb[name] = max(self.cuda_mb.get(name, 0.0), mb)

    def summary(self) -> dict:
        out = {"cpu_peak_rss_mb": dict(self.cpu_mb)}
        if self.cuda_mb:
            out["cuda_peak_allocated_mb"] = dict(self.cuda_mb)
        return out
