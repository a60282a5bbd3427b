"""The embedded default: a synthetic arithmetic task, a character-level tokenizer and a tiny Llama-style model.

Nothing is downloaded. The model and tokenizer are saved as an ordinary Hugging Face directory (config.json,
model.safetensors, tokenizer.json) and loaded back through `transformers`' Auto classes, so every loading path is the
one a real checkpoint takes. Problems end in ``#### N`` like GSM8K, so the same reward code checks both.
"""

from __future__ import annotations

import random
import string
from pathlib import Path

import torch

from posttrain.errors import ConfigError

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
CHARS = string.digits + string.ascii_letters + string.punctuation + " \n"


def make_problem(rng: random.Random, difficulty: int, max_operand: int = 9) -> dict[str, str]:
    """One problem: `difficulty` + 1 operands in [0, max_operand] joined by + or −, solved one step per line.

    >>> make_problem(random.Random(1), 2)
    {'question': '2-9+1', 'answer': '2-9=-7\\n-7+1=-6\\n#### -6'}
    """
    terms = [rng.randint(0, max_operand) for _ in range(difficulty + 1)]
    ops = [rng.choice("+-") for _ in range(difficulty)]
    total, steps = terms[0], []
    for op, term in zip(ops, terms[1:]):
        new = total + term if op == "+" else total - term
        steps.append(f"{total}{op}{term}={new}")
        total = new
    question = str(terms[0]) + "".join(f"{op}{term}" for op, term in zip(ops, terms[1:]))
    return {"question": question, "answer": "\n".join(steps) + f"\n#### {total}"}


def make_split(seed: int, size: int, difficulty: int, max_operand: int, exclude: set[str] = frozenset()) -> list[dict]:
    """`size` distinct problems from `seed`, none of whose questions is in `exclude` (held-out stays held out)."""
    rng, rows, seen = random.Random(seed), [], set(exclude)
    for _ in range(size * 50):
        row = make_problem(rng, difficulty, max_operand)
        if row["question"] not in seen:
            seen.add(row["question"])
            rows.append(row)
            if len(rows) == size:
                return rows
    raise ConfigError(f"data.train_size: difficulty={difficulty}, max_operand={max_operand} has too few distinct "
                      "problems for the train and test sizes; lower data.train_size or raise data.difficulty")


def task_splits(seed: int, train_size: int, test_size: int, difficulty: int, max_operand: int = 9):
    """(train, test) problems; test questions never appear in train."""
    test = make_split(seed + 1_000_003, test_size, difficulty, max_operand)
    return make_split(seed, train_size, difficulty, max_operand, {r["question"] for r in test}), test


def build_tokenizer():
    """A character-level `PreTrainedTokenizerFast`: one token per character, plus pad/bos/eos/unk."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + list(CHARS))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", clean_up_tokenization_spaces=False)


def build_model_dir(path: str | Path, *, hidden: int = 128, layers: int = 4, heads: int = 4, seed: int = 0,
                    max_len: int = 256) -> Path:
    """Writes a freshly initialised tiny Llama and its tokenizer to `path` as a Hugging Face model directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=max_len,
        tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    path = Path(path)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
