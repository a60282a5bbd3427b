"""The embedded model: a character-level tokenizer and a tiny Llama-style model, built from a config, no download.

The model and tokenizer are saved as an ordinary Hugging Face directory (config.json, model.safetensors,
tokenizer.json) and loaded back through `transformers`' Auto classes, so every loading path is the one a real
checkpoint takes.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
CHARS = string.digits + string.ascii_letters + string.punctuation + " \n"


def build_tokenizer(vocab_size: int | None = None):
    """A character-level `PreTrainedTokenizerFast`: one token per character, plus pad/bos/eos/unk.

    `vocab_size` pads the vocabulary with tokens `<unused_i>` that text never encodes to, so that a benchmark's
    model can have a real model's output layer (32,000 rows, say); sampled ones decode to their names.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = SPECIALS + list(CHARS)
    tokens += [f"<unused_{i}>" for i in range(max(0, (vocab_size or 0) - len(tokens)))]
    vocab = {tok: i for i, tok in enumerate(tokens)}
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
