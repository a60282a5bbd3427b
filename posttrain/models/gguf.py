"""GGUF checkpoints (llama.cpp's and Ollama's format): `model.path=path/to/model.gguf`, and `posttrain eval FILE.gguf`.

A GGUF file is read once through transformers' GGUF loader (the `gguf` package: `pip install 'posttrain[gguf]'`),
which dequantizes its tensors into an ordinary Hugging Face model with the file's tokenizer and chat template; that
model is written as a safetensors directory in the cache (`<cache>/gguf/<name>-<sha256 prefix>`), keyed by the file's
bytes as the warm-up is by its settings. From then on the run sees an ordinary model directory: the loader, LoRA,
rollout workers, vLLM and the run's output (model/, safetensors) work as for any checkpoint, and the precision the run
picks applies when the directory is loaded (its weights are the dequantized values, in float32).

A quantized file's weights are the dequantized values, not the original model's: training starts from those.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sys
from pathlib import Path

from posttrain.core.errors import UserError
from posttrain.core.files import file_sha256

MAGIC = b"GGUF"  # every GGUF file's first four bytes
INSTALL = "pip install 'posttrain[gguf]'"


def is_gguf(path: str | Path | None) -> bool:
    """Whether `path` names a GGUF file (by its suffix; the file itself is checked by `converted`)."""
    return path is not None and str(path).lower().endswith(".gguf")


def check_file(file: Path, key: str) -> None:
    """Refuses a `file` that is missing or does not start as GGUF, and a machine without the gguf package (one line,
    with what installs it)."""
    if not file.is_file():
        raise UserError(f"{key}: '{file}' does not exist" if not file.exists() else f"{key}: '{file}' is not a file")
    with file.open("rb") as f:
        if f.read(4) != MAGIC:
            raise UserError(f"{key}: '{file}' is not a GGUF file (it does not start with {MAGIC.decode()})")
    try:
        import gguf  # noqa: F401  transformers' GGUF loader reads the file with it
    except ImportError:
        raise UserError(f"{key}: reading a GGUF file needs the gguf package: {INSTALL}") from None


def config_of(file: Path, key: str) -> dict:
    """The model's config.json as transformers makes it from the GGUF header (the tensors are not read)."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    check_file(file, key)
    try:
        return load_gguf_checkpoint(str(file), return_tensors=False)["config"]
    except (OSError, ValueError, KeyError, RuntimeError) as err:
        first = (str(err).splitlines() or [type(err).__name__])[0]
        raise UserError(f"{key}: transformers cannot read the header of '{file}' ({first})") from None


def converted(path: str | Path, key: str, cache: Path, quiet: bool = False) -> Path:
    """The model directory of the GGUF file `path` (named by config key `key`), converted now unless the cache has it.

    Raises:
        UserError: naming `key`, when the file is missing or not GGUF, transformers cannot read it (an architecture it
            does not support), or the gguf package is not installed (with the line that installs it).
    """
    file = Path(path)
    check_file(file, key)
    sha = file_sha256(file)
    out = cache / "gguf" / f"{file.stem}-{sha[:16]}"
    if (out / "config.json").is_file():
        return out
    if not quiet:
        print(f"posttrain: converting {file.name} to a safetensors model directory, once (cached in {out})",
              file=sys.stderr)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.partial")
    try:
        with contextlib.redirect_stderr(io.StringIO()) if quiet else contextlib.nullcontext():  # the loader's bar
            write_model_dir(file, tmp, key)
        (tmp / "gguf_source.json").write_text(json.dumps({"file": str(file.resolve()), "sha256": sha}, indent=1) + "\n")
        try:
            tmp.rename(out)  # whole or not at all; another process's conversion may have landed first
        except OSError:
            if not (out / "config.json").is_file():
                raise
    except OSError as err:
        raise UserError(f"{key}: cannot write the converted model to '{out}' ({err.strerror or err}); set "
                        "warmup.cache_dir or $POSTTRAIN_CACHE to a writable directory") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def write_model_dir(file: Path, out: Path, key: str) -> None:
    """Dequantizes the GGUF `file` into a Hugging Face directory `out`: float32 safetensors, the tokenizer, the chat
    template."""
    import torch
    import transformers

    kwargs = {"gguf_file": file.name}
    verbosity, bars = transformers.logging.get_verbosity(), transformers.logging.is_progress_bar_enabled()
    transformers.logging.set_verbosity_error()  # its progress bars: converting, loading, writing
    transformers.logging.disable_progress_bar()
    try:
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(file.parent, **kwargs)
            model = transformers.AutoModelForCausalLM.from_pretrained(file.parent, dtype=torch.float32, **kwargs)
        except (OSError, ValueError, KeyError, RuntimeError) as err:
            first = (str(err).splitlines() or [type(err).__name__])[0]
            raise UserError(f"{key}: transformers cannot load '{file}' as a causal LM ({first})") from None
        # The dequantized model is an ordinary one: without the loader's quantization record it saves and loads as one.
        model.config.__dict__.pop("quantization_config", None)
        model.hf_quantizer, model.is_quantized = None, False
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
    finally:
        transformers.logging.set_verbosity(verbosity)
        if bars:
            transformers.logging.enable_progress_bar()
