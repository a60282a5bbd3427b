"""Prompts as checkpoints expect them: data presets, chat templates and system prompts, token for token; and the
GSM8K recipe end to end on a tiny chat checkpoint."""

import json

import pytest
from cli_helpers import assert_one_line_error, posttrain, posttrain_here
from conftest import FIXTURES
from families import IM_END, bpe_tokenizer, build_family

from posttrain import config
from posttrain.core.errors import ConfigError
from posttrain.data import prompt_ids, prompt_texts, response_ids, uses_chat
from posttrain.models.embedded import build_tokenizer
from posttrain.schema import DataConfig

GSM8K = FIXTURES / "gsm8k"
ROW = {"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3+4=<<3+4=7>>7\n#### 7"}


@pytest.fixture(scope="module")
def chat_tokenizer():
    return bpe_tokenizer()


def gsm8k(**keys) -> DataConfig:
    return DataConfig(preset="gsm8k", path=str(GSM8K / "train_head.jsonl"), **keys)


def test_presets_fill_what_is_not_given():
    math = DataConfig(preset="math", path="m.jsonl")
    assert (math.prompt_field, math.response_field, math.answer_field, math.answer_format) == \
        ("problem", "solution", "solution", "math")
    assert DataConfig(preset="math", path="m.jsonl", prompt_field="question").prompt_field == "question"
    assert DataConfig().preset == "embedded" and DataConfig(path="x.jsonl").preset == "gsm8k"
    assert DataConfig(test_path="t.jsonl").preset == "gsm8k"  # enough for posttrain eval
    assert DataConfig(path="x.jsonl").answer_format == "number"


@pytest.mark.parametrize("overrides, message", [
    (["data.preset=gsm9k", "data.path=x.jsonl"],
     "data.preset: unknown 'gsm9k'; known: embedded, gsm8k, math, reasoning_gym (as reasoning_gym:TASK"),
    (["data.preset=embedded", "data.path=x.jsonl"], "data.preset: embedded is the built-in task"),
    (["data.preset=math"], "data.path: data.preset=math needs local files"),
    (["data.chat_template=maybe"], "data.chat_template: must be auto, true or false"),
    (["data.answer_format=latex", "data.path=x.jsonl"], "data.answer_format: unknown 'latex'"),
])
def test_bad_data_keys(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        config.load("grpo_math", overrides)


def test_chat_template_renders_the_user_turn(chat_tokenizer):
    cfg = gsm8k(system_prompt="You are careful.")
    assert uses_chat(chat_tokenizer, cfg)
    (text,) = prompt_texts([ROW], cfg, chat_tokenizer)
    assert text == ("<|im_start|>system\nYou are careful.<|im_end|>\n<|im_start|>user\n" + ROW["question"] +
                    "\nSolve it step by step, then give the final number after ####.<|im_end|>\n"
                    "<|im_start|>assistant\n")
    (ids,) = prompt_ids(chat_tokenizer, [ROW], cfg)
    assert chat_tokenizer.decode(ids) == text  # nothing added around the template's own tokens
    assert ids.count(chat_tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3


def test_raw_template_without_or_against_a_chat_template(chat_tokenizer):
    char = build_tokenizer()
    assert not uses_chat(char, gsm8k())  # auto: the tokenizer has none
    assert prompt_texts([ROW], gsm8k(system_prompt="Be brief."), char) == [f"Be brief.\nQ: {ROW['question']}\nA: "]
    off = gsm8k(chat_template=False, template="Question: {prompt}\nAnswer:")
    assert prompt_texts([ROW], off, chat_tokenizer) == [f"Question: {ROW['question']}\nAnswer:"]
    with pytest.raises(ConfigError, match="data.chat_template: true, but the model's tokenizer has no chat template"):
        uses_chat(char, gsm8k(chat_template=True))


def test_sft_response_ends_where_sampling_stops(chat_tokenizer):
    """The target is the assistant turn the template writes after the prompt: the answer and <|im_end|>, not the
    newline after it; prompt + response is the whole conversation's tokenisation."""
    cfg = gsm8k()
    (prompt,), (response,) = prompt_ids(chat_tokenizer, [ROW], cfg), response_ids(chat_tokenizer, [ROW], cfg)
    im_end = chat_tokenizer.convert_tokens_to_ids(IM_END)
    assert response[-1] == im_end and response.count(im_end) == 1
    assert chat_tokenizer.decode(response) == ROW["answer"] + IM_END
    user = ROW["question"] + "\nSolve it step by step, then give the final number after ####."
    whole = chat_tokenizer.apply_chat_template([{"role": "user", "content": user},
                                                {"role": "assistant", "content": ROW["answer"]}], tokenize=False)
    assert chat_tokenizer.decode(prompt + response) + "\n" == whole
    cut = response_ids(chat_tokenizer, [ROW], gsm8k(max_response_len=5))[0]
    assert len(cut) == 5 and cut[-1] == im_end  # cut responses still end their turn


def test_sft_gsm8k_recipe_on_a_chat_checkpoint(tmp_path, chat_tokenizer):
    """The recipe as a user runs it: a chat checkpoint, GSM8K files, greedy, pass@k and maj@k before and after;
    then `posttrain eval` on what it saved, with the chat template in use."""
    model = build_family("qwen2", tmp_path / "qwen2", chat_tokenizer)
    out = tmp_path / "run"
    data = [f"data.path={GSM8K / 'train_head.jsonl'}", f"data.test_path={GSM8K / 'test_head.jsonl'}"]
    proc = posttrain("run", "recipe=sft_gsm8k", f"model.path={model}", f"output_dir={out}", *data, "train.steps=2",
                     "train.batch_size=4", "train.micro_batch_size=4", "train.precision=fp32",
                     "rollout.max_new_tokens=6", "eval.num_problems=4", "eval.k=2", "train.lr=1e-3")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "held-out pass@2:" in proc.stdout and "maj@2:" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert {"accuracy", "pass@2", "maj@2"} <= set(summary["eval_after"])
    saved = json.loads((out / "model" / "tokenizer_config.json").read_text())
    assert "chat_template" in saved or (out / "model" / "chat_template.jinja").is_file()
    proc = posttrain("eval", out / "model", *data, "eval.num_problems=3", "eval.k=2", "rollout.max_new_tokens=4",
                     "-o", tmp_path / "eval.json", "-q")
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "eval.json").read_text())
    assert report["chat_template"] is True and report["answer_format"] == "number" and len(report["records"]) == 3
    assert report["prompt_example"].startswith("<|im_start|>user\n") and report["prompt_example"].endswith(
        "<|im_start|>assistant\n")


def test_sft_gsm8k_needs_a_model():
    assert_one_line_error(posttrain_here("run", "recipe=sft_gsm8k"), "model.path: required by recipe sft_gsm8k")


def test_a_template_that_writes_its_own_bos_gets_no_second_one():
    """Llama-3-style: the tokenizer adds a BOS to plain text, and the chat template writes one itself. The rendered
    prompt must be tokenised without special tokens, or it would start with two."""
    from tokenizers.processors import TemplateProcessing

    tokenizer = bpe_tokenizer()
    bos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    tokenizer._tokenizer.post_processor = TemplateProcessing(single="<|endoftext|> $A",
                                                             special_tokens=[("<|endoftext|>", bos)])
    tokenizer.chat_template = "<|endoftext|>" + tokenizer.chat_template
    assert tokenizer("x")["input_ids"][0] == bos  # plain text does get a BOS
    (ids,) = prompt_ids(tokenizer, [ROW], gsm8k())
    assert ids[0] == bos and ids[1] != bos
    (raw,) = prompt_ids(tokenizer, [ROW], gsm8k(chat_template=False))
    assert raw[0] == bos and raw[1] != bos  # the raw template keeps the tokenizer's own BOS
