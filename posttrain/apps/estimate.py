"""Per-GPU memory of each registered method (SFT, RFT, Online RFT, DPO, PPO, GRPO), from a model's config.json or a
built-in preset.

Model states follow the ZeRO paper's accounting (Rajbhandari et al. 2020, arXiv:1910.02054, §3.1): a trained
parameter costs its weight and gradient in the training dtype, two fp32 AdamW moments (8 bytes) and, in mixed
precision, a 4-byte fp32 master copy. A 7B model in bf16 is 14 GB of weights + 14 GB of gradients + 56 GB of
moments (+28 GB of master weights). ZeRO stage 1 shards the optimizer states (moments and master) over the GPUs,
stage 2 also the gradients, stage 3 also the weights, including those of frozen models.

Each method is a set of model roles (docs/unified_view.md: the engine loads a reference or a critic only when asked):

| method | policy  | reference              | critic  | reward model              | rollout KV cache |
|--------|---------|------------------------|---------|---------------------------|------------------|
| SFT    | trained | -                      | -       | -                         | -                |
| DPO    | trained | frozen                 | -       | -                         | -                |
| PPO    | trained | frozen (absent, beta=0)| trained | frozen (reward_model=true)| batch sequences  |
| GRPO   | trained | frozen (absent, beta=0)| -       | frozen if reward_model    | batch·G sequences|
| distill| trained | - (a frozen teacher)   | -       | -                         | batch·n sequences|

The rows come from each plugin's own declarations (`method_profile`), so RFT, Online RFT and any method registered
later appear without a list here to edit.

Assumptions (render() prints them with the numbers):
1. Critic, reward model and a distillation teacher have the policy's architecture (the value head vs lm_head
   difference is ignored; a teacher larger than the student holds its own size more).
2. `batch` is per GPU (data parallel): prompts for PPO/GRPO, rows for SFT, pairs for DPO (chosen and rejected run
   as one 2·batch forward, as TRL does). Rollout and training use the same batch (no micro-batching).
3. The rollout KV cache (HF generate) is freed before the backward pass, so the total counts the larger of the
   KV cache and the activations, not both. Reference and reward forwards run under no_grad and keep nothing.
4. Attention is fused (FlashAttention/SDPA, Dao et al. 2022), so no [heads, T, T] score matrix is kept.
5. With LoRA the reference is the policy's frozen base with adapters disabled (TRL's PEFT path), so it adds nothing.
6. Offload follows DeepSpeed: optimizer offload needs ZeRO >= 1, parameter offload (offload=params) needs ZeRO-3.
   Offloaded bytes are this rank's shard in CPU memory. Gradients are counted on the GPU.
7. Not counted: CUDA context (~1 GB), allocator fragmentation, communication buffers, ZeRO-3's gathered layer.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from posttrain import algorithms
from posttrain.core.errors import ConfigError, UserError
from posttrain.models import gguf

GB = 1e9  # decimal gigabytes, as GPU vendors quote memory
BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
OFFLOAD_ALIASES = {"all": "params"}  # the estimator's first name for parameter offload, still accepted
TRANSIENT = ("rollout KV cache", "vLLM engine (rollout)", "activations")  # live at different times: the larger counts
ROLLOUTS = ("hf", "vllm")


def backend_classes() -> dict[str, type]:
    """`train.backend` name -> its class, as the backends register themselves. Each declares what the estimator asks
    of it: the ZeRO stage whose sharding it does (`zero_stage`; FSDP2's is 3), the `train.offload` values it supports
    (`offloads`) and whether its optimizer keeps an fp32 master copy even of fp32 weights (`fp32_master`, DeepSpeed's
    does). A backend registered later is estimated with no table here to edit."""
    from posttrain.backends import BACKENDS  # (torch.distributed): only once a setting is checked

    return dict(BACKENDS)


def offloads() -> tuple[str, ...]:
    """Every `train.offload` value some backend supports, from the backends that shard least to those that shard most
    (none, optimizer, params)."""
    ordered = sorted(backend_classes().values(), key=lambda cls: cls.zero_stage)
    return tuple(dict.fromkeys(o for cls in ordered for o in cls.offloads))


def _fp32_master(backend: str | None) -> bool:
    return backend is not None and backend_classes()[backend].fp32_master


@dataclass(frozen=True)
class ModelSpec:
    """The architecture numbers of a Llama/Qwen2-style decoder (GQA attention, gated MLP, RMSNorm)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool  # lm_head shares the embedding matrix
    head_dim: int = 0  # 0 means hidden // heads
    qkv_bias: bool = False  # Qwen2 has biases on q, k, v
    o_bias: bool = False  # Llama's attention_bias also puts one on o_proj
    mlp_bias: bool = False
    params_override: int = 0  # a round count (e.g. 7.0e9) for back-of-envelope checks; 0 means computed

    @property
    def hd(self) -> int:
        """Head dimension."""
        return self.head_dim or self.hidden // self.heads

    def projections(self) -> list[tuple[int, int]]:
        """(d_in, d_out) of the seven matrices LoRA adapts in one layer: q, k, v, o, gate, up, down."""
        h, q, kv, i = self.hidden, self.heads * self.hd, self.kv_heads * self.hd, self.intermediate
        return [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]

    @property
    def n_params(self) -> int:
        """Embeddings + layers (projections, biases, two RMSNorms) + final norm + lm_head unless tied."""
        if self.params_override:
            return self.params_override
        q, kv, h = self.heads * self.hd, self.kv_heads * self.hd, self.hidden
        bias = self.qkv_bias * (q + 2 * kv) + self.o_bias * h + self.mlp_bias * (2 * self.intermediate + h)
        layer = sum(a * b for a, b in self.projections()) + bias + 2 * h
        return self.vocab * h * (1 if self.tied else 2) + self.layers * layer + h

    def lora_params(self, rank: int) -> int:
        """A LoRA pair on each projection is A [r, d_in] + B [d_out, r] (Hu et al. 2021, arXiv:2106.09685)."""
        return self.layers * sum(rank * (a + b) for a, b in self.projections())


# From the public config.json of each model on the Hugging Face Hub (Qwen2 puts biases on q, k, v).
PRESETS = {p.name: p for p in [
    ModelSpec("qwen2.5-0.5b", 896, 24, 14, 2, 4864, 151936, True, qkv_bias=True),
    ModelSpec("qwen2.5-1.5b", 1536, 28, 12, 2, 8960, 151936, True, qkv_bias=True),
    ModelSpec("qwen2.5-3b", 2048, 36, 16, 2, 11008, 151936, True, qkv_bias=True),
    ModelSpec("qwen2.5-7b", 3584, 28, 28, 4, 18944, 152064, False, qkv_bias=True),
    ModelSpec("qwen2.5-14b", 5120, 48, 40, 8, 13824, 152064, False, qkv_bias=True),
    ModelSpec("qwen2.5-32b", 5120, 64, 40, 8, 27648, 152064, False, qkv_bias=True),
    ModelSpec("qwen2.5-72b", 8192, 80, 64, 8, 29568, 152064, False, qkv_bias=True),
    ModelSpec("llama-7b", 4096, 32, 32, 32, 11008, 32000, False),  # Llama 2 7B
    ModelSpec("llama-13b", 5120, 40, 40, 40, 13824, 32000, False),  # Llama 2 13B
    ModelSpec("llama-3.2-1b", 2048, 16, 32, 8, 8192, 128256, True),
    ModelSpec("llama-3-8b", 4096, 32, 32, 8, 14336, 128256, False),
    ModelSpec("llama-3-70b", 8192, 80, 64, 8, 28672, 128256, False),
]}


def model_spec(name_or_dir: str) -> ModelSpec:
    """A preset by name, or the config.json of a local Hugging Face model directory (or the file itself)."""
    if name_or_dir.lower() in PRESETS:
        return PRESETS[name_or_dir.lower()]
    path = os.path.join(name_or_dir, "config.json") if os.path.isdir(name_or_dir) else name_or_dir
    if not os.path.exists(path):
        if os.path.isdir(name_or_dir) or os.sep in name_or_dir or name_or_dir.endswith((".json", ".gguf")):
            raise UserError(f"model={name_or_dir}: no file {path}")
        raise UserError(f"model={name_or_dir}: not a directory and not a preset (presets: {', '.join(PRESETS)})")
    if gguf.is_gguf(path):  # the architecture in a GGUF file's header, as transformers reads it
        cfg = gguf.config_of(Path(path), f"model={name_or_dir}")
    else:
        try:
            with open(path, encoding="utf-8") as f:
                cfg = json.load(f)
        except OSError as e:
            raise UserError(f"{path}: cannot read ({e.strerror})") from None
        except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
            raise UserError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise UserError(f"{path}: expected a JSON object")
    cfg = cfg.get("text_config", cfg)  # multimodal wrappers keep the language model's numbers there
    if any(cfg.get(k) for k in ("num_local_experts", "num_experts", "n_routed_experts")):
        raise UserError(f"{path}: mixture-of-experts models are not supported by the estimator")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
        if not isinstance(cfg.get(key), int) or cfg[key] <= 0:
            raise UserError(f"{path}: field '{key}' is missing or not a positive integer")
    attn_bias = bool(cfg.get("attention_bias", False))
    return ModelSpec(
        name=Path(path).stem if gguf.is_gguf(path) else os.path.basename(os.path.dirname(os.path.abspath(path))),
        hidden=cfg["hidden_size"], layers=cfg["num_hidden_layers"], heads=cfg["num_attention_heads"],
        kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],  # absent means no GQA, as in HF
        intermediate=cfg["intermediate_size"], vocab=cfg["vocab_size"],
        tied=bool(cfg.get("tie_word_embeddings", False)), head_dim=cfg.get("head_dim") or 0,
        qkv_bias=attn_bias or cfg.get("model_type") == "qwen2", o_bias=attn_bias, mlp_bias=bool(cfg.get("mlp_bias")))


@dataclass(frozen=True)
class StateBytes:
    """Model-state bytes of one model on one device, before any sharding or offload."""

    params: int  # weights (frozen base + LoRA adapters)
    grads: int
    moments: int  # AdamW exp_avg + exp_avg_sq, fp32
    master: int  # fp32 copy of the trained weights

    @property
    def total(self) -> int:
        return self.params + self.grads + self.moments + self.master


def state_bytes(spec: ModelSpec, *, dtype: str = "bf16", lora: int = 0, master_weights: bool = True,
                trained: bool = True, fp32_master: bool = False) -> StateBytes:
    """Weights, gradients and AdamW state of one model, unsharded; `trained=False` is a frozen model (weights only).

    `fp32_master`: a master copy even of fp32 weights, as DeepSpeed's ZeRO optimizer keeps one.
    To compare with a real torch model, use dtype="fp32" (no master copy then): torch.optim.AdamW keeps its moments
    in the parameter's dtype, so a bf16 model measures 2 + 2 bytes of moments, not 8, and one 4-byte `step` per tensor.
    """
    p, n = BYTES[dtype], spec.n_params
    adapters = spec.lora_params(lora) if lora else 0
    if not trained:
        return StateBytes(n * p, 0, 0, 0)
    t = adapters if lora else n
    master = 4 * t if master_weights and (dtype != "fp32" or fp32_master) else 0
    return StateBytes((n + adapters) * p, t * p, 8 * t, master)


def kv_cache_bytes(spec: ModelSpec, sequences: int, tokens: int, dtype: str = "bf16") -> int:
    """K and V for every layer: 2 · layers · kv_heads · head_dim · bytes · sequences · tokens."""
    return 2 * spec.layers * spec.kv_heads * spec.hd * BYTES[dtype] * sequences * tokens


def activation_bytes(spec: ModelSpec, tokens: int, dtype: str = "bf16", grad_ckpt: bool = True) -> tuple[int, str]:
    """Activations kept for backward over `tokens` tokens, and the formula used.

    Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", arXiv:2205.05198,
    §4.1) count s·b·h·(34 + 5·a·s/h) bytes per GPT layer. For a Llama layer without dropout, with fused attention
    (no a·s² term) and GQA, the tensors saved per token are, in elements: the two RMSNorm inputs (2h) and outputs
    (2h), Q and the attention output (2·q_dim), K and V (2·kv_dim), and the gated MLP's gate, up, silu(gate) and
    their product (4·i). The fp32 logits [tokens, vocab] come on top. With gradient checkpointing only each layer's
    input (h per token) is kept, plus one layer's worth recomputed during backward.
    """
    p, s = BYTES[dtype], spec
    per_tok = 4 * s.hidden + 2 * s.heads * s.hd + 2 * s.kv_heads * s.hd + 4 * s.intermediate
    layer, logits = p * tokens * per_tok, 4 * tokens * s.vocab
    logits_f = f"logits {tokens} tok × {s.vocab} × 4 B"
    if grad_ckpt:
        inputs = s.layers * p * tokens * s.hidden
        return inputs + layer + logits, f"({s.layers} × {s.hidden} + {per_tok}) × {tokens} tok × {p} B + {logits_f}"
    return s.layers * layer + logits, f"{s.layers} × {per_tok} × {tokens} tok × {p} B + {logits_f}"


@dataclass
class Row:
    """One line of the table: a role's bytes on this GPU and in this rank's CPU memory, and how they were counted."""

    role: str
    gpu_bytes: int
    cpu_bytes: int
    formula: str


@dataclass
class Estimate:
    """One method's rows; `settings` are the keyword arguments of estimate(), kept so fits() can vary `gpus`."""

    method: str
    spec: ModelSpec
    rows: list[Row]
    settings: dict = field(default_factory=dict)

    @property
    def gpu_total(self) -> int:
        """Model states plus the larger of the KV cache and the activations (assumption 3)."""
        states = sum(r.gpu_bytes for r in self.rows if r.role not in TRANSIENT)
        return states + max([r.gpu_bytes for r in self.rows if r.role in TRANSIENT], default=0)

    @property
    def cpu_total(self) -> int:
        return sum(r.cpu_bytes for r in self.rows)

    def fits(self, gpu_mem: float, counts: tuple[int, ...] = (1, 2, 4, 8)) -> list[int]:
        """The GPU counts whose per-GPU total is within gpu_mem decimal GB."""
        return [n for n in counts if estimate(self.spec, self.method, **{**self.settings, "gpus": n,
                                                                         "gpu_mem": gpu_mem}).gpu_total <= gpu_mem * GB]


def _num(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else str(n)


def estimate(spec: ModelSpec, method: str, *, gpus: int = 1, zero: int = 0, offload: str = "none", lora: int = 0,
             batch: int = 1, group: int = 8, prompt_len: int = 512, response_len: int = 1024, grad_ckpt: bool = True,
             dtype: str = "bf16", master_weights: bool = True, reward_model: bool | None = None,
             beta: float = 0.04, rollout: str = "hf", gpu_memory_utilization: float = 0.3,
             gpu_mem: float = 80.0, backend: str | None = None) -> Estimate:
    """Per-GPU memory of `method` on `gpus` GPUs; the module docstring lists the roles and assumptions.

    Args:
        spec: the model (policy; critic, reference, teacher and reward model are taken to be the same size).
        method: a registered method (`posttrain.algorithms`): what it holds comes from `method_profile`.
        gpus: data-parallel GPUs that ZeRO shards over.
        zero: ZeRO stage 0-3. offload: "none", "optimizer" (moments and master) or "params" (also weights; "all"
            is the same, the estimator's first name for it), as a run's `train.offload`.
        lora: LoRA rank; 0 trains every weight.
        batch: per GPU: prompts (PPO, GRPO), rows (SFT) or pairs (DPO). group: samples per GRPO prompt (G).
        prompt_len, response_len: tokens per sequence. grad_ckpt: gradient checkpointing.
        dtype: "bf16", "fp16" or "fp32" weights and gradients. master_weights: keep an fp32 copy in mixed precision.
        reward_model: a frozen policy-sized reward model (PPO, GRPO); None means true for PPO, false for GRPO.
        beta: KL coefficient; 0 drops the reference for PPO and GRPO (DPO always needs it).
        rollout: "hf" (the trainer's model samples, with a KV cache) or "vllm" (a colocated vLLM engine, which takes
            `gpu_memory_utilization` of the `gpu_mem` GB card for its weights and KV cache while it samples, and
            sleeps, freeing both, during the update: `rollout.gpu_memory_utilization` of a run).
        backend: a run's `train.backend`, which sets `zero` to the stage it shards as and accepts only the offloads
            it supports, both as the backend declares them (`backend_classes`); the DeepSpeed ones also keep an fp32
            master copy of fp32 weights.

    Raises:
        UserError: a setting out of range, named.
    """
    if backend is not None:
        table = backend_classes()
        if backend not in table:
            raise UserError(f"backend={backend}: must be {' or '.join(table)}")
        stage = table[backend].zero_stage
        if zero not in (0, stage):
            raise UserError(f"zero={zero}: backend={backend} shards as zero={stage}")
        zero = stage
    settings = {"gpus": gpus, "zero": zero, "offload": offload, "lora": lora, "batch": batch, "group": group,
                "prompt_len": prompt_len, "response_len": response_len, "grad_ckpt": grad_ckpt, "dtype": dtype,
                "master_weights": master_weights, "reward_model": reward_model, "beta": beta, "rollout": rollout,
                "gpu_memory_utilization": gpu_memory_utilization, "gpu_mem": gpu_mem, "backend": backend}
    _validate(method=method, **settings)
    p, n = BYTES[dtype], spec.n_params
    trained = state_bytes(spec, dtype=dtype, lora=lora, master_weights=master_weights,
                          fp32_master=_fp32_master(backend))
    frozen = state_bytes(spec, dtype=dtype, trained=False)
    t = _num(spec.lora_params(lora)) + " LoRA" if lora else _num(n)

    def place(nbytes: int, stage: int, to_cpu: bool) -> tuple[int, int, str]:
        shard = gpus if zero >= stage and gpus > 1 else 1
        b = math.ceil(nbytes / shard)
        where = (f" / {shard} (ZeRO-{zero})" if shard > 1 else "") + (" on CPU" if to_cpu else "")
        return (0, b, where) if to_cpu else (b, 0, where)

    off = OFFLOAD_ALIASES.get(offload, offload)
    off_opt, off_par = off != "none", off == "params"
    params_f = f"({_num(n)} frozen + {t}) × {p} B" if lora else f"{_num(n)} × {p} B ({dtype})"
    parts = [  # (role, bytes, ZeRO stage that shards it, offloaded, formula)
        ("parameters", trained.params, 3, off_par, params_f),
        ("gradients", trained.grads, 2, False, f"{t} × {p} B"),
        ("AdamW moments", trained.moments, 1, off_opt, f"{t} × 2 × 4 B (fp32 m, v)"),
        ("fp32 master weights", trained.master, 1, off_opt,
         f"{t} × 4 B" if trained.master else "none" + (" (fp32 weights)" if dtype == "fp32" else "")),
    ]
    rows = []
    for role, nbytes, stage, cpu, formula in parts:
        g, c, where = place(nbytes, stage, cpu)
        rows.append(Row(f"policy {role}", g, c, formula + where))
    plugin, needs, online, seqs_per_item, sampled_per_item = method_profile(method, group, beta)
    if "ref_logp" in needs:
        if lora:
            rows.append(Row("reference model", 0, 0, "the policy's frozen base with adapters disabled"))
        else:
            g, c, where = place(frozen.params, 3, off_par)
            rows.append(Row("reference model", g, c, f"frozen: {_num(n)} × {p} B{where}"))
    if "teacher_logp" in needs:  # frozen and scored like the reference; a larger teacher holds more
        g, c, where = place(frozen.params, 3, off_par)
        rows.append(Row("teacher model", g, c, f"frozen, policy-sized: {_num(n)} × {p} B{where}"))
    if "values" in needs:
        placed = [place(nbytes, stage, cpu) for _, nbytes, stage, cpu, _ in parts]
        rows.append(Row("critic (weights+grads+moments+master)", sum(x[0] for x in placed),
                        sum(x[1] for x in placed), "same as the four policy rows (policy-sized critic)"))
    if "reward" in needs and (reward_model if reward_model is not None else plugin.learned_reward):
        g, c, where = place(frozen.params, 3, off_par)
        rows.append(Row("reward model", g, c, f"frozen: {_num(n)} × {p} B{where}"))
    tokens = prompt_len + response_len
    seqs = batch * seqs_per_item
    if online and rollout == "vllm":
        share = round(gpu_memory_utilization * gpu_mem * GB)
        rows.append(Row("vLLM engine (rollout)", share, 0, f"{gpu_memory_utilization:g} × {gpu_mem:g} GB "
                        "(its weights and KV cache; asleep during the update)"))
    elif online:
        sampled = batch * sampled_per_item  # online DPO samples G and trains on a pair
        kv_f = f"2 × {spec.layers} layers × {spec.kv_heads} kv × {spec.hd} × {p} B × {sampled} seq × {tokens} tok"
        rows.append(Row("rollout KV cache", kv_cache_bytes(spec, sampled, tokens, dtype), 0, kv_f))
    act, act_f = activation_bytes(spec, seqs * tokens, dtype, grad_ckpt)
    rows.append(Row("activations", act, 0, act_f))
    return Estimate(method, spec, rows, settings)


def method_profile(method: str, group: int, beta: float):
    """What the registered plugin `method` holds, read from its own declarations rather than a list here:
    (plugin, needs, samples online, sequences trained per batch item, sequences sampled per batch item).

    The config is the plugin's `sized_config(beta, group)`: its defaults, with the KL weight and the samples per
    prompt where the method has them (GRPO's β and G, PPO's β; DPO's β is no KL weight, so DPO keeps its own and
    always needs the reference). A `group` the method rejects is an error.
    """
    plugin = algorithms.get(method)
    try:
        cfg = plugin.sized_config(beta, group)
    except ConfigError as err:
        raise UserError(f"G={group}: {method}: {err}") from None
    from posttrain.sources import SOURCES  # (transformers): only once the settings are valid

    online = SOURCES.find(plugin.source).on_policy  # samples the policy every step: a rollout KV cache
    sampled = plugin.samples_per_prompt(cfg) if online else 0
    return plugin, plugin.needs(cfg), online, plugin.rows_per_item(cfg), sampled


def _validate(**kw) -> None:
    """Raise UserError naming the first setting out of range."""
    known = offloads()
    checks = {  # key -> (valid, what is allowed); keys as the CLI spells them
        "method": (kw["method"] in algorithms.REGISTRY, " or ".join(algorithms.REGISTRY)), "gpus": (kw["gpus"] >= 1, ">= 1"),
        "zero": (kw["zero"] in (0, 1, 2, 3), "0, 1, 2 or 3"),
        "offload": (kw["offload"] in (*known, *OFFLOAD_ALIASES), "/".join(known)),
        "lora": (kw["lora"] >= 0, ">= 0"), "batch": (kw["batch"] >= 1, ">= 1"), "G": (kw["group"] >= 1, ">= 1"),
        "prompt_len": (kw["prompt_len"] >= 0, ">= 0"), "response_len": (kw["response_len"] >= 0, ">= 0"),
        "dtype": (kw["dtype"] in BYTES, " or ".join(BYTES)), "beta": (kw["beta"] >= 0, ">= 0"),
        "rollout": (kw["rollout"] in ROLLOUTS, " or ".join(ROLLOUTS)),
        "gpu_memory_utilization": (0 < kw["gpu_memory_utilization"] < 1, "in (0, 1)"),
        "gpu_mem": (kw["gpu_mem"] > 0, "> 0"),
    }
    for key, (ok, allowed) in checks.items():
        if not ok:
            raise UserError(f"{key}={kw['group' if key == 'G' else key]}: must be {allowed}")
    offload = OFFLOAD_ALIASES.get(kw["offload"], kw["offload"])
    if kw["backend"] is not None and offload not in (supported := backend_classes()[kw["backend"]].offloads):
        raise UserError(f"offload={kw['offload']}: backend={kw['backend']} supports {' or '.join(supported)}")
    if offload == "optimizer" and kw["zero"] < 1:
        raise UserError("offload=optimizer: needs zero >= 1 (DeepSpeed offloads the sharded optimizer)")
    if offload == "params" and kw["zero"] < 3:
        raise UserError(f"offload={kw['offload']}: parameter offload needs zero=3 (DeepSpeed offload_param)")


def render(estimates: list[Estimate], gpu_mem: float = 80.0) -> str:
    """A plain-text table per method, the GPU counts that fit, and the assumptions. Sizes in decimal GB."""
    s, c = estimates[0].spec, estimates[0].settings  # one model and one set of settings for all methods
    lines = [(f"{s.name}: {_num(s.n_params)} parameters ({s.layers} layers, hidden {s.hidden}, {s.heads} heads / "
              f"{s.kv_heads} kv heads, intermediate {s.intermediate}, vocab {s.vocab}, "
              f"{'tied' if s.tied else 'untied'} embeddings). Sizes in decimal GB (1 GB = 1e9 bytes).")]
    for e in estimates:
        lines += ["", e.method.upper(), f"  {'role':<38}{'GPU GB':>9}{'CPU GB':>9}  formula"]
        lines += [f"  {r.role:<38}{r.gpu_bytes / GB:>9.2f}{r.cpu_bytes / GB:>9.2f}  {r.formula}" for r in e.rows]
        lines.append(f"  {'total per GPU':<38}{e.gpu_total / GB:>9.2f}{e.cpu_total / GB:>9.2f}  "
                     f"model states + max({'vLLM engine' if c['rollout'] == 'vllm' else 'KV cache'}, activations)")
        fit = e.fits(gpu_mem)
        fit_s, out = ", ".join(map(str, fit)), ", ".join(str(n) for n in (1, 2, 4, 8) if n not in fit)
        verdict = f"{fit_s} GPUs" + (f" (not {out})" if out else "") if fit else f"none of {out} GPUs"
        lines.append(f"  fits in {gpu_mem:g} GB per GPU with: {verdict}")
    master = ("fp32 master weights" if c["master_weights"] and (c["dtype"] != "fp32" or _fp32_master(c["backend"]))
              else "no master copy")
    lora = f"LoRA rank {c['lora']} on q, k, v, o, gate, up, down" if c["lora"] else "full fine-tuning"
    lines += ["", "Assumptions:",
              (f"- {c['gpus']} GPU(s), ZeRO-{c['zero']}" + (f" (train.backend={c['backend']})" if c["backend"] else "")
               + f", offload={c['offload']} (CPU GB: this rank's shard)."),
              f"- {c['dtype']} weights and gradients, AdamW with fp32 moments, {master}, {lora}.",
              (f"- per GPU: batch={c['batch']} (PPO/GRPO prompts, SFT rows, DPO pairs), G={c['group']} per GRPO "
               f"prompt, {c['prompt_len']}+{c['response_len']} tokens, gradient checkpointing "
               f"{'on' if c['grad_ckpt'] else 'off'}, fused attention."),
              (f"- rollouts on a colocated vLLM engine holding {c['gpu_memory_utilization']:g} of the card while it "
               "samples, asleep during the update." if c["rollout"] == "vllm"
               else "- rollouts on the trainer's model; the KV cache is freed before backward."),
              "- critic and reward model are policy-sized.",
              "- not counted: CUDA context (~1 GB), fragmentation, communication buffers, ZeRO-3's gathered layer."]
    return "\n".join(lines)


def _bool(v: str) -> bool:
    if v.lower() not in ("true", "false", "1", "0", "yes", "no"):
        raise ValueError(v)
    return v.lower() in ("true", "1", "yes")


# CLI key -> (parser, estimate() keyword); range checks live in _validate().
KEYS = {
    "model": (str, None), "method": (str, None), "gpu_mem": (float, None), "gpus": (int, "gpus"),
    "zero": (int, "zero"), "offload": (str, "offload"), "lora": (int, "lora"), "batch": (int, "batch"),
    "G": (int, "group"), "prompt_len": (int, "prompt_len"), "response_len": (int, "response_len"),
    "grad_ckpt": (_bool, "grad_ckpt"), "dtype": (str, "dtype"), "master_weights": (_bool, "master_weights"),
    "reward_model": (_bool, "reward_model"), "beta": (float, "beta"), "rollout": (str, "rollout"),
    "gpu_memory_utilization": (float, "gpu_memory_utilization"), "backend": (str, "backend"),
}


def main(argv: list[str]) -> int:
    """`posttrain estimate model=DIR_OR_PRESET [key=value ...]`: print the report, return 0; bad input: UserError."""
    values: dict = {}
    for token in argv:
        key, eq, raw = token.partition("=")
        if not eq:
            raise UserError(f"{token}: expected key=value, e.g. model=qwen2.5-7b")
        if key not in KEYS:
            near = difflib.get_close_matches(key.lower(), [k.lower() for k in KEYS], n=1)
            hint = f"; did you mean {next(k for k in KEYS if k.lower() == near[0])}?" if near else ""
            raise UserError(f"{key}: unknown key{hint} (known: {', '.join(KEYS)})")
        try:
            values[key] = KEYS[key][0](raw)
        except ValueError:
            raise UserError(f"{key}={raw}: expected {KEYS[key][0].__name__.strip('_')}") from None
    if "model" not in values:
        raise UserError(f"model: missing; give model=DIR_OR_PRESET (presets: {', '.join(PRESETS)})")
    gpu_mem = values.pop("gpu_mem", 80.0)
    if gpu_mem <= 0:
        raise UserError(f"gpu_mem={gpu_mem}: must be positive (GB per GPU)")
    spec = model_spec(values.pop("model"))
    methods = values.pop("method", ",".join(algorithms.REGISTRY)).lower().split(",")
    kwargs = {KEYS[k][1]: v for k, v in values.items()}
    print(render([estimate(spec, m, gpu_mem=gpu_mem, **kwargs) for m in methods], gpu_mem))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
