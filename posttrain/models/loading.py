"""The one model loader: policy, reference, critic and reward model all come from a local Hugging Face directory.

A role is a head on the same kind of checkpoint: the policy and the reference are causal LMs, the critic is a
token-classification model with one output per position (by default the policy's own weights with a new scalar head),
the reward model a sequence-classification model with one output, and a process reward model a token-classification
model read at the ends of steps. Every error names the config key that pointed at the directory, so the CLI can
print it as one line.

Nothing in a checkpoint runs as code: weights load from safetensors only (a pickle, `pytorch_model.bin`, can run
anything when unpickled) and `trust_remote_code=False` keeps a directory's own Python files (`auto_map`) unimported.

A directory's files are read before transformers sees them (`check_files`): its JSON files must parse as objects and
each safetensors file it loads must have a whole header that covers the file, so a truncated download or a garbled
copy is named as one line instead of failing deep inside loading (or, for generation_config.json, being ignored, and
the stop tokens with it).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from posttrain.core.errors import UserError

HEADS = {  # role kind -> (transformers Auto class, keyword arguments)
    "causal_lm": ("AutoModelForCausalLM", {}),
    "critic": ("AutoModelForTokenClassification", {"num_labels": 1}),
    "reward_model": ("AutoModelForSequenceClassification", {"num_labels": 1}),
    "process_reward_model": ("AutoModelForTokenClassification", {}),  # its own num_labels (1 or 2) are kept
}


# The JSON files transformers reads from a model directory, each checked when present.
JSON_FILES = ("config.json", "generation_config.json", "tokenizer_config.json", "tokenizer.json",
              "special_tokens_map.json", "model.safetensors.index.json")
INDEX = "model.safetensors.index.json"  # a sharded checkpoint's map from tensor name to shard file


def _first_line(err: Exception) -> str:
    return (str(err).splitlines() or [type(err).__name__])[0]


def model_dir(path: str | Path, key: str) -> Path:
    """`path` as a model directory named by `key`, checked before any work (a config.json, and `check_files`), so that
    a bad one is a one-line error naming the key rather than a load that fails later or in another process."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise UserError(f"{key}: '{path}' is not a model directory (no config.json)")
    check_files(path, key)
    return path


def check_files(path: Path, key: str) -> None:
    """Refuses a model directory whose JSON files do not parse as objects or whose safetensors weights (what
    transformers loads: model.safetensors, else the shards the index names) cannot be opened; only headers are read,
    so it is quick at any size.

    Raises:
        UserError: naming `key`, the file and what is wrong with it.
    """
    parsed = {}
    for name in JSON_FILES:
        file = path / name
        if not file.exists():
            continue
        try:
            parsed[name] = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as err:
            raise UserError(f"{key}: '{file}' cannot be read as JSON (truncated or corrupt): {_first_line(err)}") from None
        if not isinstance(parsed[name], dict):
            raise UserError(f"{key}: '{file}' holds a JSON {type(parsed[name]).__name__}, not an object")
    weights = [path / "model.safetensors"]
    if not weights[0].exists() and INDEX in parsed:  # transformers' order: the single file, else the index
        shards = parsed[INDEX].get("weight_map")
        if not isinstance(shards, dict):
            raise UserError(f"{key}: '{path / INDEX}' has no weight_map naming the shard files")
        weights = [path / name for name in sorted(set(map(str, shards.values())))]
        missing = [w.name for w in weights if not w.exists()]
        if missing:
            raise UserError(f"{key}: '{path / INDEX}' names shard files that are not there: {', '.join(missing)}")
    from safetensors import SafetensorError, safe_open

    for file in weights:
        if not file.exists():
            continue  # transformers says what it looked for
        try:
            with safe_open(str(file), framework="pt") as f:
                f.keys()
        except (SafetensorError, OSError) as err:
            raise UserError(f"{key}: '{file}' cannot be read as safetensors (truncated or corrupt): "
                            f"{_first_line(err)}") from None


def is_adapter(path: str | Path) -> bool:
    """Whether `path` holds a LoRA adapter (adapter_config.json) rather than a whole model (config.json)."""
    path = Path(path)
    return (path / "adapter_config.json").is_file() and not (path / "config.json").is_file()


def load_tokenizer(path: str | Path, key: str):
    """The tokenizer of a model directory, with a pad token (EOS when it has none); the directory's files are checked
    first (`check_files`)."""
    from transformers import AutoTokenizer

    path = Path(path)
    if is_adapter(path):
        raise UserError(f"{key}: '{path}' holds a LoRA adapter, not a model; give its base model (named in its "
                        "adapter_config.json) or a merged model (a run with model.lora.merge=true writes merged_model/)")
    if not (path / "config.json").is_file():
        raise UserError(f"{key}: '{path}' is not a Hugging Face model directory (no config.json)")
    check_files(path, key)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError, KeyError) as err:
        raise UserError(f"{key}: cannot load the tokenizer of '{path}' ({str(err).splitlines()[0]})") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load(path: str | Path, kind: str = "causal_lm", *, dtype: str = "float32", key: str = "model.path",
         same_vocab_as=None):
    """A model of `kind` and its tokenizer from a local Hugging Face directory.

    Args:
        path: the model directory.
        kind: "causal_lm" (policy, reference), "critic" (one value per position), "reward_model" (one score) or
            "process_reward_model" (a score per position, read at the ends of steps).
        dtype: float32, bfloat16 or float16.
        key: the config key that named `path`, for error messages.
        same_vocab_as: a tokenizer the model must share token for token (a critic scores the policy's tokens).

    Returns:
        (model, tokenizer).

    Raises:
        UserError: naming `key`, when the directory is not a model, cannot be loaded, or has another vocabulary.
    """
    import transformers
    from safetensors import SafetensorError

    tokenizer = load_tokenizer(path, key)
    if same_vocab_as is not None:
        check_same_vocab(tokenizer, same_vocab_as, path, key)
    auto, kwargs = HEADS[kind]
    pickles = sorted(p.name for p in Path(path).glob("pytorch_model*.bin"))
    if pickles and not any(Path(path).glob("*.safetensors")):
        raise UserError(f"{key}: '{path}' holds its weights only as a pickle ({pickles[0]}), which could run code "
                        "when loaded; posttrain reads safetensors only (convert it: save_pretrained writes them)")
    try:
        model = getattr(transformers, auto).from_pretrained(Path(path), dtype=getattr(torch, dtype),
                                                            use_safetensors=True, trust_remote_code=False, **kwargs)
    except (OSError, ValueError, KeyError, SafetensorError) as err:
        raise UserError(f"{key}: cannot load '{path}' as a {kind.replace('_', ' ')} "
                        f"({str(err).splitlines()[0]})") from None
    return model, tokenizer


def check_same_vocab(tokenizer, policy_tokenizer, path: str | Path, key: str) -> None:
    """UserError naming `key` unless `tokenizer` (the model's at `path`) maps every token as the policy's does: a model
    that scores the policy's tokens (a critic, a distillation teacher) must read them as the same tokens."""
    if tokenizer.get_vocab() != policy_tokenizer.get_vocab():
        raise UserError(f"{key}: the model at '{path}' has a different tokenizer from the policy "
                        f"({len(tokenizer)} vs {len(policy_tokenizer)} tokens); it cannot score the policy's tokens")


def stop_token_ids(model, tokenizer) -> list[int]:
    """Every token id that ends a completion: the generation config may list several, the tokenizer names one."""
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None) or tokenizer.eos_token_id
    ids = ids if isinstance(ids, (list, tuple)) else [ids]
    return sorted({int(i) for i in ids} | {int(tokenizer.eos_token_id)})
