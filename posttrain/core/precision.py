"""Which precision the hardware computes fast: `train.precision=auto` and what `posttrain env` reports.

bf16 is only fast where the device has bf16 arithmetic. A CUDA device from Ampere on has it; on a CPU it takes
AVX512-BF16 or AMX. Elsewhere torch still runs bf16, by converting to fp32 element by element: on an AVX2-only CPU a
bf16 matmul ran at 0.8 GFLOP/s against 34–48 GFLOP/s in fp32 (about 50× slower). So `auto` is:

- CUDA with bf16: `bf16-mixed`; CUDA without it (V100, T4): `fp16-mixed`, fp16 compute with fp32 master weights
  and a dynamic loss scale (`posttrain.backends.loss_scale`);
- a CPU with AVX512-BF16 or AMX: `bf16-mixed`; any other CPU: `fp32`.

The CPU flags come from torch's own checks (`torch.cpu._is_avx512_bf16_supported`, `_is_amx_tile_supported`). When
they cannot tell, because the kernels were capped below what the CPU has (`ATEN_CPU_CAPABILITY`, or oneDNN's
`ONEDNN_MAX_CPU_ISA`), a short probe times a bf16 and an fp32 matmul and decides (about 0.2 s). The probe also gives
the slowdown quoted when a run asks for bf16 explicitly on a CPU that emulates it.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass

import torch

MIXED = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}  # autocast dtype of each mixed precision
LOW = {"bf16-mixed": "bf16", "bf16": "bf16", "fp16-mixed": "fp16"}  # the low-precision arithmetic each one runs


@dataclass(frozen=True)
class Choice:
    """What `resolve` picked: the precision that runs, and why, in words for the run's one line."""

    precision: str
    reason: str
    requested: str


def cpu_flags() -> dict[str, bool | str]:
    """What the CPU has (torch's checks) and what torch's kernels use of it (`get_cpu_capability`)."""
    cpu = torch.cpu  # a check this torch lacks reads as False
    flags = {name: bool(getattr(cpu, f"_is_{name}_supported", lambda: False)())
             for name in ("avx2", "avx512", "vnni", "avx512_bf16", "amx_tile", "amx_fp16")}
    flags["kernels"] = torch.backends.cpu.get_cpu_capability()  # DEFAULT, AVX2, AVX512 (ATEN_CPU_CAPABILITY caps it)
    return flags


def cpu_class(flags: dict | None = None) -> str:
    """The CPU class every figure in the docs names: "AVX-512 with AMX", "AVX-512 with bf16", "AVX-512 without bf16",
    "AVX2 only" or "no AVX2"."""
    f = flags or cpu_flags()
    if f["amx_tile"]:
        return "AVX-512 with AMX"
    if f["avx512_bf16"]:
        return "AVX-512 with bf16"
    if f["avx512"]:
        return "AVX-512 without bf16"
    return "AVX2 only" if f["avx2"] else "no AVX2"


def capped() -> list[str]:
    """The environment variables that keep torch's CPU kernels below what the CPU has (set, and not "ALL")."""
    return [name for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")
            if os.environ.get(name, "").strip().lower() not in ("", "all", "default")]


def _rate(dtype: torch.dtype, n: int, budget_s: float) -> float:
    """GFLOP/s of an n×n matmul in `dtype` on the CPU: the best of repeats within `budget_s` (one at least)."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    a @ b  # first call: oneDNN builds its kernel
    best, end = float("inf"), time.perf_counter() + budget_s
    while True:
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() > end:
            return 2 * n**3 / best / 1e9


@functools.lru_cache(maxsize=1)
def matmul_rates(n: int = 256, budget_s: float = 0.1) -> dict[str, float]:
    """Measured fp32, bf16 and fp16 matmul GFLOP/s on this CPU (once per process, about 0.3 s)."""
    return {"fp32": _rate(torch.float32, n, budget_s), "bf16": _rate(torch.bfloat16, n, budget_s),
            "fp16": _rate(torch.float16, n, budget_s)}


def cpu_bf16(flags: dict | None = None) -> tuple[bool, str]:
    """Whether this CPU computes bf16 natively, and how that was decided, for the run's line."""
    f = flags or cpu_flags()
    has = [name for name, key in (("AMX", "amx_tile"), ("AVX512-BF16", "avx512_bf16")) if f[key]]
    if not has:
        return False, f"this CPU ({cpu_class(f)}) has no bf16 arithmetic"
    caps = capped()
    if not caps:
        return True, f"this CPU has {' and '.join(has)}"
    rates = matmul_rates()
    native = rates["bf16"] >= rates["fp32"]  # native bf16 is 2-8× fp32; emulated, 20-50× slower
    return native, (f"this CPU has {' and '.join(has)} but {', '.join(caps)} caps the kernels: bf16 matmuls measured "
                    f"{rates['bf16']:.1f} GFLOP/s against {rates['fp32']:.1f} in fp32")


def resolve(requested: str, device: torch.device | str, allowed: tuple[str, ...] = ()) -> Choice:
    """The precision that runs for `train.precision=requested` on `device`; anything but `auto` runs as asked.
    `allowed`: the precisions the backend runs (empty: all); one `auto` would pick outside them becomes fp32."""
    device = torch.device(device)
    if requested != "auto":
        return Choice(requested, "as configured", requested)
    choice = _auto(device)
    if allowed and choice.precision not in allowed:
        return Choice("fp32", f"{choice.reason}, which this backend does not run", requested)
    return choice


def _auto(device: torch.device) -> Choice:
    requested = "auto"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return Choice("bf16-mixed", f"{name} computes bf16", requested)
        return Choice("fp16-mixed", f"{name} has no bf16: fp16 with loss scaling", requested)
    if device.type != "cpu":
        return Choice("fp32", f"no mixed precision chosen for {device.type} devices", requested)
    native, why = cpu_bf16()
    return Choice("bf16-mixed" if native else "fp32", why, requested)


def emulation_warning(precision: str, device: torch.device | str) -> str | None:
    """A one-line warning when `precision` asks a CPU for low-precision arithmetic it only emulates, with the
    slowdown measured here; None when it is native (or not a CPU, or fp32)."""
    if torch.device(device).type != "cpu" or precision not in LOW:
        return None
    low = LOW[precision]
    if low == "bf16" and cpu_bf16()[0]:
        return None
    rates = matmul_rates()
    slowdown = rates["fp32"] / rates[low]
    if slowdown < 1.5:
        return None
    return (f"train.precision={precision}: this CPU ({cpu_class()}) emulates {low}: {low} matmuls measured "
            f"{slowdown:.0f}x slower than fp32 here ({rates[low]:.1f} against {rates['fp32']:.1f} GFLOP/s); "
            f"train.precision=auto picks {resolve('auto', device).precision} on it")
