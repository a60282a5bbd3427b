"""Two processes for real (torchrun over gloo on CPU), for each backend: each test first asserts that the world size
is 2 and that the backend asked for is the one that ran."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from posttrain.core import precision

HERE = Path(__file__).parent
# The DeepSpeed backends run when DeepSpeed is installed; CI installs it and sets POSTTRAIN_REQUIRE_DEEPSPEED=1, so
# that there a missing DeepSpeed fails these tests instead of skipping them.
needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None and not os.environ.get("POSTTRAIN_REQUIRE_DEEPSPEED"),
    reason="DeepSpeed is not installed (pip install 'posttrain[deepspeed]')")


def torchrun(*args, timeout=300, env=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env)


# Per-rank bytes of each role on 2 ranks, as a fraction of one process's under DDP: what each backend shards. ZeRO
# also keeps an fp32 master copy of the weights in its optimizer (half of it each), so its optimizer state is 3/4 of
# AdamW's two moments; ZeRO-2 holds whole the gradients of the weights its partition's edges cut.
SHARE = {"ddp": {"weights": 1, "gradients": 1, "optimizer_state": 1},
         "fsdp2": {"weights": 0.5, "gradients": 0.5, "optimizer_state": 0.5},
         "zero2": {"weights": 1, "gradients": 0.5, "optimizer_state": 0.75},
         "zero3": {"weights": 0.5, "gradients": 0.5, "optimizer_state": 0.75}}


LORA = ["model.lora.r=4", "model.lora.target_modules=q_proj,v_proj,down_proj"]


@pytest.fixture(scope="module")
def deep_model_dir(tmp_path_factory) -> Path:
    """The tiny model with 8 layers instead of 2: a weight cut by a ZeRO-2 partition's edge (held whole on both
    sides) is then a few percent of a rank's gradients, as in real models, not a tenth."""
    from posttrain.models.embedded import build_model_dir

    return build_model_dir(tmp_path_factory.mktemp("deep") / "model", hidden=32, layers=8, heads=2)


@pytest.fixture(scope="module")
def one_process(deep_model_dir, tmp_path_factory):
    """The reference: the same update in one plain process (DDP backend, world size 1), in full and under LoRA."""
    runs = {}
    for name, extra in (("full", []), ("lora", LORA)):
        out = tmp_path_factory.mktemp("one") / f"{name}.pt"
        single = subprocess.run([sys.executable, HERE / "update_step.py", deep_model_dir, out, "ddp", *extra],
                                capture_output=True, text=True, timeout=300)
        assert single.returncode == 0, single.stderr[-3000:]
        runs[name] = torch.load(out)
    return runs


def backends(*extra, slow=()):
    """Every backend, the DeepSpeed ones marked; then `extra` (backend, offload) cases. The ids in `slow` run under
    -m slow only: cases whose path another case of the same test covers, left out to keep CI's time."""
    cases = [*((b, "none") for b in SHARE), *extra]
    params = []
    for c in cases:
        id = c[0] if c[1] == "none" else f"{c[0]}-offload-{c[1]}"
        marks = [needs_deepspeed] if c[0].startswith("zero") else []
        params.append(pytest.param(*c, marks=marks + ([pytest.mark.slow] if id in slow else []), id=id))
    return params


# Under LoRA the sharded backends run in CI (ddp and zero2 hold whole weights, as in full training); of the offloads,
# zero3's (the others under -m slow).
@pytest.mark.parametrize("backend,offload,adapted", [
    *(pytest.param(*p.values, adapted, id=f"{p.id}-{'lora' if adapted else 'full'}",
                   marks=[*p.marks, *([pytest.mark.slow] if adapted and p.id in ("ddp", "zero2") else [])])
      for p in backends() for adapted in (False, True)),
    *(pytest.param(*p.values, False, marks=p.marks, id=p.id)  # offload moves bytes, not numbers: full training only
      for p in backends(("fsdp2", "params"), ("zero2", "optimizer"), ("zero3", "params"),
                        slow=("fsdp2-offload-params", "zero2-offload-optimizer"))[len(SHARE):])])
def test_two_rank_update_equals_one_process_on_the_same_global_batch(backend, offload, adapted, one_process,
                                                                    deep_model_dir, tmp_path):
    """Rows split over 2 ranks (2 micro-batches each) give the loss, gradient and step of one process holding all
    8 rows: the loss is normalised by the whole step's counts, and the backend's averaging undone. Each rank holds
    the bytes its backend shards to, and the saved model (or adapter) loads with the trained weights."""
    from transformers import AutoModelForCausalLM

    two = torchrun(HERE / "update_step.py", deep_model_dir, tmp_path / "two.pt", backend, f"train.offload={offload}",
                   *(LORA if adapted else []))
    assert two.returncode == 0, two.stderr[-3000:]
    one, both = one_process["lora" if adapted else "full"], torch.load(tmp_path / "two.pt")
    assert one["world_size"] == 1 and both["world_size"] == 2
    assert both["backend"] == {"ddp": "DDP", "fsdp2": "FSDP2", "zero2": "ZeRO2", "zero3": "ZeRO3"}[backend]
    assert both["offload"] == offload
    assert both["head"] == one["head"] == "ScoringHead"  # the chunked head ran inside the wrapped model's forward
    assert one["max"] == 0 and both["max"] == 1  # reduce(..., "max") across ranks (the mismatch's largest gap)
    assert both["loss"] == pytest.approx(one["loss"], rel=1e-6)
    assert both["norm"] == pytest.approx(one["norm"], rel=1e-5)  # the global gradient norm, before clipping
    assert sum(g.abs().sum() for g in one["grads"].values()) > 0
    assert (len(one["grads"]) < len(one["weights"])) == adapted  # under LoRA only the adapters have gradients
    unreadable = backend == "zero2" or (backend == "zero3" and offload != "none")  # see update_step.whole_grad
    assert len(both["grads"]) == (0 if unreadable else len(one["grads"]))
    for name, grad in one["grads"].items():
        if name in both["grads"]:
            torch.testing.assert_close(both["grads"][name], grad, atol=1e-6, rtol=1e-5)
        # AdamW's first step is lr·g/(|g| + ε): where |g| is near fp32 noise, equal-within-tolerance gradients can
        # still step differently, so the weights are compared where the gradient is well above that noise.
        clear = grad.abs() > 1e-5
        torch.testing.assert_close(both["weights"][name][clear], one["weights"][name][clear], atol=1e-6, rtol=1e-5)
    # ZeRO-2 with its optimizer offloaded keeps, in CPU memory, a buffer the micro-batches' gradients are summed in
    # beside the partition's gradient: twice the share of gradients
    shares = {**SHARE[backend], **({"gradients": 1} if (backend, offload) == ("zero2", "optimizer") else {})}
    for role, share in shares.items():
        assert both["roles"][role] == pytest.approx(one["roles"][role] * share, rel=0.1), role
    if not adapted and offload == "none":  # `posttrain estimate backend=… gpus=2` predicts each rank's bytes ±10%
        from posttrain.apps.estimate import estimate, model_spec

        rows = {r.role: r.gpu_bytes for r in estimate(model_spec(str(deep_model_dir)), "sft", gpus=2, dtype="fp32",
                                                      backend=backend).rows}
        predicted = {"weights": rows["policy parameters"], "gradients": rows["policy gradients"],
                     "optimizer_state": rows["policy AdamW moments"] + rows["policy fp32 master weights"]}
        for role, nbytes in predicted.items():
            assert both["roles"][role] == pytest.approx(nbytes, rel=0.10), role
    saved = AutoModelForCausalLM.from_pretrained(deep_model_dir if adapted else both["saved"])
    if adapted:
        from peft import PeftModel

        saved = PeftModel.from_pretrained(saved, both["saved"])
    assert type(saved.get_base_model() if adapted else saved).__name__ == "LlamaForCausalLM"
    for name, param in saved.named_parameters():
        torch.testing.assert_close(param.data, both["weights"][name], atol=0, rtol=0)


@pytest.mark.parametrize("backend,offload", backends(slow=("ddp", "zero2")))  # the sharded ones, where a miss hangs
def test_packed_token_budgets_with_uneven_counts_keep_the_update(backend, offload, one_process, deep_model_dir,
                                                                  tmp_path):
    """Token budgets of packed sequences over 2 ranks holding 6 and 2 rows: the ranks run 3 and 1 micro-batches of
    their own, the second pads with empty ones so that the backend's gathers and reductions pair, and loss, gradient
    and step are those of one process running 8 padded rows in micro-batches of 3."""
    two = torchrun(HERE / "update_step.py", deep_model_dir, tmp_path / "two.pt", backend, f"train.offload={offload}",
                   "train.micro_batch_tokens=70", "train.packing=true", "uneven")
    assert two.returncode == 0, two.stderr[-3000:]
    one, both = one_process["full"], torch.load(tmp_path / "two.pt")
    assert both["world_size"] == 2 and both["backend"] == {"ddp": "DDP", "fsdp2": "FSDP2", "zero2": "ZeRO2",
                                                            "zero3": "ZeRO3"}[backend]
    assert both["micro"] == {"fewest": 1, "most": 3, "run": 3, "packed": True}
    assert both["loss"] == pytest.approx(one["loss"], rel=1e-5)
    assert both["norm"] == pytest.approx(one["norm"], rel=1e-5)
    for name, grad in both["grads"].items():  # none readable under zero2 (see update_step.whole_grad): the norm is
        torch.testing.assert_close(grad, one["grads"][name], atol=1e-6, rtol=1e-5)
    for name, grad in one["grads"].items():
        clear = grad.abs() > 1e-5  # as in the test above: AdamW's first step amplifies noise where |g| is tiny
        torch.testing.assert_close(both["weights"][name][clear], one["weights"][name][clear], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("backend,offload,extra", [
    *(pytest.param(*p.values, [], marks=p.marks, id=p.id) for p in backends(slow=("zero2", "zero3"))),
    # LoRA where the weights are sharded (ZeRO-3's under -m slow: test_two_rank_update_equals_one_process_on_the_same_
    # global_batch[zero3-lora] trains it on two ranks, and fsdp2-lora here gathers and merges an adapter from shards)
    *(pytest.param(*p.values, ["model.lora.r=4", "model.lora.merge=true"],
                   marks=[*p.marks, *([pytest.mark.slow] if p.id == "zero3" else [])], id=f"{p.id}-lora")
      for p in backends() if p.id in ("fsdp2", "zero3"))])
def test_cli_run_on_two_ranks(tiny_model_dir, tmp_path, extra, backend, offload):
    """The README's multi-process command: `torchrun --nproc_per_node 2 -m posttrain run …` exits 0 on both ranks,
    training every weight or a LoRA adapter (whose reference is the base with the adapter off on each rank)."""
    out = tmp_path / "ddp"
    proc = torchrun("-m", "posttrain", "run", "recipe=grpo_math", f"model.path={tiny_model_dir}", f"output_dir={out}",
                    "train.steps=2", "train.batch_size=2", "algorithm.group_size=2", "train.micro_batch_size=3",
                    "rollout.max_new_tokens=6", "eval.num_problems=5", "eval.batch_size=2", "data.train_size=100",
                    "data.test_size=20",
                    f"train.backend={backend}", *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["backend"] == backend
    # rank 0's trained weights: every one under DDP and ZeRO-2, half of each under FSDP2 and ZeRO-3; in fp32 under
    # fp32 and bf16-mixed (what the recipe's auto picks where bf16 is native), except on DeepSpeed, whose bf16 holds
    # them in bf16 (and the fp32 copy in its optimizer)
    assert summary["precision"] == precision.resolve("auto", "cpu", ("fp32", "bf16-mixed")).precision
    width = 2 if backend.startswith("zero") and summary["precision"] == "bf16-mixed" else 4
    held = summary["memory"]["roles_bytes"]["policy_weights"] / (width * summary["parameters"]["total"])
    assert held == pytest.approx(SHARE[backend]["weights"], rel=0.02)
    if extra:  # the adapter, and the base with it merged in, gathered from the shards
        from transformers import AutoModelForCausalLM

        assert (out / "model" / "adapter_config.json").is_file()
        assert summary["parameters"]["trained"] < summary["parameters"]["total"]
        from peft import PeftModel

        merged = dict(AutoModelForCausalLM.from_pretrained(out / "merged_model").named_parameters())
        by_peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), out / "model")
        by_peft = dict(by_peft.merge_and_unload().named_parameters())
        assert merged.keys() == by_peft.keys()
        for name, param in by_peft.items():  # DeepSpeed's bf16 holds (and so writes) bf16 weights: one bf16 step
            tol = {"atol": 1e-6, "rtol": 2**-7 if merged[name].dtype == torch.bfloat16 else 1e-5}
            torch.testing.assert_close(merged[name].float(), param.to(merged[name].dtype).float(), **tol)
    # rank 0 scored 3 problems in 2 calls, rank 1 scored 2 in 1 (plus, sharded, a dummy call); the counts summed
    assert summary["eval_before"]["num_problems"] == 5
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert proc.stdout.count("held-out accuracy") == 1  # printed by rank 0 only


@pytest.mark.parametrize("launch", [[], pytest.param(["--num_machines", "1", "--num_processes", "2", "--main_process_ip",
                                                       "127.0.0.1", "--main_process_port", "0"], marks=pytest.mark.slow)],
                         ids=["one_node", "multi_node"])
def test_shipped_accelerate_configs_start_two_ranks(tiny_model_dir, tmp_path, launch):
    """`accelerate launch --config_file examples/accelerate/…` starts the processes (the multi-node file with its
    machine count and address overridden to this machine), and the run's train.backend shards over them."""
    name = "multi_node" if launch else "one_node"
    out = tmp_path / name
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
         HERE.parent / "examples" / "accelerate" / f"{name}.yaml", *launch, "-m", "posttrain", "run", "recipe=sft_math",
         f"model.path={tiny_model_dir}", f"output_dir={out}", "train.steps=1", "train.batch_size=2",
         "eval.num_problems=0", "data.train_size=20", "data.test_size=4", "train.backend=fsdp2"],
        capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["backend"] == "fsdp2"


@pytest.mark.parametrize("backend,offload", [p for p in backends() if p.id in ("fsdp2", "zero3")])
def test_every_role_is_sharded(tiny_model_dir, tmp_path, backend, offload):
    """PPO with a reward model on 2 ranks: the policy, its critic, the reference and the reward model each hold half
    of their weights on each rank (fp32: 4 bytes a weight)."""
    from transformers import AutoConfig, AutoTokenizer, LlamaForSequenceClassification

    from posttrain.models.loading import load

    rm_dir = tmp_path / "rm"
    LlamaForSequenceClassification(AutoConfig.from_pretrained(tiny_model_dir, num_labels=1)).save_pretrained(rm_dir)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(rm_dir)
    out = tmp_path / "ppo"
    proc = torchrun("-m", "posttrain", "run", "recipe=ppo_math", f"model.path={tiny_model_dir}", f"output_dir={out}",
                    f"reward_model.path={rm_dir}", "train.precision=fp32", "train.steps=1", "train.batch_size=2",
                    "rollout.max_new_tokens=6", "eval.num_problems=0", "data.train_size=20", "data.test_size=4",
                    f"train.backend={backend}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["backend"] == backend
    held = summary["memory"]["roles_bytes"]
    whole = {"policy_weights": load(tiny_model_dir)[0], "reference_weights": load(tiny_model_dir)[0],
             "critic_weights": load(tiny_model_dir, "critic")[0], "reward_model_weights": load(rm_dir, "reward_model")[0]}
    for role, model in whole.items():
        assert held[role] == pytest.approx(4 * model.num_parameters() / 2, rel=0.02), role


@pytest.mark.parametrize("backend,recipe,algorithm", [
    pytest.param("fsdp2", "grpo_math", ["algorithm.group_size=2"], id="fsdp2-grpo"),
    pytest.param("zero3", "ppo_math", ["algorithm.ppo_epochs=1"], marks=[needs_deepspeed], id="zero3-ppo")])
def test_sharded_state_resumes_bit_exactly_on_two_ranks(tiny_model_dir, tmp_path, backend, recipe, algorithm):
    """Both ranks killed between step 3 and its checkpoint, then resumed from step 2's, end with the bytes of a run
    never interrupted. Each rank wrote only its own shards of the training state (policy and, under PPO, critic)."""
    from posttrain.train import checkpoint

    def run(out, *extra, crash=None):
        env = {**os.environ, "OMP_NUM_THREADS": "1", **({"POSTTRAIN_CRASH_AT": crash} if crash else {})}
        args = ["-m", "posttrain", "run", f"recipe={recipe}", f"model.path={tiny_model_dir}", f"output_dir={out}",
                "train.steps=3", "train.batch_size=2", *algorithm, "train.save_every=1",
                "rollout.max_new_tokens=6", "eval.num_problems=0", "data.train_size=40", "data.test_size=4",
                "train.precision=fp32", f"train.backend={backend}", "-q", *extra]
        return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                               "2", *args], capture_output=True, text=True, timeout=300, env=env)

    whole = run(tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    killed = run(tmp_path / "killed", crash="step:3")
    assert killed.returncode != 0
    staging = tmp_path / "killed.partial"
    assert [p.name for p in checkpoint.complete(staging / "checkpoints")] == ["step_1", "step_2"]
    state = staging / "checkpoints" / "step_2" / "training_state"
    roles = ["critic", "policy"] if recipe == "ppo_math" else ["policy"]
    assert sorted(p.name for p in state.iterdir()) == roles
    for role in roles:  # one file of shards per rank, neither holding the whole (FSDP2 cuts unevenly: odd rows)
        shards = sorted(state.glob(f"{role}/**/*.distcp" if backend == "fsdp2" else f"{role}/**/*optim_states.pt"))
        assert len(shards) == 2, sorted(p.name for p in (state / role).rglob("*"))
        sizes = [p.stat().st_size for p in shards]
        assert max(sizes) < 0.6 * sum(sizes), sizes

    resumed = run(tmp_path / "killed", "resume=true")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((tmp_path / "killed" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["backend"] == backend and summary["resumed_from"]["step"] == 2
    assert (tmp_path / "killed" / "model" / "model.safetensors").read_bytes() == \
        (tmp_path / "whole" / "model" / "model.safetensors").read_bytes()


def test_two_ranks_warm_the_embedded_model_up_once(tmp_path):
    """README's `torchrun … run recipe=grpo_math` with nothing cached: the process that takes the lock warms the
    embedded model up in a process of its own (not one more training process, which the launcher's variables would
    make it, waiting forever for the other), the other waits for it or finds it cached, and both train from it."""
    out = tmp_path / "run"
    proc = torchrun("-m", "posttrain", "run", "recipe=grpo_math", f"output_dir={out}", "warmup.steps=4",
                    f"warmup.cache_dir={tmp_path / 'cache'}", "train.steps=1", "eval.num_problems=0",
                    "data.train_size=40", "data.test_size=4", timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("warming up the embedded tiny model") == 1  # one process warmed up, the other waited
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["warmup"]["path"].startswith(str(tmp_path / "cache"))
