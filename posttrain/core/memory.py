"""Measured memory and time: bytes held by each role (weights, gradients, optimizer state, ...), and the peak
memory and duration of each phase of a step.

Roles are counted from the tensors themselves (numel × element size, each storage once), so they are exact and
comparable with `posttrain.apps.estimate`. Phase peaks are the process's peak resident memory on CPU (the kernel's
high-water mark, reset at the start of each phase through /proc/self/clear_refs) and
`torch.cuda.max_memory_allocated` on a GPU (reset likewise).
"""

from __future__ import annotations

import contextlib
import resource
import time
from collections.abc import Iterable
from pathlib import Path

import torch


def tensor_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind `tensors`; of a sharded tensor, this process's shard."""
    seen, total = set(), 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        if hasattr(t, "to_local"):  # a DTensor (FSDP2)
            t = t.to_local()
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
    """Peak memory (MiB) of named phases, the largest over all times a phase ran, and of the whole run; and how long
    each phase took the last time it ran (`seconds`), so a phase is timed once.

    Resetting the kernel's high-water mark at each phase also resets what `getrusage` reports as the process's peak,
    so the whole-run peak is kept here: the high-water mark is folded in before every reset and at the end.
    """

    def __init__(self):
        self.cpu_mb: dict[str, float] = {}
        self.cuda_mb: dict[str, float] = {}
        self.run_cpu_mb = 0.0
        self.run_cuda_mb = 0.0
        self.seconds: dict[str, float] = {}

    def _high_water(self, resettable: bool) -> tuple[float | None, float | None]:
        """(peak RSS MiB, peak CUDA allocated MiB) since the last reset; folded into the whole-run peak."""
        kb = _rss_high_water_kb() if resettable else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        cpu = kb / 1024 if kb is not None else None
        cuda = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None
        self.run_cpu_mb = max(self.run_cpu_mb, cpu or 0.0)
        self.run_cuda_mb = max(self.run_cuda_mb, cuda or 0.0)
        return cpu, cuda

    @contextlib.contextmanager
    def phase(self, name: str):
        self._high_water(_rss_high_water_kb() is not None)  # what happened since the last phase counts for the run
        resettable = _reset_rss_high_water()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = time.perf_counter() - start
            cpu, cuda = self._high_water(resettable)
            if cpu is not None:
                self.cpu_mb[name] = max(self.cpu_mb.get(name, 0.0), cpu)
            if cuda is not None:
                self.cuda_mb[name] = max(self.cuda_mb.get(name, 0.0), cuda)

    def run_peak(self) -> dict[str, float]:
        """Peak resident memory of the run so far (and peak CUDA memory allocated, on a GPU), in MiB."""
        self._high_water(_rss_high_water_kb() is not None)
        out = {"peak_rss_mb": self.run_cpu_mb}
        if torch.cuda.is_available():
            out["peak_cuda_allocated_mb"] = self.run_cuda_mb
        return out

    def summary(self) -> dict:
        out = {"cpu_peak_rss_mb": dict(self.cpu_mb)}
        if self.cuda_mb:
            out["cuda_peak_allocated_mb"] = dict(self.cuda_mb)
        return out
