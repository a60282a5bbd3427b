"""Tests of the memory estimator: the textbook 7B/70B accounting, ZeRO sharding, offload, LoRA, the parameter count
against real transformers models, the KV-cache and activation formulas by hand, and the CLI's error messages.

The tiny spec used by the hand-worked cases (TINY): hidden h=16, 2 layers, 4 heads of head_dim 4, 2 kv heads,
intermediate i=32, vocab V=50, untied. So q_dim=16, kv_dim=8.
"""

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from posttrain.apps.estimate import (
    PRESETS,
    ModelSpec,
    activation_bytes,
    backend_classes,
    estimate,
    kv_cache_bytes,
    main,
    model_spec,
    offloads,
    render,
    state_bytes,
)
from posttrain.core.errors import UserError

TINY = ModelSpec("tiny", hidden=16, layers=2, heads=4, kv_heads=2, intermediate=32, vocab=50, tied=False)
B7 = ModelSpec("7b", 4096, 32, 32, 32, 11008, 32000, False, params_override=7_000_000_000)
B70 = ModelSpec("70b", 8192, 80, 64, 8, 28672, 128256, False, params_override=70_000_000_000)


def rows(est):
    return {r.role: r for r in est.rows}


def gpu(est):
    return {r.role: r.gpu_bytes for r in est.rows}


def test_7b_bf16_adamw_accounting():
    """7e9 params: 2 B weights = 14 GB, 2 B grads = 14 GB, 2 × 4 B fp32 moments = 56 GB, 4 B master = 28 GB."""
    g = gpu(estimate(B7, "sft"))
    assert g["policy parameters"] == 14e9
    assert g["policy gradients"] == 14e9
    assert g["policy AdamW moments"] == 56e9
    assert g["policy fp32 master weights"] == 28e9
    assert gpu(estimate(B7, "sft", master_weights=False))["policy fp32 master weights"] == 0
    assert gpu(estimate(B7, "sft", dtype="fp32"))["policy fp32 master weights"] == 0  # fp32 weights are the master
    assert state_bytes(B7).total == 112e9
    assert state_bytes(B7, trained=False).total == 14e9


def test_ppo_70b_holds_four_models_grpo_two():
    """PPO: policy, reference, critic, reward model at 140 GB of bf16 weights each; GRPO (rule reward): two."""
    ppo = rows(estimate(B70, "ppo"))
    assert ppo["policy parameters"].gpu_bytes == ppo["reference model"].gpu_bytes == 140e9
    assert ppo["reward model"].gpu_bytes == 140e9
    # The critic is trained like the policy: 140 weights + 140 grads + 560 moments + 280 master.
    assert ppo["critic (weights+grads+moments+master)"].gpu_bytes == (140 + 140 + 560 + 280) * 1e9
    grpo = rows(estimate(B70, "grpo"))
    frozen_or_trained_models = [r for r in grpo if r in ("reference model", "reward model") or "critic" in r]
    assert frozen_or_trained_models == ["reference model"] and grpo["reference model"].gpu_bytes == 140e9
    assert "reference model" not in rows(estimate(B70, "grpo", beta=0.0))
    assert "reward model" in rows(estimate(B70, "grpo", reward_model=True))
    assert "reward model" not in rows(estimate(B70, "ppo", reward_model=False))
    assert set(rows(estimate(B70, "dpo"))) >= {"reference model"} and "critic" not in str(rows(estimate(B70, "dpo")))


@pytest.mark.parametrize("zero, sharded", [
    (1, {"policy AdamW moments", "policy fp32 master weights"}),
    (2, {"policy AdamW moments", "policy fp32 master weights", "policy gradients"}),
    (3, {"policy AdamW moments", "policy fp32 master weights", "policy gradients", "policy parameters",
         "reference model", "reward model", "critic (weights+grads+moments+master)"}),
])
def test_zero_stages_divide_their_states_by_gpus(zero, sharded):
    one, eight = gpu(estimate(B7, "ppo")), gpu(estimate(B7, "ppo", gpus=8, zero=zero))
    for role in one:
        if role in ("rollout KV cache", "activations"):  # per-GPU batch: not sharded
            assert eight[role] == one[role]
        elif role.startswith("critic"):  # a sum of the four policy rows, each sharded at its own stage
            assert eight[role] == sum(eight[r] for r in eight if r.startswith("policy"))
        else:
            assert eight[role] == (one[role] / 8 if role in sharded else one[role]), role


def test_offload_reports_cpu_bytes():
    r = rows(estimate(B7, "sft", gpus=8, zero=2, offload="optimizer"))
    assert r["policy AdamW moments"].gpu_bytes == 0 and r["policy AdamW moments"].cpu_bytes == 56e9 / 8
    assert r["policy fp32 master weights"].cpu_bytes == 28e9 / 8
    assert r["policy parameters"].cpu_bytes == 0
    r = rows(estimate(B7, "dpo", gpus=8, zero=3, offload="all"))
    assert r["policy parameters"].gpu_bytes == 0 and r["policy parameters"].cpu_bytes == 14e9 / 8
    assert r["reference model"].cpu_bytes == 14e9 / 8
    assert r["policy gradients"].gpu_bytes == 14e9 / 8
    with pytest.raises(UserError, match="offload=all"):
        estimate(B7, "sft", zero=2, offload="all")
    # params, as a run's train.offload says; all, the estimator's first name for it, stays accepted
    assert rows(estimate(B7, "dpo", gpus=8, zero=3, offload="params")) == r
    with pytest.raises(UserError, match="^offload=params: parameter offload needs zero=3"):
        estimate(B7, "sft", zero=2, offload="params")


def test_backends_and_offloads_are_the_backends_own(monkeypatch):
    """The estimator knows backends and offloads only by what each backend declares: the offloads are those a run
    accepts (`train.offload`), each backend's ZeRO stage, fp32 master copy and offloads are its own, and a backend
    registered later is estimated by its declarations (this one shards as ZeRO-2, offloads only the optimizer and
    keeps an fp32 master copy: 7e9 fp32 weights are 28 GB, their gradients and master copy 28 GB / 8 each)."""
    from posttrain.backends import BACKENDS, Backend
    from posttrain.schema import OFFLOADS

    assert backend_classes() == dict(BACKENDS) and list(BACKENDS) == ["ddp", "fsdp2", "zero2", "zero3"]
    assert offloads() == OFFLOADS == ("none", "optimizer", "params")
    assert set(offloads()) == {o for cls in BACKENDS.values() for o in cls.offloads}
    for name, cls in BACKENDS.items():
        est = estimate(B7, "sft", gpus=8, dtype="fp32", backend=name)
        assert est.settings["zero"] == cls.zero_stage, name
        assert (gpu(est)["policy fp32 master weights"] > 0) == cls.fp32_master, name
        for offload in offloads():
            if offload in cls.offloads:
                estimate(B7, "sft", gpus=8, backend=name, offload=offload)
            else:
                with pytest.raises(UserError, match=f"^offload={offload}: backend={name} supports"):
                    estimate(B7, "sft", gpus=8, backend=name, offload=offload)

    class Toy(Backend):
        zero_stage, offloads, fp32_master = 2, ("none", "optimizer"), True

    monkeypatch.setitem(BACKENDS, "toy", Toy)
    toy = gpu(estimate(B7, "sft", gpus=8, dtype="fp32", backend="toy"))
    assert toy["policy parameters"] == 28e9 and toy["policy gradients"] == toy["policy fp32 master weights"] == 28e9 / 8
    assert rows(estimate(B7, "sft", gpus=8, backend="toy", offload="optimizer"))["policy AdamW moments"].gpu_bytes == 0
    with pytest.raises(UserError, match="^offload=params: backend=toy supports none or optimizer"):
        estimate(B7, "sft", gpus=8, backend="toy", offload="params")
    with pytest.raises(UserError, match="^backend=tpu: must be ddp or fsdp2 or zero2 or zero3 or toy"):
        main(["model=qwen2.5-7b", "backend=tpu"])


def _tiny_llama_config(**kw):
    return LlamaConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=48, vocab_size=101, **kw)


@pytest.mark.parametrize("config", [
    _tiny_llama_config(),
    _tiny_llama_config(tie_word_embeddings=True),
    _tiny_llama_config(attention_bias=True, mlp_bias=True),
    _tiny_llama_config(head_dim=16),  # head_dim × heads != hidden
    Qwen2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=48, vocab_size=101),  # biases on q, k, v
], ids=["llama", "llama-tied", "llama-biases", "llama-head_dim", "qwen2"])
def test_param_count_matches_a_real_model(tmp_path, config):
    torch.manual_seed(0)
    model = (Qwen2ForCausalLM if config.model_type == "qwen2" else LlamaForCausalLM)(config)
    model.save_pretrained(tmp_path)
    spec = model_spec(str(tmp_path))
    assert spec.n_params == sum(p.numel() for p in model.parameters())  # parameters() counts a tied matrix once


def test_tied_embeddings_save_one_vocab_matrix():
    tied = ModelSpec("t", 16, 2, 4, 2, 32, 50, tied=True)
    assert TINY.n_params - tied.n_params == 50 * 16


@pytest.mark.parametrize("name, published", [
    ("qwen2.5-0.5b", 0.49e9), ("qwen2.5-1.5b", 1.54e9), ("qwen2.5-7b", 7.61e9), ("qwen2.5-14b", 14.7e9),
    ("qwen2.5-32b", 32.5e9), ("qwen2.5-72b", 72.7e9), ("llama-7b", 6.74e9), ("llama-13b", 13.0e9),
    ("llama-3-8b", 8.03e9), ("llama-3-70b", 70.6e9), ("llama-3.2-1b", 1.24e9),
])
def test_presets_land_near_published_sizes(name, published):
    assert abs(PRESETS[name].n_params / published - 1) < 0.01


def test_kv_cache_by_hand():
    """2 · layers · kv_heads · head_dim · bytes · sequences · tokens.

    GRPO, batch=2, G=4 -> 8 sequences of 10 + 6 = 16 tokens in bf16: 2 · 2 · 2 · 4 · 2 · 8 · 16 = 8192 bytes.
    PPO samples once per prompt: 2 sequences -> 2048 bytes.
    """
    assert kv_cache_bytes(TINY, sequences=8, tokens=16) == 8192
    kw = {"batch": 2, "group": 4, "prompt_len": 10, "response_len": 6}
    assert gpu(estimate(TINY, "grpo", **kw))["rollout KV cache"] == 8192
    assert gpu(estimate(TINY, "ppo", **kw))["rollout KV cache"] == 2048
    assert "rollout KV cache" not in gpu(estimate(TINY, "sft", **kw))


def test_activations_by_hand():
    """16 tokens in bf16. Per token per layer: 4h + 2·q_dim + 2·kv_dim + 4i = 64 + 32 + 16 + 128 = 240 elements,
    so a layer keeps 2 · 16 · 240 = 7680 bytes; fp32 logits 4 · 16 · 50 = 3200 bytes.
    Without checkpointing: 2 layers · 7680 + 3200 = 18560. With it: layer inputs 2 · 2 · 16 · 16 = 1024, plus one
    layer 7680, plus logits 3200 = 11904.
    """
    assert activation_bytes(TINY, 16, grad_ckpt=False)[0] == 18560
    assert activation_bytes(TINY, 16, grad_ckpt=True)[0] == 11904
    # DPO runs chosen and rejected together: twice SFT's tokens, and every term is linear in tokens.
    assert gpu(estimate(TINY, "dpo", prompt_len=10, response_len=6))["activations"] == 2 * 11904


def test_total_counts_the_larger_of_kv_cache_and_activations():
    est = estimate(B7, "grpo", batch=4, group=16)
    g = gpu(est)
    states = sum(v for k, v in g.items() if k not in ("rollout KV cache", "activations"))
    assert est.gpu_total == states + max(g["rollout KV cache"], g["activations"])


def test_lora_trains_only_adapters():
    """Rank 8 on TINY: per layer Σ(d_in + d_out) over q, k, v, o, gate, up, down
    = 32 + 24 + 24 + 32 + 48 + 48 + 48 = 256, × 8 × 2 layers = 4096 adapter parameters."""
    assert TINY.lora_params(8) == 4096
    full, lora = rows(estimate(TINY, "dpo")), rows(estimate(TINY, "dpo", lora=8))
    assert lora["policy gradients"].gpu_bytes == 4096 * 2 < full["policy gradients"].gpu_bytes
    assert lora["policy AdamW moments"].gpu_bytes == 4096 * 8 < full["policy AdamW moments"].gpu_bytes
    assert lora["policy fp32 master weights"].gpu_bytes == 4096 * 4
    assert lora["policy parameters"].gpu_bytes == (TINY.n_params + 4096) * 2
    assert lora["reference model"].gpu_bytes == 0  # the frozen base with adapters disabled


def test_lora_count_matches_the_real_linear_shapes():
    """A [r, in] + B [out, r] on each adapted nn.Linear of a real Llama."""
    model = LlamaForCausalLM(_tiny_llama_config())
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    adapters = sum(4 * (m.in_features + m.out_features) for n, m in model.named_modules() if n.endswith(names))
    spec = ModelSpec("t", 32, 3, 4, 2, 48, 101, False)
    assert spec.lora_params(4) == adapters


def test_fits_and_render():
    est = [estimate(B7, m, gpus=8, zero=3) for m in ("sft", "grpo")]
    assert est[0].fits(80) == [2, 4, 8]  # 112 GB of states: 56 GB on 2 GPUs
    assert estimate(B7, "sft").fits(80) == []  # ZeRO-0 never shards
    text = render(est, gpu_mem=80)
    assert "decimal GB" in text and "fits in 80 GB per GPU with: 2, 4, 8 GPUs (not 1)" in text
    assert "ZeRO-3" in text and "fp32 master weights" in text


def test_main_prints_and_returns_zero(capsys):
    assert main(["model=qwen2.5-0.5b", "gpus=2", "zero=2", "method=sft,grpo", "grad_ckpt=false"]) == 0
    out = capsys.readouterr().out
    assert "\nSFT\n" in out and "\nGRPO\n" in out and "\nDPO\n" not in out and "qwen2.5-0.5b" in out
    for offload in ("params", "all"):  # a run's name for parameter offload, and the estimator's first
        assert main(["model=qwen2.5-7b", "gpus=8", "backend=zero3", f"offload={offload}", "method=sft"]) == 0
        assert f"ZeRO-3 (train.backend=zero3), offload={offload}" in capsys.readouterr().out


@pytest.mark.parametrize("argv, match", [
    (["model=qwen2.5-7b", "gpu=8"], "gpu: unknown key; did you mean gpus"),
    (["model=qwen2.5-7b", "g=8"], "did you mean G"),
    (["model=qwen2.5-7b", "gpus=0"], "^gpus=0"),
    (["model=qwen2.5-7b", "zero=4"], "^zero=4"),
    (["model=qwen2.5-7b", "gpus=two"], "^gpus=two"),
    (["model=qwen2.5-7b", "grad_ckpt=maybe"], "^grad_ckpt=maybe"),
    (["model=qwen2.5-7b", "method=rlhf"], "^method=rlhf"),
    (["model=qwen2.5-7b", "offload=optimizer"], "^offload=optimizer: needs zero"),
    (["model=qwen2.5-7b", "offload=disk"], "^offload=disk: must be none/optimizer/params"),
    (["model=qwen2.5-7b", "backend=fsdp2", "offload=optimizer"], "^offload=optimizer: backend=fsdp2 supports none or "
                                                                  "params"),
    (["model=qwen2.5-7b", "rollout=sglang"], "^rollout=sglang: must be hf or vllm"),
    (["model=qwen2.5-7b", "rollout=vllm", "gpu_memory_utilization=1.5"], "^gpu_memory_utilization=1.5: must be in"),
    (["gpus=8"], "^model: missing"),
    (["model=gpt-5"], "not a directory and not a preset .*qwen2.5-7b"),
])
def test_main_bad_input_names_the_key(argv, match):
    with pytest.raises(UserError, match=match):
        main(argv)


def test_config_errors_name_file_and_field(tmp_path):
    cfg = _tiny_llama_config().to_dict()
    del cfg["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match=r"config\.json: field 'hidden_size' is missing"):
        model_spec(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UserError, match=r"config\.json: not valid JSON"):
        model_spec(str(tmp_path))
    with pytest.raises(UserError, match="no file"):
        model_spec(str(tmp_path / "missing"))
    (tmp_path / "moe").mkdir()
    (tmp_path / "moe" / "config.json").write_text(json.dumps({**_tiny_llama_config().to_dict(), "num_experts": 8}))
    with pytest.raises(UserError, match="mixture-of-experts"):
        model_spec(str(tmp_path / "moe"))


def test_a_registered_method_appears_by_its_own_declarations(monkeypatch):
    """A method registered later is estimated from what it declares, with no list to edit: this one samples G = 3
    completions per prompt online and needs a critic, so it gets a critic row and a KV cache for 3 × batch sequences."""
    from dataclasses import dataclass

    from posttrain import algorithms

    @dataclass
    class ToyConfig:
        group_size: int = 4

    class Toy(algorithms.Algorithm):
        name, Config, source = "toy", ToyConfig, "online"

        @classmethod
        def sized_config(cls, kl_weight, group):
            return ToyConfig(group_size=group)

        @staticmethod
        def needs(cfg):
            return frozenset({"reward", "values"})

        @staticmethod
        def samples_per_prompt(cfg):
            return cfg.group_size

    monkeypatch.setitem(algorithms.REGISTRY, "toy", Toy)
    toy = rows(estimate(B7, "toy", batch=2, group=3, prompt_len=10, response_len=20))
    assert "critic (weights+grads+moments+master)" in toy and "reference model" not in toy
    assert toy["rollout KV cache"].gpu_bytes == kv_cache_bytes(B7, 2 * 3, 30)
    assert "\nTOY\n" in render([estimate(B7, m) for m in algorithms.REGISTRY])


def test_vllm_rollouts_take_their_share_of_the_card_instead_of_a_kv_cache():
    """rollout=vllm: the engine reserves gpu_memory_utilization × gpu_mem while it samples and sleeps during the
    update, so it replaces the KV cache row and counts against the activations, the larger of the two."""
    hf = gpu(estimate(B7, "grpo", batch=4, group=16))
    est = estimate(B7, "grpo", batch=4, group=16, rollout="vllm", gpu_memory_utilization=0.3, gpu_mem=80)
    g = gpu(est)
    assert "rollout KV cache" in hf and "rollout KV cache" not in g
    assert g["vLLM engine (rollout)"] == 24 * 10**9
    states = sum(v for k, v in g.items() if k not in ("vLLM engine (rollout)", "activations"))
    assert est.gpu_total == states + max(g["vLLM engine (rollout)"], g["activations"])
    assert "vLLM engine (rollout)" not in gpu(estimate(B7, "sft", rollout="vllm"))  # SFT samples nothing
    on_48 = estimate(B7, "grpo", lora=64, rollout="vllm", gpu_memory_utilization=0.3, gpu_mem=48)
    assert gpu(on_48)["vLLM engine (rollout)"] == round(0.3 * 48 * 10**9)
    assert on_48.fits(48) == [n for n in (1, 2, 4, 8) if estimate(
        B7, "grpo", lora=64, rollout="vllm", gpu_mem=48, gpus=n).gpu_total <= 48 * 10**9]
