"""train.precision: bf16 and fp16 compute really run (autocast, or bf16 weights), log-probs stay float32, and the
policy gradient stays within a stated bound of the fp32 one; fp16-mixed's loss scale skips an overflowing step and
changes nothing else; `auto` follows the hardware. fp32 is checked exactly by every other gradient test."""

import json

import pytest
import torch

from posttrain import config
from posttrain.backends.ddp import DDP
from posttrain.core import precision
from posttrain.core.aggregation import Totals
from posttrain.sources import run_splits
from posttrain.train import build, run


def grpo_gradient(model_dir, tmp_path, precision):
    """One GRPO backward on a fixed batch (the fp32 engine samples it, with seed 0) under `precision`; returns the
    engine, the float32 gradient and the dtypes the first attention projection computed in."""
    cfg, _ = config.load("grpo_math", [f"model.path={model_dir}", f"output_dir={tmp_path / precision}",
                                       f"train.precision={precision}", "algorithm.beta=0.1", "train.batch_size=2",
                                       "algorithm.group_size=4", "data.train_size=50", "data.test_size=5"])
    engine = build(cfg, model_dir, DDP(precision=precision), run_splits(cfg))
    torch.manual_seed(0)
    sampler = build(config.load("grpo_math", [f"model.path={model_dir}", "data.train_size=50",
                                               "data.test_size=5"])[0], model_dir, DDP(), run_splits(cfg)).rollout
    batch = sampler.generate([[5, 6, 7], [8, 9]], 4, max_new_tokens=8)
    batch.reward = torch.tensor([1.0, 0, 0, 1, 0, 1, 1, 1])
    batch.ref_logp = engine.score(engine.ref, batch)
    batch, _ = engine.plugin.prepare(batch, cfg.algorithm)
    seen = []
    layer = engine.policy.module.model.layers[0].self_attn.q_proj
    hook = layer.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    engine.accumulate(batch, Totals.of(batch.mask))
    hook.remove()
    grad = torch.cat([p.grad.float().flatten() for p in engine.policy.module.parameters()])
    return engine, grad, set(seen), batch


@pytest.fixture(scope="module")
def fp32(tiny_model_dir, tmp_path_factory):
    return grpo_gradient(tiny_model_dir, tmp_path_factory.mktemp("fp32"), "fp32")


@pytest.mark.parametrize("precision, bound", [("bf16-mixed", 0.02), ("bf16", 0.02), ("fp16-mixed", 0.005)])
def test_low_precision_gradient_is_close_to_fp32(fp32, tiny_model_dir, tmp_path, precision, bound):
    """‖g − g_fp32‖ / ‖g_fp32‖ below the bound, and the low-precision path really ran: bf16 (fp16) compute under
    autocast with fp32 weights, gradients and AdamW state (bf16-mixed, fp16-mixed), or everything in bf16 (bf16).
    fp16 keeps 10 mantissa bits to bf16's 7, hence its tighter bound."""
    _, want, seen_fp32, _ = fp32
    engine, got, seen, batch = grpo_gradient(tiny_model_dir, tmp_path, precision)
    low = torch.float16 if precision == "fp16-mixed" else torch.bfloat16
    assert seen_fp32 == {torch.float32} and seen == {low}
    params = list(engine.policy.module.parameters())
    weights = torch.bfloat16 if precision == "bf16" else torch.float32
    if precision == "fp16-mixed":  # the gradient was unscaled by the step below; before it, it is S times larger
        assert engine.policy.scale is not None and engine.policy.scale.scale == 2.0**16
        got = got / engine.policy.scale.scale
    assert {p.dtype for p in params} == {p.grad.dtype for p in params} == {weights}
    assert {p.dtype for p in engine.ref.parameters()} == {low}
    assert engine.score(engine.ref, batch).dtype == torch.float32
    error = ((got - want).norm() / want.norm()).item()
    print(f"{precision}: relative gradient error {error:.4f}")
    assert 0 < error < bound
    engine.backend.step(engine.policy, 1.0)
    state = engine.policy.optimizer.state[params[0]]
    assert state["exp_avg"].dtype == weights


def linear_pair(precision: str):
    """Two copies of one small linear model, trained under fp32 and under `precision` (DDP on one process)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    twin = torch.nn.Linear(8, 1)
    twin.load_state_dict(model.state_dict())
    return (DDP(precision="fp32").train(model, lr=0.1, weight_decay=0.0),
            DDP(precision=precision).train(twin, lr=0.1, weight_decay=0.0))


def test_the_loss_scale_skips_an_overflowing_step_and_changes_nothing_else():
    """fp16-mixed: a loss whose scaled gradient overflows skips the step (weights and AdamW state unchanged) and
    halves S; a finite one gives exactly the fp32 update, since S is a power of two; after `growth_interval` finite
    steps S doubles."""
    plain, scaled = linear_pair("fp16-mixed")
    backend = DDP(precision="fp16-mixed")
    assert plain.scale is None and scaled.scale.scale == 2.0**16
    x = torch.randn(4, 8)
    before = [p.detach().clone() for p in scaled.module.parameters()]
    backend.backward(scaled.module(x).sum() * 1e35, scaled)  # finite, but times 2^16 it overflows fp32
    norm = backend.step(scaled, 1.0)
    assert not torch.isfinite(norm)
    assert all(torch.equal(a, b) for a, b in zip(before, scaled.module.parameters()))
    assert scaled.optimizer.state_dict()["state"] == {} and scaled.scale.scale == 2.0**15
    for trained in (plain, scaled):
        backend.backward(trained.module(x).square().mean(), trained)
    assert torch.equal(DDP().step(plain, 1.0), backend.step(scaled, 1.0))
    assert all(torch.equal(a, b) for a, b in zip(plain.module.parameters(), scaled.module.parameters()))
    assert scaled.scale.scale == 2.0**15 and scaled.scale.good_steps == 1
    scaled.scale.growth_interval = 2
    backend.backward(scaled.module(x).square().mean(), scaled)
    backend.step(scaled, 1.0)
    assert scaled.scale.scale == 2.0**16 and scaled.scale.good_steps == 0


def test_the_loss_scale_is_in_the_training_state(tmp_path):
    """A resumed fp16-mixed run continues with the loss scale it stopped at."""
    _, trained = linear_pair("fp16-mixed")
    backend = DDP(precision="fp16-mixed")
    trained.scale.scale, trained.scale.good_steps = 512.0, 7
    backend.save_state(trained, tmp_path)
    _, fresh = linear_pair("fp16-mixed")
    backend.load_state(fresh, tmp_path)
    assert fresh.scale.state_dict() == {"scale": 512.0, "good_steps": 7}


FLAGS = {"avx2": True, "avx512": False, "vnni": False, "avx512_bf16": False, "amx_tile": False, "amx_fp16": False,
         "kernels": "AVX2"}


@pytest.mark.parametrize("flags, caps, rates, want", [
    ({}, False, None, "fp32"),  # AVX2 only: no bf16 arithmetic, no probe
    ({"avx512": True, "kernels": "AVX512"}, False, None, "fp32"),  # AVX-512 without bf16
    ({"avx512": True, "avx512_bf16": True, "kernels": "AVX512"}, False, None, "bf16-mixed"),
    ({"avx512": True, "avx512_bf16": True, "amx_tile": True, "kernels": "AVX512"}, False, None, "bf16-mixed"),
    # the kernels capped below the CPU: the probe decides
    ({"avx512": True, "avx512_bf16": True}, True, {"fp32": 170.0, "bf16": 2.3, "fp16": 2.3}, "fp32"),
    ({"avx512": True, "avx512_bf16": True}, True, {"fp32": 170.0, "bf16": 600.0, "fp16": 2.3}, "bf16-mixed"),
])
def test_auto_on_a_cpu_follows_its_bf16_arithmetic(monkeypatch, flags, caps, rates, want):
    monkeypatch.setattr(precision, "cpu_flags", lambda: {**FLAGS, **flags})
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2" if caps else "ALL")
    probed = []
    monkeypatch.setattr(precision, "matmul_rates", lambda: probed.append(1) or rates)
    choice = precision.resolve("auto", "cpu")
    assert choice.precision == want and choice.requested == "auto"
    assert bool(probed) == caps  # the probe runs only when the flags cannot tell
    assert precision.resolve("fp32", "cpu").precision == "fp32"  # anything else runs as asked


@pytest.mark.parametrize("bf16, allowed, want", [(True, (), "bf16-mixed"), (False, (), "fp16-mixed"),
                                                 (False, ("fp32", "bf16-mixed"), "fp32")])
def test_auto_on_a_gpu_is_bf16_or_fp16_with_loss_scaling(monkeypatch, bf16, allowed, want):
    """A GPU with bf16 runs bf16-mixed, one without it fp16-mixed; a backend without fp16-mixed (DeepSpeed's here)
    gets fp32."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a GPU")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: bf16)
    assert precision.resolve("auto", "cuda", allowed).precision == want


def test_auto_here_agrees_with_this_cpu():
    """On the machine the tests run on: bf16-mixed exactly where the CPU has AVX512-BF16 or AMX and nothing caps the
    kernels, and then bf16 matmuls measure faster than fp32; fp32 elsewhere."""
    flags, caps = precision.cpu_flags(), precision.capped()
    native = (flags["avx512_bf16"] or flags["amx_tile"]) and not caps
    rates = precision.matmul_rates()
    print(f"{precision.cpu_class(flags)}, caps {caps}: {rates}")
    choice = precision.resolve("auto", "cpu")
    if not caps:
        assert choice.precision == ("bf16-mixed" if native else "fp32")
    if choice.precision == "bf16-mixed":
        assert rates["bf16"] > rates["fp32"]
    warning = precision.emulation_warning("bf16-mixed", "cpu")
    assert (warning is None) == (choice.precision == "bf16-mixed")


def test_an_emulated_precision_warns_with_the_measured_slowdown(monkeypatch):
    monkeypatch.setattr(precision, "cpu_flags", lambda: dict(FLAGS))
    monkeypatch.setattr(precision, "matmul_rates", lambda: {"fp32": 100.0, "bf16": 2.0, "fp16": 4.0})
    warning = precision.emulation_warning("bf16-mixed", "cpu")
    assert "emulates bf16: bf16 matmuls measured 50x slower than fp32 here" in warning
    assert "train.precision=auto picks fp32" in warning
    assert "25x slower" in precision.emulation_warning("fp16-mixed", "cpu")
    assert precision.emulation_warning("fp32", "cpu") is None


def test_a_run_says_what_auto_chose_and_records_it(tiny_model_dir, tmp_path, capsys):
    """The run prints one line with the choice and its reason; summary.json records what ran beside what was asked,
    and config.yaml keeps `auto`."""
    cfg, resolved = config.load("grpo_math", [f"model.path={tiny_model_dir}", f"output_dir={tmp_path / 'run'}",
                                              "train.steps=1", "train.batch_size=2", "algorithm.group_size=2",
                                              "rollout.max_new_tokens=4", "data.train_size=20", "data.test_size=4",
                                              "eval.num_problems=0"])
    assert cfg.train.precision == "auto"
    summary = run(cfg, resolved, quiet=False)
    want = precision.resolve("auto", "cpu")
    lines = [line for line in capsys.readouterr().err.splitlines() if "train.precision=auto" in line]
    assert lines == [f"posttrain: train.precision=auto runs {want.precision}: {want.reason}"]
    saved = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["precision"] == saved["precision"] == want.precision and saved["precision_requested"] == "auto"
    assert "precision: auto" in (tmp_path / "run" / "config.yaml").read_text()
