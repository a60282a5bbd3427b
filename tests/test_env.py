"""`posttrain env`: the report a bug needs, as text and as JSON, and true to what a run does here."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from posttrain.core import precision, threads


def env(*args):
    return subprocess.run([sys.executable, "-m", "posttrain", "env", *args], capture_output=True, text=True,
                          env={k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"})


def test_env_json_says_what_a_run_will_do_here():
    proc = env("--json")
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    for name in ("posttrain", "python", "torch", "transformers", "accelerate", "peft", "datasets"):
        assert r["versions"][name] not in (None, "not installed"), name
    assert r["versions"]["torch"] == torch.__version__
    assert r["device"]["type"] == ("cuda" if torch.cuda.is_available() else "cpu")
    cpu = r["cpu"]
    assert cpu["class"] == precision.cpu_class() and cpu["flags"]["kernels"] == torch.backends.cpu.get_cpu_capability()
    assert all(rate > 0 for rate in cpu["matmul_gflops"].values())
    cpuinfo = open("/proc/cpuinfo").read()
    for flag, name in (("avx2", "avx2"), ("avx512_bf16", "avx512_bf16"), ("amx_tile", "amx_tile")):
        assert cpu["flags"][name] == (f" {flag}" in cpuinfo), name  # what the CPU has, as the kernel lists it
    assert r["precision_auto"]["precision"] == precision.resolve("auto", "cpu").precision
    assert cpu["bf16"] == ("native" if r["precision_auto"]["precision"] == "bf16-mixed" else "emulated")
    assert r["threads"]["run_threads"] == threads.usable_cores() and r["threads"]["pinned_by"] is None
    assert r["cache_dir"] == os.environ["POSTTRAIN_CACHE"]


def test_env_text_has_one_line_per_item():
    proc = env()
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    for item in ("- posttrain: ", "- torch: ", "- device: ", "- cpu: ", "- bf16 on this cpu: ", "- matmul GFLOP/s",
                 "- threads a run uses: ", "- train.precision=auto: ", "- cache: "):
        assert item in text, item
