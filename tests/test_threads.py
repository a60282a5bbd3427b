"""Compute threads that fit the machine (posttrain/core/threads.py): the cores a process may use, fewer while another
process keeps some busy, and posttrain's own worker pools at one thread each."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

import pytest
import torch

from posttrain.core import threads
from posttrain.core.bounded import BoundedPool
from posttrain.core.errors import ConfigError


def test_cgroup_quotas_in_cores(tmp_path):
    """cgroup v2's cpu.max and v1's cfs quota and period, in cores; unlimited is None."""
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert threads.cgroup_quota(tmp_path) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert threads.cgroup_quota(tmp_path) is None
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("200000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert threads.cgroup_quota(tmp_path) == 2.0
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert threads.cgroup_quota(tmp_path) is None


def test_usable_cores_are_the_affinity_capped_by_the_quota_and_shared(monkeypatch):
    monkeypatch.setattr(threads, "allowed_cpus", lambda: {0, 1, 2, 3})
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert threads.usable_cores(quota=0) == 4  # 0: no quota
    assert threads.usable_cores(quota=2.5) == 3  # rounded up: 2.5 cores keep 3 threads busy part of the time
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert threads.usable_cores(quota=0) == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert threads.usable_cores(quota=0) == 1


def test_this_process_may_use_its_affinity():
    assert threads.usable_cores() <= len(os.sched_getaffinity(0))


def test_pinned_counts(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert threads.pinned(0) is None and threads.pinned(3) == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert threads.pinned(0) == 1 and threads.pinned(2) == 2  # train.threads wins over the environment


def test_omp_num_threads_that_is_no_count_is_refused(monkeypatch):
    """libgomp ignores such a value (with a complaint of its own); the run used to fit its threads as if unset."""
    for value in ("abc", "0", "-2", "1.5"):
        monkeypatch.setenv("OMP_NUM_THREADS", value)
        with pytest.raises(ConfigError, match=f"OMP_NUM_THREADS: '{value}' in the environment is not a thread count"):
            threads.pinned(0)
    monkeypatch.setenv("OMP_NUM_THREADS", "")
    assert threads.pinned(0) is None  # empty: unset
    monkeypatch.setenv("OMP_NUM_THREADS", "4,2")  # OpenMP's list by nesting level: the first level's
    assert threads.pinned(0) == 4


def test_counts_above_the_cores_are_refused(monkeypatch):
    """Thread and worker counts are checked against the cores the process may run on (affinity, cgroup quota)."""
    monkeypatch.setattr(threads, "allowed_cpus", lambda: {0, 1, 2, 3})
    monkeypatch.setattr(threads, "cgroup_quota", lambda root=threads.CGROUP: 2.5)  # 3 cores, rounded up
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    threads.check_counts(3, workers=3, worker_threads=1)
    with pytest.raises(ConfigError, match="train.threads: 4 threads on the 3 cores this process may use"):
        threads.check_counts(4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")  # a launcher may have bound each process to cores of its own: the
    threads.check_counts(3)  # share is for fitting threads (usable_cores), a refusal does not guess it
    assert threads.usable_cores() == 1
    threads.check_counts(1, workers=3, worker_threads=1)
    with pytest.raises(ConfigError, match="rollout.workers: 4 worker processes on the 3 cores"):
        threads.check_counts(1, workers=4)

@pytest.fixture
def restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_a_busy_core_costs_one_thread_until_it_is_free(monkeypatch, restore_threads):
    """With the busy time of the allowed cores and this process's own CPU time given, `update` runs one thread fewer
    for each core that others kept busy, never fewer than one, and all of them once the cores are free; it judges
    windows of at least WINDOW_S seconds, so a short burst between two steps costs nothing."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "allowed_cpus", lambda: {0, 1})
    monkeypatch.setattr(threads, "usable_cores", lambda quota=None: 2)
    clock = {"wall": 0.0, "busy": 0.0, "own": 0.0}
    monkeypatch.setattr(threads.time, "monotonic", lambda: clock["wall"])
    monkeypatch.setattr(threads, "_busy_seconds", lambda cpus: clock["busy"])
    monkeypatch.setattr(threads, "_own_seconds", lambda: clock["own"])
    fit = threads.ThreadFit(0)
    assert fit.fitting and fit.threads == torch.get_num_threads() == 2

    def interval(busy, own, seconds=threads.WINDOW_S):  # cores busy on average over `seconds`
        clock["wall"] += seconds
        clock["busy"] += busy * seconds
        clock["own"] += own * seconds
        return fit.update()

    assert interval(busy=2.0, own=2.0) == 2  # the run alone on both cores
    assert interval(busy=2.0, own=1.0) == 1 and torch.get_num_threads() == 1  # another process holds one core
    assert fit.others == pytest.approx(1.0)
    assert interval(busy=1.9, own=0.95) == 1
    assert interval(busy=2.0, own=0.3) == 1  # two cores taken: still one thread
    assert interval(busy=1.3, own=1.0) == 2  # a third of a core is noise, not a taken core
    assert torch.get_num_threads() == 2
    assert interval(busy=2.0, own=0.0, seconds=0.5) == 2  # a burst shorter than the window: not judged yet
    assert interval(busy=1.0, own=1.0, seconds=threads.WINDOW_S) == 2  # judged over both: 0.4 cores of others


def test_a_pinned_count_is_kept(monkeypatch, restore_threads):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    fit = threads.ThreadFit(0)
    assert not fit.fitting and fit.threads == 1 == torch.get_num_threads() and fit.update() == 1
    assert threads.ThreadFit(2).threads == 2 == torch.get_num_threads()


def test_a_real_busy_process_is_seen(monkeypatch, restore_threads):
    """The measurement itself, on this machine: a process spinning on a core while this one sleeps counts as about
    one busy core of others (this process's own CPU time is left out)."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    if len(threads.allowed_cpus()) < 2 or threads._busy_seconds(threads.allowed_cpus()) is None:
        pytest.skip("needs two cores and /proc/stat")
    fit = threads.ThreadFit(0)
    # not a child of this process (whose children's CPU time counts as its own): started by a shell that exits
    spinner = f"{sys.executable} -c 'import time\nend = time.time() + 6\nwhile time.time() < end: pass' >/dev/null 2>&1 & echo $!"
    pid = int(subprocess.run(["sh", "-c", spinner], capture_output=True, text=True, check=True).stdout)
    try:
        time.sleep(0.3)  # the spinner is up
        fit._mark = fit._sample()
        time.sleep(threads.WINDOW_S + 0.2)
        threads_now = fit.update()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)
    assert 0.6 < fit.others < 1.6, fit.others  # other machine load can add a little
    assert threads_now == max(1, min(fit.cores, len(threads.allowed_cpus()) - 1))


def _threads_in_worker(_):
    import torch

    return torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")


def test_pool_workers_compute_on_one_thread_and_fit_the_cores():
    pool = BoundedPool()
    try:
        assert pool.workers == min(4, threads.usable_cores())
        outcome = pool.map(_threads_in_worker, [0], timeout_s=60)[0]
        assert outcome.ok, outcome.error
        assert outcome.value == (1, "1")
    finally:
        pool.close()
