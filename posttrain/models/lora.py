"""LoRA (Hu et al. 2021, arXiv:2106.09685) through peft: each adapted linear layer computes W x + (α/r) B A x, and
only A and B are trained (A random, B zero at the start, so the adapted model starts as the base).

Nothing in a method changes: the loss and its GC are the same, and only the set of trained parameters is smaller.
The reference of a KL term is the starting policy, which is the base with the adapter switched off, so
`adapter_off` scores it without a second copy of the model. The HF rollout engine samples from the adapted model
itself; an engine that holds its own copy of the weights (vLLM) takes `merged_weights`: every weight under its
ordinary name, W + (α/r) B A for adapted layers, computed one layer at a time.

peft is imported only when a run asks for LoRA.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from posttrain.core.errors import UserError
from posttrain.models.loading import load
from posttrain.schema import LoraConfig

TASKS = {"causal_lm": "CAUSAL_LM", "critic": "TOKEN_CLS"}  # peft's task types: TOKEN_CLS also trains the value head


def apply(model: torch.nn.Module, lora: LoraConfig, base_path: str | Path, kind: str = "causal_lm") -> torch.nn.Module:
    """`model`, loaded from `base_path`, with LoRA adapters on `lora.target_modules` (a peft model); the base
    weights are frozen. A saved adapter names its base by `base_path`'s absolute path."""
    import peft

    targets = lora.target_modules.strip()
    heads = ["score", "classifier"] if kind == "critic" else None  # trained in full, never adapted
    config = peft.LoraConfig(
        r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, task_type=TASKS[kind], bias="none",
        target_modules=targets if targets == "all-linear" else [t.strip() for t in targets.split(",") if t.strip()],
        exclude_modules=heads, modules_to_save=heads)
    try:
        with warnings.catch_warnings():  # peft asks transformers a question transformers 5 renamed; nothing to act on
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
            adapted = peft.get_peft_model(model, config)
    except ValueError as err:  # no layer matched the names
        from posttrain.core.errors import ConfigError

        raise ConfigError(f"model.lora.target_modules: {str(err).splitlines()[0]}") from None
    adapted.peft_config[adapted.active_adapter].base_model_name_or_path = str(Path(base_path).resolve())
    return adapted


def peft_model(model: torch.nn.Module):
    """The peft model inside `model` (under a DDP wrapper, say), or None when it has no adapter."""
    while model is not None:
        if type(model).__module__.startswith("peft."):
            return model
        model = getattr(model, "module", None) if isinstance(model, torch.nn.Module) else None
    return None


def is_adapted(model: torch.nn.Module) -> bool:
    return peft_model(model) is not None


def hf_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside wrappers (DDP's `.module`, peft's), with its adapters in place when adapted."""
    inner = getattr(model, "module", model) if isinstance(getattr(model, "module", None), torch.nn.Module) else model
    peft = peft_model(inner)
    return peft.get_base_model() if peft is not None else inner


@contextlib.contextmanager
def adapter_off(model: torch.nn.Module):
    """Within it, `model` computes as its base (the adapters add nothing)."""
    with peft_model(model).disable_adapter():
        yield


def parameter_counts(model: torch.nn.Module) -> dict[str, int]:
    """Trained and total parameter counts."""
    params = list(model.parameters())
    return {"trained": sum(p.numel() for p in params if p.requires_grad), "total": sum(p.numel() for p in params)}


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


@torch.no_grad()
def merged_weights(model: torch.nn.Module, full=_whole) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every weight of the adapted model as the plain model names it, the adapter merged in:
    W + (α/r) B A for adapted layers (a new tensor, one at a time), the base tensor itself elsewhere.

    `full` turns a parameter into its whole tensor: a sharded backend gathers it; by default it is the parameter.
    """
    from peft.tuners.lora import LoraLayer

    peft = peft_model(model)
    base = peft.get_base_model()
    adapter = peft.active_adapter
    layers = {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer)}
    for name, param in base.named_parameters():
        if ".lora_" in name:
            continue  # A and B themselves: merged into their layer's weight
        owner, sep, rest = name.partition(".base_layer.")
        if not sep:
            yield name, full(param)
        elif rest == "weight" and adapter in layers[owner].lora_A:
            weight = full(param)
            yield f"{owner}.weight", weight + _delta(layers[owner], adapter, full).to(weight.dtype)
        else:
            yield f"{owner}.{rest}", full(param)


def _delta(layer, adapter: str, full) -> torch.Tensor:
    """(α/r) B A of one adapted linear layer in float32, transposed where the layer stores W as [in, out] (GPT-2's
    Conv1D), as peft's merge computes it."""
    a, b = full(layer.lora_A[adapter].weight), full(layer.lora_B[adapter].weight)  # [r, in], [out, r]
    delta = (b.float() @ a.float()) * layer.scaling[adapter]  # [out, in]
    return delta.T if layer.fan_in_fan_out else delta


def save_adapter(model: torch.nn.Module, path: Path, state: dict[str, torch.Tensor] | None = None) -> None:
    """The adapter alone (adapter_config.json, adapter_model.safetensors), naming its base by absolute path; from
    `state` (every weight of the peft model, gathered by a sharded backend) when given."""
    peft_model(model).save_pretrained(path, state_dict=state, safe_serialization=True)


def save_merged(model: torch.nn.Module, path: Path, state: dict[str, torch.Tensor] | None = None) -> None:
    """The base with the adapter merged in, as an ordinary Hugging Face directory; the adapter stays as it was.
    `state` is `merged_weights` already computed (gathered by a sharded backend); by default they are computed here."""
    base = peft_model(model).get_base_model()
    if state is None:
        state = {name: tensor.detach().contiguous() for name, tensor in merged_weights(model)}
    base.save_pretrained(path, state_dict=state, safe_serialization=True)


BASE_COPY = "base_model"  # beside model/ in a run directory: the embedded base a LoRA run adapted, copied (a few MB)


def adapter_base(adapter: Path, base: str | Path | None = None) -> Path:
    """The base model directory of the adapter at `adapter`: `base` when given; else the run's own copy beside it
    (`../base_model`, written when the base was the embedded model, so a run directory moved or a cache cleared
    still evaluates); else the directory its adapter_config.json names. Raises UserError, naming what is missing."""
    if base is not None:
        if not (Path(base) / "config.json").is_file():
            raise UserError(f"--base: '{base}' is not a Hugging Face model directory (no config.json)")
        return Path(base)
    copy = adapter.parent / BASE_COPY
    if (copy / "config.json").is_file():
        return copy
    try:
        named = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UserError(f"{adapter}: adapter_config.json cannot be read for its base model ({err})") from None
    if not (Path(str(named)) / "config.json").is_file():
        raise UserError(f"{adapter}: a LoRA adapter whose base model '{named}' (named in adapter_config.json) is not "
                        "there; give the base with --base DIR, or evaluate merged_model/")
    return Path(str(named))


def load_adapted(adapter: Path, base: Path, dtype: str):
    """The base at `base` with the adapter at `adapter` on it, a peft model computing W x + (α/r) B A x as the run
    that trained it did (so an evaluation repeats the run's own, bit for bit where the run's did), and its tokenizer
    (the base's, which the run saved beside the adapter too). An engine with its own weights takes
    `merged_weights` of it."""
    import peft

    model, tokenizer = load(base, dtype=dtype, key="--base")
    try:
        adapted = peft.PeftModel.from_pretrained(model, adapter)
    except (OSError, ValueError, KeyError, RuntimeError) as err:  # a shape or name that is not this base's
        raise UserError(f"{adapter}: the adapter does not load onto the base '{base}' "
                        f"({str(err).splitlines()[0][:300]})") from None
    return adapted, tokenizer
