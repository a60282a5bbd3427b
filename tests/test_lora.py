"""LoRA (`model.lora.*`): the gradient of each adapter is the chain rule through the full model's gradient, the
reference is the base with the adapter off (no second model), merged weights and saved adapters compute what the
adapted model computes, and every method trains with it."""

import json
import subprocess
import sys

import pytest
import torch
from cli_helpers import assert_one_line_error, posttrain, posttrain_here

from posttrain import config
from posttrain.backends.ddp import DDP
from posttrain.core.aggregation import Totals
from posttrain.models import lora
from posttrain.models.scoring import token_logprobs
from posttrain.sources import run_splits
from posttrain.train import build, run

TASK = ["data.difficulty=1", "data.train_size=50", "data.test_size=5"]  # the warm model's task: a±b
SMALL = ["train.precision=fp32", "train.batch_size=2", "algorithm.group_size=4", "data.train_size=50",
         "data.test_size=5"]


def engine(model_dir, tmp_path, *extra, recipe="grpo_math"):
    cfg, _ = config.load(recipe, [f"model.path={model_dir}", f"output_dir={tmp_path}", *SMALL, *extra])
    return build(cfg, model_dir, DDP(), run_splits(cfg))


def adapted_layers(model):
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in lora.hf_model(model).named_modules() if isinstance(m, LoraLayer)}


def randomise_b(model, seed=0):
    """B = 0 at the start makes the adapted model the base; a random B makes the checks below non-trivial."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in adapted_layers(model).values():
            b = layer.lora_B["default"].weight
            b.copy_(torch.randn(b.shape, generator=g) * 0.05)


def fixed_batch(full, model_dir):
    torch.manual_seed(0)
    batch = full.rollout.generate([[5, 6, 7], [8, 9]], 4, max_new_tokens=8)
    batch.reward = torch.tensor([1.0, 0, 0, 1, 0, 1, 1, 1])
    return batch


def test_adapter_gradients_are_the_chain_rule_of_the_full_gradient(tiny_model_dir, tmp_path):
    """For W' = W + s·B·A, ∂L/∂B = s·G·Aᵀ and ∂L/∂A = s·Bᵀ·G, where G = ∂L/∂W' is what full fine-tuning of the
    merged model computes: the same loss and GC, only the trained set differs. The reference of the LoRA run is the
    base (adapter off), which is what the full run loads as its reference."""
    adapted = engine(tiny_model_dir, tmp_path / "lora", "algorithm.beta=0.1", "model.lora.r=4", "model.lora.alpha=8")
    randomise_b(adapted.policy.module)
    full = engine(tiny_model_dir, tmp_path / "full", "algorithm.beta=0.1")
    merged = dict(lora.merged_weights(adapted.policy.module))
    missing, unexpected = full.policy.module.load_state_dict(merged, strict=False)  # computes what the adapted does
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # the tiny model ties its head to the embedding
    batch = fixed_batch(full, tiny_model_dir)
    grads = {}
    for name, eng in (("full", full), ("lora", adapted)):
        b = batch.select(torch.arange(len(batch)))
        b.ref_logp = eng.reference_logp(b)
        b, _ = eng.plugin.prepare(b, eng.cfg.algorithm)
        eng.accumulate(b, Totals.of(b.mask))
        grads[name] = {n: p.grad for n, p in eng.policy.module.named_parameters() if p.grad is not None}
        if name == "full":
            ref_full = b.ref_logp
        else:
            torch.testing.assert_close(b.ref_logp, ref_full)  # adapter off = the base = the full run's reference
    layers = adapted_layers(adapted.policy.module)
    assert len(layers) == 2 * 7  # all-linear: q, k, v, o, gate, up, down in each of the 2 layers
    assert all(".lora_" in n for n in grads["lora"])  # nothing but the adapters has a gradient
    for owner, layer in layers.items():
        a, b, s = layer.lora_A["default"].weight, layer.lora_B["default"].weight, layer.scaling["default"]
        assert s == 8 / 4
        g = grads["full"][f"{owner}.weight"]  # [out, in]
        assert g.abs().sum() > 0
        prefix = f"base_model.model.{owner}"
        torch.testing.assert_close(grads["lora"][f"{prefix}.lora_B.default.weight"], s * g @ a.T, atol=2e-6, rtol=1e-4)
        torch.testing.assert_close(grads["lora"][f"{prefix}.lora_A.default.weight"], s * b.T @ g, atol=2e-6, rtol=1e-4)


def test_reference_is_the_base_with_the_adapter_off_and_no_model_is_loaded(tiny_model_dir, tmp_path):
    adapted = engine(tiny_model_dir, tmp_path / "lora", "algorithm.beta=0.1", "model.lora.r=4")
    assert adapted.ref is None and adapted.ref_is_base and "reference_weights" not in adapted.roles.peak
    randomise_b(adapted.policy.module)
    full = engine(tiny_model_dir, tmp_path / "full", "algorithm.beta=0.1")
    batch = fixed_batch(full, tiny_model_dir)
    base = full.score(full.policy.module, batch)
    torch.testing.assert_close(adapted.reference_logp(batch), base)
    policy = adapted.score(adapted.policy.module, batch)
    assert (policy - base).abs().max() > 1e-3  # the adapter is on again afterwards, and it changes the policy
    counts = adapted.parameters
    assert 0 < counts["trained"] < 0.2 * counts["total"]


def test_merged_weights_and_saved_adapter_compute_what_the_adapted_model_computes(tiny_model_dir, tmp_path):
    import peft
    from transformers import AutoModelForCausalLM

    adapted = engine(tiny_model_dir, tmp_path / "lora", "model.lora.r=4", "model.lora.target_modules=q_proj,v_proj")
    model = adapted.policy.module
    randomise_b(model)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert [n for n, _ in lora.merged_weights(model)] == [n for n, _ in plain.named_parameters()]
    ids = torch.randint(3, 20, (2, 9))
    with torch.no_grad():
        want = token_logprobs(model, ids, torch.ones_like(ids), 4)
        adapted.backend.save(adapted.policy, adapted.tokenizer, tmp_path / "merged", merged=True)
        adapted.backend.save(adapted.policy, adapted.tokenizer, tmp_path / "adapter")
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
        torch.testing.assert_close(token_logprobs(merged, ids, torch.ones_like(ids), 4), want)
        config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == str(tiny_model_dir.resolve())
        assert config["target_modules"] and set(config["target_modules"]) == {"q_proj", "v_proj"}
        reloaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                                                  tmp_path / "adapter")
        torch.testing.assert_close(token_logprobs(reloaded, ids, torch.ones_like(ids), 4), want)
    assert not (tmp_path / "adapter" / "model.safetensors").exists()  # the adapter alone, not a second model


@pytest.mark.parametrize("recipe", ["sft_math", "rft_math", "online_rft_math", "dpo_math", "ppo_math", "grpo_math"])
def test_every_method_trains_its_adapters_only(recipe, warm_model_dir, tmp_path):
    cfg, resolved = config.load(recipe, [
        f"model.path={warm_model_dir}", f"output_dir={tmp_path / recipe}", "model.lora.r=4", "train.steps=2",
        "train.batch_size=4", "eval.num_problems=0", "rollout.max_new_tokens=8", "data.difficulty=1",
        "data.train_size=40", "data.test_size=5"])
    summary = run(cfg, resolved, quiet=True)
    roles = summary["memory"]["roles_bytes"]
    assert "reference_weights" not in roles
    assert summary["parameters"]["trained"] < 0.2 * summary["parameters"]["total"]
    assert roles["policy_optimizer_state"] <= 8 * summary["parameters"]["trained"] + 1024  # AdamW of the adapters
    out = tmp_path / recipe / "model"
    assert (out / "adapter_config.json").is_file() and not (out / "model.safetensors").exists()
    if recipe == "ppo_math":  # the critic: its own adapter and a trained value head on its own copy of the base
        assert roles["critic_optimizer_state"] < roles["critic_weights"]
    import peft
    from transformers import AutoModelForCausalLM

    before = dict(AutoModelForCausalLM.from_pretrained(warm_model_dir).named_parameters())  # B = 0: the base
    trained = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(warm_model_dir), out)
    after = dict(lora.merged_weights(trained))
    assert after.keys() == before.keys()
    assert any(not torch.equal(after[n], before[n]) for n in before)  # the adapters moved the weights


def test_cli_lora_run_writes_adapter_and_merged_model(warm_model_dir, tmp_path):
    """A model sometimes right (the warm one, on a±b), so GRPO's rewards differ and the adapters really move."""
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "posttrain", "run", "recipe=grpo_math", f"model.path={warm_model_dir}",
                           f"output_dir={out}", "model.lora.r=4", "model.lora.merge=true", "train.steps=2", "train.lr=1e-2",
                           *TASK, "eval.num_problems=4", "rollout.max_new_tokens=6", *SMALL], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["parameters"]["trained"] < summary["parameters"]["total"]
    assert (out / "model" / "adapter_model.safetensors").is_file()
    assert (out / "merged_model" / "config.json").is_file() and (out / "merged_model" / "model.safetensors").is_file()
    again = posttrain_here("run", "recipe=grpo_math", f"model.path={out / 'model'}", f"output_dir={tmp_path / 'again'}",
                           "train.steps=1", *SMALL)
    assert_one_line_error(again, "holds a LoRA adapter, not a model", "merged_model/")

    # what `posttrain eval` loads for the adapter computes as merged_model/, and not as the base it started from
    from transformers import AutoModelForCausalLM

    adapted, _ = lora.load_adapted(out / "model", warm_model_dir, "float32")
    ids = torch.arange(3, 15)[None]  # [1, 12]
    with torch.no_grad():
        logits = [m(ids).logits for m in (adapted, AutoModelForCausalLM.from_pretrained(out / "merged_model"),
                                          AutoModelForCausalLM.from_pretrained(warm_model_dir))]
    torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=1e-5)
    assert (logits[0] - logits[2]).abs().max() > 1e-3  # the adapter moved them
    # `posttrain eval` takes the adapter, from another directory: on its base, it answers as merged_model/
    assert summary["adapter_base"] == {"path": str(warm_model_dir.resolve()), "copy": None}
    evals = {}
    for name in ("model", "merged_model"):
        proc = posttrain("eval", out / name, *TASK, "eval.num_problems=4", "rollout.max_new_tokens=6",
                         "train.precision=fp32", "-o", tmp_path / f"{name}.json", cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        evals[name] = json.loads((tmp_path / f"{name}.json").read_text())
    assert evals["model"]["adapter_base"] == str(warm_model_dir.resolve()) and "adapter_base" not in evals["merged_model"]
    assert evals["model"]["greedy"] == summary["eval_after"]["accuracy"]  # the run's own evaluation, repeated
    assert [r["greedy"] for r in evals["model"]["records"]] == [r["greedy"] for r in evals["merged_model"]["records"]]
    # the base gone: one line naming it and the way out; --base DIR gives it
    moved = tmp_path / "moved_base"
    warm_model_dir.rename(moved)
    try:
        assert_one_line_error(posttrain("eval", out / "model", "-o", tmp_path / "x.json"),
                              f"'{warm_model_dir.resolve()}' (named in adapter_config.json) is not there", "--base DIR")
        proc = posttrain("eval", out / "model", "--base", moved, *TASK, "eval.num_problems=4",
                         "rollout.max_new_tokens=6", "train.precision=fp32", "-o", tmp_path / "based.json")
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert json.loads((tmp_path / "based.json").read_text())["greedy"] == evals["model"]["greedy"]
    finally:
        moved.rename(warm_model_dir)


@pytest.mark.parametrize("key, fragment", [
    ("model.lora.r=4 model.lora.target_modules=nope", "model.lora.target_modules: "),
    ("model.lora.r=-1", "model.lora.r: must be ≥ 0"),
    ("model.lora.dropout=1", "model.lora.dropout: must be in [0, 1)"),
])
def test_bad_lora_keys_exit_2_with_one_line(tiny_model_dir, tmp_path, key, fragment):
    proc = subprocess.run([sys.executable, "-m", "posttrain", "run", "recipe=grpo_math", f"model.path={tiny_model_dir}",
                           f"output_dir={tmp_path / 'x'}", *key.split(), "train.steps=1", *SMALL], capture_output=True,
                          text=True)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], proc.stderr
    assert not (tmp_path / "x").exists()
