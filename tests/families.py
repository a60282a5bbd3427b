"""Tiny checkpoints of real architectures with a real tokenizer, built offline, for tests.

`bpe_tokenizer` trains a byte-level BPE tokenizer on the GSM8K slice in tests/fixtures/gsm8k (a few hundred tokens,
so that the models stay tiny) and gives it an instruct model's ChatML special tokens and chat template.
`build_family` writes a randomly initialised two-layer model of a transformers architecture (Llama, Qwen2, Qwen3,
Mistral, Gemma) with that tokenizer, as an instruct checkpoint is laid out: safetensors weights, the tokenizer with
its chat template, and a generation_config.json whose `eos_token_id` lists both stop tokens. Each family keeps the
feature that gives it its own code path in transformers (`has_family_feature` checks it), so a test that loads,
scores, samples and trains every family runs five different forwards through posttrain, not one.

    from families import bpe_tokenizer, build_family
    tokenizer = bpe_tokenizer()
    build_family("qwen3", tmp_path / "qwen3", tokenizer)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

GSM8K_TRAIN = Path(__file__).parent / "fixtures" / "gsm8k" / "train_head.jsonl"

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
"""The base model's end of document (also the padding), and the ChatML turn markers; a turn ends with IM_END."""

# ChatML: each message as <|im_start|>role\ncontent<|im_end|>\n, with no system message unless one is given.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

WINDOW = 16
"""Mistral's sliding attention window: shorter than every GSM8K prompt, so that the window changes the outputs."""

# name -> (transformers config class, what sets the family apart here). Shared sizes are in `build_family`.
FAMILIES = {
    "llama": ("LlamaConfig", {"tie_word_embeddings": False}),  # grouped-query attention (4 query, 2 key heads)
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),  # biases on the q, k, v projections
    "qwen3": ("Qwen3Config", {"tie_word_embeddings": True}),  # RMSNorm of each head's queries and keys
    "mistral": ("MistralConfig", {"tie_word_embeddings": False, "sliding_window": WINDOW}),
    "gemma": ("GemmaConfig", {"tie_word_embeddings": True,  # embeddings scaled by √hidden, (1 + w) RMSNorm, GeLU
                              "hidden_activation": "gelu_pytorch_tanh"}),
}


def gsm8k_texts(path: Path = GSM8K_TRAIN) -> list[str]:
    """The questions and answers of a GSM8K file, in order."""
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [text for row in rows for text in (row["question"], row["answer"])]


def bpe_tokenizer(path: str | Path | None = None, vocab_size: int = 512):
    """A byte-level BPE `PreTrainedTokenizerFast` trained on the GSM8K slice, with ChatML specials and template.

    The 256 byte symbols are all in the vocabulary, so any text (unicode included) encodes and decodes back
    unchanged. EOS is `<|im_end|>` (the end of an assistant turn, as in instruct checkpoints) and the padding is
    `<|endoftext|>`. Training is deterministic: the same text gives the same merges.

    Args:
        path: also save the tokenizer there (tokenizer.json, tokenizer_config.json, the chat template).
        vocab_size: tokens in all, the three special ones included.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[ENDOFTEXT, IM_START, IM_END],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    core.train_from_iterator(gsm8k_texts(), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=IM_END, pad_token=ENDOFTEXT,
                                        extra_special_tokens=[IM_START], clean_up_tokenization_spaces=False)
    tokenizer.chat_template = CHAT_TEMPLATE
    if path is not None:
        tokenizer.save_pretrained(path)
    return tokenizer


def stop_ids(tokenizer) -> list[int]:
    """The ids that end a completion, as an instruct checkpoint's generation_config.json lists them."""
    return [tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(ENDOFTEXT)]


def build_family(name: str, path: str | Path, tokenizer, *, seed: int = 0) -> Path:
    """Writes a freshly initialised tiny model of family `name` (a key of FAMILIES) and `tokenizer` to `path`.

    Hidden size 64, 2 layers, 4 query heads of 16 dimensions over 2 key/value heads, MLP width 128, one embedding
    row per token. Initialised from `seed`; saved in float32 as safetensors.

    transformers 5 loads the tokenizer of a `qwen2` directory as its own Qwen2Tokenizer, which keeps the vocabulary,
    merges, specials and template but splits text with Qwen's pattern (each digit alone): there the same text can
    encode to other ids than with `tokenizer`. Tests encode with the tokenizer loaded from the directory.
    """
    import transformers
    from transformers import GenerationConfig

    config_class, features = FAMILIES[name]
    im_end, endoftext = stop_ids(tokenizer)
    config = getattr(transformers, config_class)(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
        bos_token_id=None, eos_token_id=im_end, pad_token_id=endoftext, **features)
    torch.manual_seed(seed)
    model = getattr(transformers, config_class.replace("Config", "ForCausalLM"))(config)
    model.generation_config = GenerationConfig(bos_token_id=None, eos_token_id=[im_end, endoftext],
                                               pad_token_id=endoftext)
    path = Path(path)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def has_family_feature(name: str, model) -> bool:
    """Whether a loaded model has the feature its family is built with here (see FAMILIES)."""
    attn = model.model.layers[0].self_attn
    checks = {
        "llama": lambda: attn.k_proj.out_features < attn.q_proj.out_features,
        "qwen2": lambda: attn.q_proj.bias is not None and attn.o_proj.bias is None,
        "qwen3": lambda: isinstance(getattr(attn, "q_norm", None), torch.nn.Module),
        "mistral": lambda: model.config.sliding_window == WINDOW,
        "gemma": lambda: model.lm_head.weight is model.model.embed_tokens.weight,
    }
    return checks[name]()
