"""Compute threads that fit the machine: the cores a process may use, less those another process keeps busy.

torch starts one compute thread per core it sees, and splits every operation evenly over them. When another process
(a second job, a data loader) keeps one of those cores busy, each operation waits for the thread that shares it, at
every op: a GRPO step of the embedded default on 2 cores took 2.0× as long with the second core busy, and 1.25×
with one thread (bench/busy_core.py has the figures). So a run

1. starts with as many threads as the cores it may use: its CPU affinity (`os.sched_getaffinity`, which taskset,
   numactl and container cpusets set), capped by a cgroup CPU quota (`cpu.max`, or v1's `cpu.cfs_quota_us`), and
   shared among the processes of one machine (`LOCAL_WORLD_SIZE`);
2. after each step, once at least `WINDOW_S` seconds have passed since it last looked, measures how many of those
   cores other processes kept busy meanwhile (/proc/stat's busy time on the allowed cores less this process's own
   and its children's CPU time) and runs one thread fewer for each, never fewer than one; they come back once the
   cores are free. The window keeps bursts (the kernel writing a checkpoint back to disk, a short command) and the
   clock-tick rounding of short steps from costing a thread.

`train.threads=N`, or OMP_NUM_THREADS in the environment (torchrun sets it to 1 for several processes), pins the
count instead. Thread counts can change the last bits of some reductions, so a run that must repeat bit for bit
under changing load pins it (on the embedded default, 1 and 2 threads give the same bytes). A pinned count above the
cores, or rollout workers and their threads beyond them, is refused when the config is loaded (`check_counts`): each
core then runs several threads that wait for each other at every operation, and a 2-core run of the embedded default
went from about 11,000 tokens/s to 180-230 with `train.threads=1000`, saying nothing. The check is of the machine it
runs on, so a config written for a larger one says how many cores this one has.

Worker pools (`posttrain.core.bounded`) start at most as many processes as there are usable cores, each with one
compute thread, so posttrain's own reward checks never oversubscribe the cores either.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

from posttrain.core.errors import ConfigError

CGROUP = Path("/sys/fs/cgroup")
WINDOW_S = 2.0  # the shortest interval over which others' load is judged


def cgroup_quota(root: Path = CGROUP) -> float | None:
    """The CPU quota of this process's cgroup in cores (2.5: 250 ms of CPU per 100 ms), None when unlimited."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]  # cgroup v2: "max 100000" or "200000 100000"
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())  # cgroup v1: -1 when unlimited
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def allowed_cpus() -> set[int]:
    """The CPUs this process may run on."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return set(range(os.cpu_count() or 1))


def machine_cores(quota: float | None = None) -> int:
    """How many cores the processes of this run may keep busy together: the allowed CPUs, capped by the cgroup quota
    (rounded up); at least 1."""
    cores = len(allowed_cpus())
    quota = cgroup_quota() if quota is None else quota
    if quota:
        cores = min(cores, math.ceil(quota))
    return max(1, cores)


def _local_processes() -> int:
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))


def usable_cores(quota: float | None = None) -> int:
    """How many cores this process may keep busy: its allowed CPUs, capped by the cgroup quota (rounded up), divided
    among the processes of this machine (LOCAL_WORLD_SIZE); at least 1."""
    return max(1, machine_cores(quota) // _local_processes())


def env_threads() -> int | None:
    """OMP_NUM_THREADS as a thread count; None when unset or empty.

    Raises:
        ConfigError: it is set to anything but a whole number ≥ 1 (libgomp would ignore it with a complaint of its
            own, and the run fit its threads as if it were unset).
    """
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if not env:
        return None
    levels = [x.strip() for x in env.split(",")]  # OpenMP's list, one count per nesting level: the first is ours
    if not all(x.isdigit() and int(x) >= 1 for x in levels):
        raise ConfigError(f"OMP_NUM_THREADS: {os.environ['OMP_NUM_THREADS']!r} in the environment is not a thread "
                          "count; set it to a whole number ≥ 1, or unset it to fit the threads to the machine")
    return int(levels[0])


def pinned(requested: int = 0) -> int | None:
    """The thread count the user pinned: `train.threads` when > 0, else OMP_NUM_THREADS when set; None: fit it."""
    if requested > 0:
        return requested
    return env_threads()


def _cores_here(cores: int) -> str:
    """'the N cores this process may use', for a message."""
    return f"the {cores} core{'s' if cores != 1 else ''} this process may use"


def check_counts(threads: int, workers: int = 0, worker_threads: int = 0) -> None:
    """Refuses thread and process counts above the cores of this machine that the run may use, where every core
    would run several threads that wait for each other at every operation.

    Args:
        threads: `train.threads` (0: fitted, or OMP_NUM_THREADS when set).
        workers: `rollout.workers` under separate placement (0: none); the training processes share them.
        worker_threads: `rollout.worker_threads` (0: the cores shared out, never more than there are).

    Raises:
        ConfigError: naming the key, the count and the cores; or OMP_NUM_THREADS when it is no count.
    """
    env_threads()  # a value that is no count is refused even where train.threads wins: libgomp still reads it
    key = "train.threads" if threads > 0 else "OMP_NUM_THREADS"
    wanted, cores = pinned(threads), machine_cores()
    # Against the cores this process may run on, not its share under LOCAL_WORLD_SIZE: a launcher that binds each
    # process to cores of its own (srun --cpu-bind, numactl) has already made the share, and a refusal must not guess.
    if wanted is not None and wanted > cores:
        fit = "0" if key == "train.threads" else "unset it"
        raise ConfigError(f"{key}: {wanted} threads on {_cores_here(cores)} would each wait for the others at every "
                          f"operation, slowing the run many times over; give at most {cores}, or {fit} to fit them to "
                          "the machine")
    if workers > cores:
        raise ConfigError(f"rollout.workers: {workers} worker processes on {_cores_here(cores)} would each wait for "
                          f"the others at every operation; give at most {cores}")
    if worker_threads * max(workers, 1) > cores:
        each = "in each worker" if workers <= 1 else f"in each of {workers} workers ({workers * worker_threads})"
        raise ConfigError(f"rollout.worker_threads: {worker_threads} threads {each} on {_cores_here(cores)} would "
                          f"each wait for the others at every operation; give at most {cores // max(workers, 1)}, "
                          "or 0 to share the cores out")


def _busy_seconds(cpus: set[int]) -> float | None:
    """Seconds the CPUs in `cpus` have spent busy since boot (all but idle and iowait), from /proc/stat."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    ticks, hz = 0, os.sysconf("SC_CLK_TCK")
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            values = [int(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal
            ticks += sum(values) - values[3] - values[4]
    return ticks / hz


def _own_seconds() -> float:
    """CPU seconds used by this process and its live children (a reward pool's workers are posttrain's own)."""
    import psutil

    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for child in me.children(recursive=True):
        try:
            total += sum(child.cpu_times()[:2])
        except psutil.Error:  # it exited in between
            pass
    return total


class ThreadFit:
    """Holds the run's compute-thread count and fits it to the cores left free after each step.

    Args:
        requested: `train.threads` (0: fit; N: pinned at N).
    """

    def __init__(self, requested: int = 0):
        import torch

        self.torch = torch
        self.cores = usable_cores()
        fixed = pinned(requested)
        self.fitting = fixed is None
        self.threads = fixed or self.cores
        self.others = 0.0  # cores other processes kept busy over the last interval
        if self.threads != torch.get_num_threads():
            torch.set_num_threads(self.threads)
        self._cpus = allowed_cpus()
        self._mark = self._sample()

    def _sample(self) -> tuple[float, float | None, float] | None:
        if not self.fitting:
            return None
        return time.monotonic(), _busy_seconds(self._cpus), _own_seconds()

    def update(self) -> int:
        """Measures the load others put on this process's cores since the last call, sets the thread count to the
        cores they left free (at least one), and returns it."""
        if not self.fitting:
            return self.threads
        if time.monotonic() - self._mark[0] < WINDOW_S:  # too short to tell a busy core from a burst: keep the mark
            return self.threads
        then, now = self._mark, self._sample()
        self._mark, wall = now, now[0] - then[0]
        if then[1] is None or now[1] is None:
            return self.threads
        busy = (now[1] - then[1]) / wall  # cores busy on average, everyone's
        own = (now[2] - then[2]) / wall
        self.others = max(0.0, busy - own)
        # a core counts as taken once other processes kept it busy for most of the window (rounding at 0.6)
        threads = max(1, min(self.cores, len(self._cpus) - math.floor(self.others + 0.4)))
        if threads != self.threads:
            self.torch.set_num_threads(threads)
            self.threads = threads
        return threads
