"""The config schema: the groups of a recipe as dataclasses, with defaults, one-line docs and range checks.

Plain data that every layer may read; nothing here looks up a plugin or an engine. Names that must match a registry
(`algorithm.name`, `rewards`, `rollout.engine`, `train.backend`) are checked when a config is loaded
(`posttrain.config.load`), and the `algorithm` group is validated against the chosen plugin's own `Config` there.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain.core.aggregation import MODES
from posttrain.core.errors import ConfigError
from posttrain.core.frozen import Freezable
from posttrain.core.schedules import BETA_SCHEDULES, SCHEDULES


@dataclass
class LoraConfig(Freezable):
    r: int = 0
    """LoRA rank (Hu et al. 2021, via peft); 0 trains every weight. With r > 0 only the adapters (and a critic's value
    head) are trained, and the reference is the policy with its adapter switched off: no second model is loaded."""
    alpha: float = 16.0
    """Scale of the update, alpha / r times B·A."""
    dropout: float = 0.0
    """Dropout on the adapters' input; keep 0 for RL, where scoring and sampling must see the same policy."""
    target_modules: str = "all-linear"
    """Layers that get an adapter: all-linear (every linear layer but the output head), or comma-separated names
    such as q_proj,v_proj."""
    merge: bool = False
    """Also write output_dir/merged_model: the base with the adapter merged in, an ordinary model directory."""

    def __post_init__(self):
        if self.r < 0:
            raise ConfigError(f"r: must be ≥ 0 (got {self.r})")
        if self.alpha <= 0:
            raise ConfigError(f"alpha: must be > 0 (got {self.alpha})")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"dropout: must be in [0, 1) (got {self.dropout})")
        if not [m for m in self.target_modules.split(",") if m.strip()]:
            raise ConfigError("target_modules: name at least one layer, or all-linear")


@dataclass
class ModelConfig(Freezable):
    path: str | None = None
    """Local Hugging Face model directory; null builds the embedded tiny model and warms it up with SFT (cached)."""
    ref_path: str | None = None
    """Reference model directory for methods with a KL or a reference (GRPO β > 0, DPO, PPO); null: the start."""
    teacher_path: str | None = None
    """The teacher of on-policy distillation (algorithm.name=distill): a local Hugging Face directory whose tokenizer is
    the policy's, frozen and scored like the reference. Null with the embedded default: the embedded teacher, the tiny
    model warmed up on worked solutions that never slip (the warm-up with warmup.teacher_accuracy=1), built once and
    cached like the warm-up."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters instead of full fine-tuning (`model.lora.r` > 0)."""


PRECISIONS = ("auto", "fp32", "bf16-mixed", "fp16-mixed", "bf16")


def check_precision(value: str) -> None:
    if value not in PRECISIONS:
        raise ConfigError(f"precision: must be one of {', '.join(PRECISIONS)} (got {value!r})")


@dataclass
class WarmupConfig(Freezable):
    steps: int = 1000
    """SFT steps on the embedded task that turn the random tiny model into a weak but non-zero policy: enough for it to
    converge on its teacher (`teacher_accuracy`), the learning rate decaying to 0 along a cosine after a linear
    warm-up of a tenth of them, so that where it ends depends on the data and the seed, not on the last bits of the
    arithmetic (threads, precision, CPU class)."""
    batch_size: int = 64
    """Problems per warm-up step."""
    lr: float = 3e-3
    """Warm-up peak learning rate."""
    teacher_accuracy: float = 0.3
    """Arithmetic task: how often the worked solutions the warm-up imitates get a step right whose result is not one
    digit (a carry past 9, or below 0); the other times the step slips (the carry or the minus sign dropped) and the
    work goes on from the slip. The warmed-up model slips on those steps when greedy and is right about this often
    when sampling, which RL with a rule reward learns from (docs/embedded.md); 1: a teacher that never slips.
    Other tasks: their rows as they are."""
    demonstrations: int = 16
    """Arithmetic task with teacher_accuracy < 1: worked solutions per training question, each the teacher's afresh;
    enough that a warm-up sees each row once or twice, so the model learns how often the teacher is right on each step
    rather than the draws of one question (16 × 3,000 = 48,000 rows against 1,000 steps × 64 = 64,000 seen)."""
    hidden: int = 128
    """Width of the embedded tiny model."""
    layers: int = 4
    """Transformer blocks of the embedded tiny model."""
    precision: str = "auto"
    """train.precision of the warm-up run (auto: bf16-mixed where the hardware computes bf16, else fp32 or, on a GPU
    without bf16, fp16-mixed); fp32 weights are saved either way."""
    cache_dir: str | None = None
    """Where warmed-up models are kept and reused; null: $POSTTRAIN_CACHE or ~/.cache/posttrain."""

    def __post_init__(self):
        check_precision(self.precision)
        for key in ("steps", "batch_size", "hidden", "layers", "demonstrations"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key}: must be ≥ 1 (got {getattr(self, key)})")
        if not 0 <= self.teacher_accuracy <= 1:
            raise ConfigError(f"teacher_accuracy: must be in [0, 1] (got {self.teacher_accuracy})")
        if self.lr <= 0:
            raise ConfigError(f"lr: must be > 0 (got {self.lr})")


# The layouts `data.preset` names: the fields that hold the question, target response and reference answer, how
# answers are checked (number: the number after `####`, else the last number; math: math-verify on `\\boxed{}`,
# LaTeX or plain answers; reasoning_gym: the task's own scorer on the text after `####`), and the prompt text around
# the question without and with a chat template. `reasoning_gym:TASK` generates its rows (posttrain/data/gym.py).
PRESETS = {
    "embedded": dict(prompt_field="question", response_field="answer", answer_field="answer", answer_format="number",
                     raw="Q: {prompt}\nA: ", chat="{prompt}"),
    "gsm8k": dict(prompt_field="question", response_field="answer", answer_field="answer", answer_format="number",
                  raw="Q: {prompt}\nA: ",
                  chat="{prompt}\nSolve it step by step, then give the final number after ####."),
    "math": dict(prompt_field="problem", response_field="solution", answer_field="solution", answer_format="math",
                 raw="Problem: {prompt}\nSolution: ",
                 chat="{prompt}\nPlease reason step by step, and put your final answer within \\boxed{}."),
    "reasoning_gym": dict(prompt_field="question", response_field="response", answer_field="reference",
                          answer_format="reasoning_gym", raw="Q: {prompt}\nA: ",
                          chat="{prompt}\nGive your final answer after ####, as the last line."),
}
ANSWER_FORMATS = ("number", "math", "reasoning_gym")
GYM = "reasoning_gym:"  # data.preset=reasoning_gym:TASK
# What data.path and data.test_path say when their rows were given from Python (posttrain.Run's data= and test_data=):
# config.yaml records where the rows came from, and nothing is written to disk for them
PYTHON_ROWS = {"data.path": "python:data", "data.test_path": "python:test_data"}
CURRICULA = ("none", "field", "pass_rate")
TASKS = ("arithmetic", "calc")  # the embedded tasks (posttrain/data/embedded.py)


@dataclass
class DataConfig(Freezable):
    preset: str | None = None
    """Layout of the rows and how answers are checked: gsm8k (question, answer ending `#### N`), math (problem,
    solution with a `\\boxed{}` answer, checked with math-verify), embedded (the built-in task, no path) or
    reasoning_gym:TASK (rows generated by reasoning-gym's TASK, e.g. reasoning_gym:chain_sum, scored by its own
    checker; no path; the `reasoning-gym` extra); null: embedded without `path` or `test_path`, gsm8k with either.
    The keys below that are null take the preset's value."""
    path: str | None = None
    """Training rows: a .jsonl or .parquet file or a `datasets` directory (save_to_disk: of a DatasetDict, its train
    split; name a split's own directory, DIR/validation, for another); null: the embedded task."""
    test_path: str | None = None
    """Held-out rows for evaluation, same format (of a DatasetDict, its test split); null with `path` set: the test
    split of `path` when it is a DatasetDict's directory that has one, else the last `eval.num_problems` rows of
    `path`. A held-out question evaluated that a training row asks too is refused, naming both files."""
    prompt_field: str | None = None
    """Field holding the question (gsm8k, embedded: question; math: problem)."""
    response_field: str | None = None
    """Field holding the target response of offline methods such as SFT (gsm8k, embedded: answer; math: solution)."""
    answer_field: str | None = None
    """Field holding the reference answer the accuracy rule checks (gsm8k, embedded: answer; math: solution)."""
    answer_format: str | None = None
    """How answers are checked: number (the number after the last `####`, else the last number; gsm8k, embedded),
    math (math-verify: `\\boxed{}`, fractions, sets, intervals, units; time-bounded; math) or reasoning_gym (the
    task's scorer on the text after the last `####`, the reference a row's JSON `reference`; reasoning_gym:TASK)."""
    template: str | None = None
    """Prompt text around the question, `{prompt}` replaced by it (the user message under a chat template); null:
    the preset's, e.g. "Q: {prompt}\\nA: " without a chat template and "{prompt}" plus an instruction with one."""
    chat_template: bool | str = "auto"
    """Render prompts with the tokenizer's chat template: auto (when the tokenizer has one), true (required) or
    false (the raw template text)."""
    system_prompt: str | None = None
    """A system message before the question (with a chat template), or a line before the prompt (without)."""
    max_prompt_len: int = 512
    """Prompts longer than this many tokens keep their last tokens."""
    max_response_len: int = 512
    """Offline responses longer than this many tokens are cut."""
    curriculum: str = "none"
    """Order of the training rows (posttrain/data/curriculum.py): none (uniform epochs); field (easiest first by
    difficulty_field, the pool growing with Platanios et al. 2019's competence); pass_rate (drawn ∝ max(1 − s,
    floor) by each prompt's running pass rate s, Kimi k1.5 §2.3.4)."""
    difficulty_field: str | None = None
    """curriculum=field: the numeric field of each row that ranks it, lower = easier (required there)."""
    curriculum_start: float = 0.2
    """curriculum=field: c0, the share of the easiest rows drawn from at step 0, in (0, 1]."""
    curriculum_steps: int | None = None
    """curriculum=field: T, the step from which every row is drawn; null: half of train.steps."""
    curriculum_floor: float = 0.05
    """curriculum=pass_rate: the least weight a row keeps, so solved prompts are still drawn now and then, in (0, 1]."""
    task: str = "arithmetic"
    """Embedded task: arithmetic (one-digit sums worked one step per line) or calc (a product of two-digit numbers
    and more terms, worked with one call to the calculator tool, `env.name=calculator`; recipe grpo_tools)."""
    difficulty: int = 2
    """Embedded task: operations per problem (arithmetic 1: a±b, 2: a±b±c, ...; calc 1: a*b, 2: a*b±c, ...)."""
    max_operand: int | None = None
    """Embedded task: the largest operand (arithmetic: from 0, calc: from 10); null: 9 (arithmetic), 99 (calc)."""
    task_options: dict[str, Any] = field(default_factory=dict)
    """reasoning_gym:TASK: the task's own config keys, e.g. {min_terms: 2, max_terms: 2, max_digits: 1} for
    chain_sum (reasoning-gym's `TASK` config class lists them); {}: its defaults."""
    train_size: int = 3000
    """Embedded and reasoning-gym tasks: training problems."""
    test_size: int = 500
    """Embedded and reasoning-gym tasks: held-out problems, never in the training split."""
    seed: int = 1234
    """Embedded and reasoning-gym tasks: seed of the problem generator."""

    def __post_init__(self):
        preset = self.preset or ("embedded" if self.path is None and self.test_path is None else "gsm8k")
        if preset == "reasoning_gym" or preset.startswith(GYM) and not preset[len(GYM):].strip():
            raise ConfigError("preset: reasoning_gym needs a task, e.g. reasoning_gym:chain_sum")
        if self.layout_of(preset) not in PRESETS:
            raise ConfigError(f"preset: unknown {preset!r}; known: {', '.join(PRESETS)} (as reasoning_gym:TASK)")
        if preset == "embedded" and self.path is not None:
            raise ConfigError("preset: embedded is the built-in task and takes no data.path (give gsm8k or math)")
        if preset.startswith(GYM) and (self.path is not None or self.test_path is not None):
            raise ConfigError(f"preset: {preset} generates its rows and takes no data.path or data.test_path "
                              "(give gsm8k or math)")
        if not self.generated_by(preset) and self.path is None and self.test_path is None:
            raise ConfigError(f"path: data.preset={preset} needs local files (data.path, data.test_path)")
        if self.task_options and not preset.startswith(GYM):
            raise ConfigError(f"task_options: only a reasoning_gym:TASK preset takes options (data.preset={preset})")
        for key in ("prompt_field", "response_field", "answer_field", "answer_format"):
            if getattr(self, key) is None:
                setattr(self, key, PRESETS[self.layout_of(preset)][key])
        self.preset = preset
        if self.answer_format not in ANSWER_FORMATS:
            raise ConfigError(f"answer_format: unknown {self.answer_format!r}; known: {', '.join(ANSWER_FORMATS)}")
        if self.answer_format == "reasoning_gym" and preset == "embedded":
            raise ConfigError("answer_format: reasoning_gym scores against a reasoning-gym entry, which the embedded "
                              "task's rows do not hold (use data.preset=reasoning_gym:TASK)")
        if self.chat_template not in (True, False, "auto"):
            raise ConfigError(f"chat_template: must be auto, true or false (got {self.chat_template!r})")
        if self.template is not None and "{prompt}" not in self.template:
            raise ConfigError(f"template: must contain {{prompt}} (got {self.template!r})")
        if self.task not in TASKS:
            raise ConfigError(f"task: unknown {self.task!r}; known: {', '.join(TASKS)}")
        if self.max_operand is None:
            self.max_operand = 99 if self.task == "calc" else 9
        for key in ("max_prompt_len", "max_response_len", "difficulty", "max_operand", "train_size", "test_size"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key}: must be ≥ 1 (got {getattr(self, key)})")
        if self.curriculum not in CURRICULA:
            raise ConfigError(f"curriculum: unknown {self.curriculum!r}; known: {', '.join(CURRICULA)}")
        if self.curriculum == "field" and not self.difficulty_field:
            raise ConfigError("difficulty_field: required with data.curriculum=field (the row field that ranks rows)")
        for key in ("curriculum_start", "curriculum_floor"):
            if not 0 < getattr(self, key) <= 1:
                raise ConfigError(f"{key}: must be in (0, 1] (got {getattr(self, key)})")
        if self.curriculum_steps is not None and self.curriculum_steps < 1:
            raise ConfigError(f"curriculum_steps: must be ≥ 1 or null (got {self.curriculum_steps})")

    @staticmethod
    def layout_of(preset: str) -> str:
        """The key of PRESETS that `preset` uses: itself, or reasoning_gym for reasoning_gym:TASK."""
        return "reasoning_gym" if preset.startswith(GYM) else preset

    @staticmethod
    def generated_by(preset: str) -> bool:
        """Whether `preset` makes its own rows (the embedded task, a reasoning-gym task) rather than read files."""
        return preset == "embedded" or preset.startswith(GYM)

    @property
    def gym_task(self) -> str | None:
        """The reasoning-gym task of a reasoning_gym:TASK preset, else None."""
        return self.preset[len(GYM):].strip() if self.preset and self.preset.startswith(GYM) else None


# `rollout` is one group of keys to a user (`rollout.temperature`, `rollout.placement`, `rollout.elite_pool`), made of
# the parts below, each with its own keys and checks: how a completion is drawn, where sampling runs, how the trainer
# corrects for a sampler that is not its current policy, and the keys of each online stage, beside the stage's name.
# docs/config.md lists them part by part (RolloutConfig.PARTS); the rules between parts are RolloutConfig's.


@dataclass
class Sampling(Freezable):
    """How each completion is drawn: the engine, its sampling settings and budget, and vLLM's memory."""

    TITLE = "sampling"  # its heading in docs/config.md

    engine: str = "hf"
    """Sampling engine (`posttrain.rollout`): hf (the trainer's own model, a KV-cache decode loop) or vllm (a vLLM
    engine in the training process, weights pushed to it after every update; `pip install "posttrain[vllm]"`)."""
    temperature: float = 1.0
    """Sampling temperature; log-probs are scored at the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    max_new_tokens: int = 64
    """Token budget per completion; a completion without EOS by then is truncated."""
    compact_every: int = 16
    """hf: every this many tokens, the rows that have ended leave the decode loop's batch (their KV cache rows freed,
    their logits no longer computed); the tokens drawn are the same, and their log-probs too, to float rounding
    (bench/decode_rows.py measures it); 0: every row stays until the last one ends."""
    gpu_memory_utilization: float = 0.3
    """vllm: the share of the GPU's memory vLLM takes for its weights and KV cache (on CPU: see kv_cache_gb)."""
    kv_cache_gb: float | None = None
    """vllm: KV cache size in GiB; null: on a GPU, what gpu_memory_utilization leaves; on CPU, enough for one step's
    sequences at full length."""
    max_model_len: int | None = None
    """vllm: the longest prompt + completion it accepts; null: the model's max_position_embeddings."""

    def check(self):
        if self.temperature <= 0:
            raise ConfigError(f"temperature: must be > 0 (got {self.temperature})")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p: must be in (0, 1] (got {self.top_p})")
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens: must be ≥ 1 (got {self.max_new_tokens})")
        if self.compact_every < 0:
            raise ConfigError(f"compact_every: must be ≥ 0 (got {self.compact_every})")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization: must be in (0, 1] (got {self.gpu_memory_utilization})")
        if self.kv_cache_gb is not None and self.kv_cache_gb <= 0:
            raise ConfigError(f"kv_cache_gb: must be > 0 or null (got {self.kv_cache_gb})")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len: must be ≥ 2 or null (got {self.max_model_len})")


PLACEMENTS = ("colocated", "separate")  # rollout.placement
LAUNCHERS = ("local", "ray")  # rollout.launcher
RAY_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")  # ray.strategy: Ray's placement group strategies
REFERENCE_ON = ("trainer", "workers")  # rollout.reference_on


@dataclass
class Placement(Freezable):
    """Where sampling runs (docs/async.md): in the training process, or in rollout worker processes (their number,
    threads, time-outs and restarts, how far ahead they may sample, how weights reach them, who scores the
    reference). Every key but `placement` applies to placement=separate."""

    TITLE = "placement"  # its heading in docs/config.md

    placement: str = "colocated"
    """Where sampling runs (docs/async.md): colocated, in the training process, between updates; separate, in rollout
    worker processes with their own copy of the weights, pushed to them after every update, so that sampling the
    next batches overlaps the update (online methods)."""
    max_staleness: int = 0
    """separate: k, how many policy versions the workers may run ahead of the trainer: a batch trained by the update
    to version v was sampled by version v − 1 − k or later. 0 is the synchronous algorithm (on CPU with the hf
    engine, byte for byte the colocated run); each step logs staleness/mean and staleness/max."""
    launcher: str = "local"
    """separate: what starts the workers and watches them. local: processes of the first training process, on its
    machine's cores; ray: Ray actors, each placed by a placement group bundle of its own on any node of the Ray
    cluster (`ray.address`), restarted by Ray when they die (docs/distributed.md; `pip install 'posttrain[ray]'`)."""
    workers: int = 1
    """separate: rollout worker processes; a step's prompts are split between them. With several training processes
    the first starts them and every process samples through them."""
    worker_threads: int = 0
    """separate: compute threads (and cores, where there are enough) of each worker; 0: the usable cores shared
    evenly between the workers and the trainer. Under launcher=ray, the CPUs each worker's bundle reserves."""
    gpus: int = 0
    """separate: GPUs of each rollout worker's own (0: it samples on CPU cores; 1: on a GPU, the hf engine). local:
    the workers take the machine's last GPUs, which the training processes leave them; ray: each bundle reserves
    them. Weights go over NCCL from a trainer on a GPU (gloo from one on CPU), each push watched by a time-out."""
    worker_timeout_s: float = 600.0
    """separate: a weight push or a sampling request a worker has not answered within this many seconds counts as
    hung: the worker is killed and started again, and its prompts are sent again."""
    max_worker_restarts: int = 3
    """separate: restarts of a worker that died or hung before the run stops with an error naming it."""
    weight_bucket_mb: float = 64.0
    """separate: weights travel to the workers in buckets of at most this many MiB (a larger tensor goes alone)."""
    reference_on: str = "trainer"
    """separate, online methods with a reference (β > 0) or a distillation teacher: where the log-probs of each
    sampled batch under these frozen models are computed. trainer: by the training process before its update; workers:
    by the rollout workers once the batch is made, each holding a frozen copy of the reference (model.ref_path, else
    the starting policy, which is LoRA's base too) and of the teacher (model.teacher_path, or the embedded one), so
    that the trainer neither holds nor runs them and the overlap takes their forwards off the trainer's side. The two
    agree to float rounding, not bit for bit (docs/async.md)."""

    @property
    def stale(self) -> bool:
        """Samples may be older than the weights they train (separate placement, max_staleness ≥ 1)."""
        return self.placement == "separate" and self.max_staleness > 0

    def check(self):
        if self.placement not in PLACEMENTS:
            raise ConfigError(f"placement: unknown {self.placement!r}; known: {', '.join(PLACEMENTS)}")
        for key, low in (("max_staleness", 0), ("workers", 1), ("worker_threads", 0), ("max_worker_restarts", 0),
                         ("gpus", 0)):
            if getattr(self, key) < low:
                raise ConfigError(f"{key}: must be ≥ {low} (got {getattr(self, key)})")
        for key in ("worker_timeout_s", "weight_bucket_mb"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"{key}: must be > 0 (got {getattr(self, key)})")
        if self.reference_on not in REFERENCE_ON:
            raise ConfigError(f"reference_on: unknown {self.reference_on!r}; known: {', '.join(REFERENCE_ON)}")
        if self.launcher not in LAUNCHERS:
            raise ConfigError(f"launcher: unknown {self.launcher!r}; known: {', '.join(LAUNCHERS)}")
        if self.gpus > 1:
            raise ConfigError(f"gpus: one GPU a worker for now (got {self.gpus}); several need vLLM's tensor "
                              "parallelism, which the workers do not run yet: give rollout.workers instead")
        if self.gpus and self.engine != "hf":
            raise ConfigError(f"gpus: workers on GPUs run the hf engine for now (got engine={self.engine}): vLLM "
                              "on a worker's GPU would take weights through its own NCCL transfer, not wired yet")
        if self.placement == "colocated":
            moved = [f.name for f in dataclasses.fields(Placement)
                     if f.name != "placement" and getattr(self, f.name) != f.default]
            if moved:
                raise ConfigError(f"{moved[0]}: applies to rollout.placement=separate (got placement=colocated)")


PROXIMAL = ("trainer", "sampler")  # rollout.proximal
STALE_TIS_CAP = 2.0  # rollout.tis_cap where samples may be stale and none is given
TIS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")  # rollout.tis_mode


@dataclass
class OffPolicyCorrection(Freezable):
    """How the trainer corrects for samples its current weights did not draw: the rollout engine's own rounding, or
    samples drawn by an older policy (placement=separate with max_staleness ≥ 1). The plan resolves the nulls
    (posttrain/train/plan.py); `posttrain explain` prints what it chose."""

    TITLE = "off-policy correction"  # its heading in docs/config.md

    proximal: str | None = None
    """π_old of the clipped ratio of PPO, GRPO and GSPO: trainer, the trainer's log-probs under the weights at the
    batch's start, with tis_cap's weight for the sampler's difference from them (the decoupled objective); sampler,
    the log-probs the rollout engine reported, so that the ratio itself weights each token by π_θ / π_rollout and its
    clip bounds how far an update moves a token from the policy that sampled it (PPO's own objective; no tis_cap).
    null: sampler where samples may be stale (placement=separate, max_staleness ≥ 1) for a method with a clipped
    ratio, unless tis_cap, tis_mode or elite_pool is given; else trainer. docs/async.md compares them on stale samples."""
    tis_cap: float | None = None
    """Importance sampling against the rollout engine: each token's GC is multiplied by a weight from the ratio
    ρ = π_trainer / π_rollout, π_rollout the probability the rollout engine reported for the token it drew (Yao et al.
    2025), bounded by this cap C as `tis_mode` says; null: off, except where samples may be stale (placement=separate,
    max_staleness ≥ 1) and `proximal` is trainer: there C = 2 (docs/async.md)."""
    tis_mode: str = "token_truncate"
    """How tis_cap bounds the ratio: token_truncate, min(ρ_t, C) per token; token_mask, ρ_t, or 0 where ρ_t > C;
    sequence_truncate, min(ρ, C) of the sequence's ratio ρ = Π_t ρ_t on all its tokens; sequence_mask, ρ, or 0 for the
    whole sequence where ρ > C (docs/unified_view.md)."""

    def check(self):
        if self.proximal is not None and self.proximal not in PROXIMAL:
            raise ConfigError(f"proximal: unknown {self.proximal!r}; known: {', '.join(PROXIMAL)}")
        if self.proximal == "sampler" and (self.tis_cap is not None or self.tis_mode != "token_truncate"):
            key = "tis_cap" if self.tis_cap is not None else "tis_mode"
            raise ConfigError(f"{key}: with proximal=sampler the clipped ratio already weights each token by "
                              f"π_θ / π_rollout; drop {key}, or use proximal=trainer")
        if self.tis_cap is not None and self.tis_cap <= 0:
            raise ConfigError(f"tis_cap: must be > 0 or null (got {self.tis_cap})")
        if self.tis_mode not in TIS_MODES:
            raise ConfigError(f"tis_mode: unknown {self.tis_mode!r}; known: {', '.join(TIS_MODES)}")


@dataclass
class DynamicSamplingKeys(Freezable):
    """The dynamic sampling stage (posttrain/stages/dynamic_sampling.py)."""

    TITLE = "stage: dynamic sampling"  # its heading in docs/config.md

    dynamic_sampling: bool = False
    """DAPO's dynamic sampling (arXiv:2503.14476): drop the groups whose rewards are all equal (no advantage to
    learn from) and sample more prompts until the step has batch_size groups that differ, at most
    max_sampling_rounds times; the extra rollouts are counted (sampling_rounds, dropped_groups)."""
    max_sampling_rounds: int = 4
    """dynamic_sampling: the most sampling rounds a step takes; if the rounds run out, equal-reward groups fill the
    batch (they add nothing but the KL term) and filled_groups counts them."""

    def check(self):
        if self.max_sampling_rounds < 1:
            raise ConfigError(f"max_sampling_rounds: must be ≥ 1 (got {self.max_sampling_rounds})")


@dataclass
class AdaptiveTemperatureKeys(Freezable):
    """The adaptive temperature stage (posttrain/stages/temperature.py)."""

    TITLE = "stage: adaptive temperature"  # its heading in docs/config.md

    adaptive_temperature: bool = False
    """Move the sampling temperature each step toward a target entropy of the sampled tokens, within
    [min_temperature, max_temperature] (posttrain/core/schedules.py, adapted_temperature); `temperature` is the first
    step's. Log-probs are scored at each step's own temperature; metrics.jsonl logs temperature and entropy."""
    target_entropy: float | None = None
    """adaptive_temperature: the target, nats per sampled token; null: the first step's."""
    min_temperature: float = 0.5
    """adaptive_temperature: the lowest temperature it sets."""
    max_temperature: float = 2.0
    """adaptive_temperature: the highest temperature it sets."""

    def check(self):
        if not 0 < self.min_temperature <= self.max_temperature:
            raise ConfigError(f"min_temperature: must be > 0 and ≤ max_temperature (got {self.min_temperature}, "
                              f"{self.max_temperature})")
        if self.target_entropy is not None and self.target_entropy <= 0:
            raise ConfigError(f"target_entropy: must be > 0 or null (got {self.target_entropy})")


@dataclass
class AdaptiveGroupSizeKeys(Freezable):
    """Per-difficulty group sizes (posttrain/data/difficulty.py), fed by the pass-rate stage
    (posttrain/stages/pass_rates.py)."""

    TITLE = "stage: per-difficulty group size"  # its heading in docs/config.md

    adaptive_group_size: bool = False
    """Per-difficulty G: each prompt's group size from its running pass rate, in [min_group_size, max_group_size],
    the step's samples still batch_size × group_size (posttrain/data/difficulty.py); group methods."""
    min_group_size: int = 4
    """adaptive_group_size: the smallest G (an easy prompt's)."""
    max_group_size: int = 8
    """adaptive_group_size: the largest G (a hard prompt's)."""
    group_size_target: float = 0.9
    """adaptive_group_size: the chance, at the prompt's pass rate, that its group holds a correct sample."""

    def check(self):
        if not 2 <= self.min_group_size <= self.max_group_size:
            raise ConfigError(f"min_group_size: must be ≥ 2 and ≤ max_group_size (got {self.min_group_size}, "
                              f"{self.max_group_size})")
        if not 0 < self.group_size_target < 1:
            raise ConfigError(f"group_size_target: must be in (0, 1) (got {self.group_size_target})")


@dataclass
class EliteReplayKeys(Freezable):
    """The elite replay stage (posttrain/stages/elite.py)."""

    TITLE = "stage: elite replay"  # its heading in docs/config.md

    elite_pool: int = 0
    """Elite replay (posttrain/sources/elite.py): keep the best completion sampled so far for up to this many prompts
    (LRU), and when a prompt's group does worse than it, replace the group's lowest-reward sample by it; 0: off.
    Fires only when a prompt is drawn again (from the second pass over the training rows); online methods with at
    least 2 samples per prompt."""
    elite_is_cap: float = 1.0
    """C of a replayed token's off-policy weight min(π_old / μ, C) on GC, μ the older policy that drew the elite
    (V-trace's ρ̄ truncation, arXiv:1802.01561): 1 never up-weights a token; biased, but bounded by C."""

    def check(self):
        if self.elite_pool < 0:
            raise ConfigError(f"elite_pool: must be ≥ 0 (got {self.elite_pool})")
        if self.elite_is_cap <= 0:
            raise ConfigError(f"elite_is_cap: must be > 0 (got {self.elite_is_cap})")


@dataclass
class RolloutConfig(EliteReplayKeys, AdaptiveGroupSizeKeys, AdaptiveTemperatureKeys, DynamicSamplingKeys,
                    OffPolicyCorrection, Placement, Sampling):
    """How the online methods get their samples, in parts: how a completion is drawn, where sampling runs, how the
    trainer corrects for a sampler that is not its current policy, and the keys of each online stage. All are written
    `rollout.KEY`."""

    # dataclasses lay out the last base's fields first, so the keys run in PARTS' order

    PARTS = (Sampling, Placement, OffPolicyCorrection, DynamicSamplingKeys, AdaptiveTemperatureKeys,
             AdaptiveGroupSizeKeys, EliteReplayKeys)

    def __post_init__(self):
        for part in self.PARTS:
            part.check(self)  # each part's own function, called through its class (the bases share the name)
        # the rules between parts
        if self.proximal == "sampler" and self.elite_pool:
            raise ConfigError("proximal: sampler takes the ratio against each row's sampler, and an elite pool's "
                              "replayed rows are weighted against theirs by elite_is_cap; use proximal=trainer")
        if self.tis_mode != "token_truncate" and self.tis_cap is None and not self.stale:  # else C = 2 (the plan)
            raise ConfigError(f"tis_mode: {self.tis_mode} bounds the ratio by tis_cap, which is off (null); give "
                              "rollout.tis_cap=C")


OFFLOADS = ("none", "optimizer", "params")


@dataclass
class TrainConfig(Freezable):
    steps: int = 100
    """Optimizer steps (× the algorithm's epochs per batch)."""
    batch_size: int = 16
    """Prompts (online methods) or rows (offline methods) per step, per process."""
    micro_batch_size: int = 64
    """Sequences per forward/backward; gradients are accumulated over the batch. Unused when micro_batch_tokens is
    set."""
    micro_batch_tokens: int | None = None
    """Micro-batches by a token budget instead of a row count (it wins over micro_batch_size): rows longest first,
    each micro-batch filled while it computes at most N tokens (real tokens when packing; rows × its longest row
    when padded), a unit longer than N alone (DPO's pair stays whole). Applies to the update, the critic and the
    scoring passes (reference, old log-probs, values). Processes may then run different numbers of micro-batches:
    they agree on the most and the others run empty ones, so the collectives pair. null: micro_batch_size rows."""
    packing: bool = False
    """Run each micro-batch on its sequences packed end to end in rows as wide as its longest (position ids restart
    per sequence and attention stays inside each), with no compute on padding; the log-probabilities, and so the
    gradient, are the padded ones. For models whose attention transformers confines (Llama, Mistral, Qwen2, Qwen3,
    Gemma); others run padded, with a notice."""
    lr: float = 1e-5
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up steps, then `lr_schedule`."""
    lr_schedule: str = "constant"
    """After the warm-up: constant; cosine, from lr down to min_lr; cosine_restarts, that cosine over lr_cycles equal
    cycles, back to lr at each restart (posttrain/core/schedules.py has the formulas)."""
    min_lr: float = 0.0
    """The floor a cosine schedule decays to."""
    lr_cycles: int = 1
    """Cosine cycles of cosine_restarts (4: three warm restarts)."""
    beta_schedule: str = "constant"
    """The KL weight β over the run, for methods with a KL penalty to the reference (GRPO and its variants, PPO):
    constant (algorithm.beta); piecewise, beta_values over equal stages of the run; cosine, from beta_values[0] to
    beta_values[1] (posttrain/core/schedules.py). A schedule sets β each step; algorithm.beta must be > 0 (so that a
    reference is loaded), and metrics.jsonl logs the step's beta."""
    beta_values: list[float] = field(default_factory=list)
    """beta_schedule's values: the stages of piecewise (e.g. [0.05, 0.02, 0.01]), the start and end of cosine."""
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm; 0 disables it."""
    loss_agg: str = "seq_mean_token_mean"
    """How per-token terms become the loss: seq_mean_token_mean (paper), token_mean (DAPO), seq_mean_token_sum_norm."""
    loss_agg_norm: float | None = None
    """Constant L of seq_mean_token_sum_norm (Dr. GRPO); null: rollout.max_new_tokens."""
    log_samples: bool = False
    """Write every trained sample to samples.jsonl in the run directory, a line each: the step, the prompt, the
    completion, and where the method has them the reward and the policy version that sampled it (each process of a
    multi-process run writes its own rows, samples.rank<N>.jsonl beyond the first)."""
    save_every: int = 0
    """Write a checkpoint every N steps under output_dir/checkpoints (the model and the training state a run resumes
    from: optimizer, schedule, random generators, data position); 0: only the final model."""
    keep_checkpoints: int = 0
    """Keep only the newest N checkpoints; 0: keep them all."""
    max_skipped_steps: int = 10
    """A step whose loss or gradient norm is not finite is skipped (weights and AdamW state unchanged; counted as
    skipped_steps); after this many in a row the run writes a checkpoint and stops with an error; 0: never stops."""
    backend: str = "ddp"
    """How training is distributed (`posttrain.backends`): ddp (every process holds the whole model; data parallel
    under torchrun) or fsdp2 (each of N processes holds 1/N of every weight, gradient and AdamW state)."""
    offload: str = "none"
    """What lives in CPU memory between uses: none; optimizer (AdamW state, stepped on CPU: zero2, zero3); params
    (weights, gradients and AdamW state: fsdp2, zero3). Each backend says which it supports."""
    precision: str = "auto"
    """auto: bf16-mixed where the device computes bf16 natively (CUDA with bf16; a CPU with AVX512-BF16 or AMX),
    fp16-mixed on a GPU without bf16, fp32 elsewhere (posttrain/core/precision.py; the run prints its choice);
    fp32; bf16-mixed: bf16 compute (autocast), fp32 weights, gradients and AdamW state; fp16-mixed: the same in fp16,
    with a dynamic loss scale; bf16: weights, gradients and AdamW state all in bf16. Log-softmax is float32 in every
    mode; models only scored (reference, reward model) are held in the compute dtype unless fp32."""
    threads: int = 0
    """Compute threads of each process; 0 fits them to the machine: the cores the process may use (CPU affinity, a
    cgroup quota; shared among the processes of one machine), one fewer for each core another process keeps busy,
    checked after every step (posttrain/core/threads.py). OMP_NUM_THREADS, when set, pins them as N does."""

    def __post_init__(self):
        check_precision(self.precision)
        if self.offload not in OFFLOADS:
            raise ConfigError(f"offload: unknown {self.offload!r}; known: {', '.join(OFFLOADS)}")
        if self.loss_agg not in MODES:
            raise ConfigError(f"loss_agg: unknown mode {self.loss_agg!r}; known: {', '.join(MODES)}")
        for key in ("steps", "batch_size", "micro_batch_size"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key}: must be ≥ 1 (got {getattr(self, key)})")
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < 1:
            raise ConfigError(f"micro_batch_tokens: must be ≥ 1 or null (got {self.micro_batch_tokens})")
        if self.lr <= 0:
            raise ConfigError(f"lr: must be > 0 (got {self.lr})")
        for key in ("weight_decay", "warmup_steps", "max_grad_norm", "save_every", "keep_checkpoints",
                    "max_skipped_steps", "threads"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{key}: must be ≥ 0 (got {getattr(self, key)})")
        if self.lr_schedule not in SCHEDULES:
            raise ConfigError(f"lr_schedule: unknown {self.lr_schedule!r}; known: {', '.join(SCHEDULES)}")
        if not 0 <= self.min_lr <= self.lr:
            raise ConfigError(f"min_lr: must be between 0 and lr={self.lr} (got {self.min_lr})")
        if self.lr_cycles < 1:
            raise ConfigError(f"lr_cycles: must be ≥ 1 (got {self.lr_cycles})")
        if self.beta_schedule not in BETA_SCHEDULES:
            raise ConfigError(f"beta_schedule: unknown {self.beta_schedule!r}; known: {', '.join(BETA_SCHEDULES)}")
        wanted = {"constant": (0, "none"), "piecewise": (len(self.beta_values) or 1, "at least one"),
                  "cosine": (2, "two, the start and the end")}[self.beta_schedule]
        if len(self.beta_values) != wanted[0] or any(v < 0 for v in self.beta_values):
            raise ConfigError(f"beta_values: {self.beta_schedule} takes {wanted[1]} value(s) ≥ 0 "
                              f"(got {self.beta_values})")
        if self.loss_agg_norm is not None and self.loss_agg_norm <= 0:
            raise ConfigError(f"loss_agg_norm: must be > 0 (got {self.loss_agg_norm})")


def weights_dtype(precision: str, trained: bool) -> str:
    """The dtype a model's weights are loaded in under `train.precision` (as resolved: not auto): trained models keep
    fp32 master weights unless the precision is pure bf16; models that are only scored are held in the compute dtype
    (bf16, or fp16 under fp16-mixed) unless it is fp32."""
    if precision == "auto":
        raise ValueError("train.precision=auto is resolved for the device before weights are loaded")
    if precision == "fp32" or (trained and precision.endswith("-mixed")):
        return "float32"
    return "float16" if precision == "fp16-mixed" else "bfloat16"


STOP_ON = ("none", "accuracy", "kl")  # eval.stop_on: what early stopping watches


@dataclass
class EvalConfig(Freezable):
    num_problems: int = 200
    """Held-out problems scored by greedy decoding before and after training; 0 skips evaluation."""
    every: int = 0
    """Also evaluate every N steps (logged as eval_accuracy in metrics.jsonl); 0: before and after only."""
    batch_size: int = 200
    """Problems decoded at once."""
    max_new_tokens: int | None = None
    """Token budget per answer; null: rollout.max_new_tokens."""
    k: int = 0
    """Also sample each problem (at rollout.temperature and top_p) for pass@k and maj@k; 0: greedy only."""
    n: int | None = None
    """Samples per problem behind pass@k's unbiased estimate (≥ k; more lowers its variance); null: k."""
    stop_on: str = "none"
    """Early stopping, judged at each evaluation of `every` (posttrain/train/evaluation.py, EarlyStop): none;
    accuracy, the held-out greedy accuracy: `patience` evaluations in a row below the best by more than `min_delta`
    stop the run, whose model is then the best evaluation's; kl, the mean training KL to the reference since the
    previous evaluation: `patience` evaluations in a row that each grew it by more than `min_delta` stop the run, whose
    model is then that of the evaluation before the growth began."""
    patience: int = 3
    """Evaluations in a row that count against the run before it stops."""
    min_delta: float = 0.05
    """How much worse an evaluation must be to count, relatively: 0.05 is 5% (below the best accuracy; above the
    previous evaluation's KL)."""

    def __post_init__(self):
        for key, low in (("num_problems", 0), ("every", 0), ("batch_size", 1), ("k", 0), ("patience", 1)):
            if getattr(self, key) < low:
                raise ConfigError(f"{key}: must be ≥ {low} (got {getattr(self, key)})")
        if self.stop_on not in STOP_ON:
            raise ConfigError(f"stop_on: unknown {self.stop_on!r}; known: {', '.join(STOP_ON)}")
        if self.stop_on != "none" and not (self.every and self.num_problems):
            raise ConfigError(f"stop_on: {self.stop_on} is judged at the evaluations of eval.every; set eval.every "
                              "and eval.num_problems > 0")
        if self.min_delta < 0:
            raise ConfigError(f"min_delta: must be ≥ 0 (got {self.min_delta})")
        if self.n is not None and self.n < max(self.k, 1):
            raise ConfigError(f"n: must be ≥ k = {self.k} and ≥ 1, or null (got {self.n})")


@dataclass
class RewardModelConfig(Freezable):
    path: str | None = None
    """Local sequence-classification model directory whose score is added to the rule rewards; null: none."""
    weight: float = 1.0
    """Weight of the reward model's score."""
    process_path: str | None = None
    """Local token-classification model directory that scores each step (rewards.process=model): a process reward
    model (rewards/process_model.py); null: none."""


PROCESS_REWARDS = ("none", "steps", "model", "turns")  # rewards.process: where step rewards come from
REWARD_NORMS = ("none", "group", "batch")  # rewards.normalize: over which samples each objective is z-scored


@dataclass
class RewardsConfig(Freezable):
    """The `rewards` group. A recipe writes it flat: registered rewards by name with their weights, beside the
    reserved keys, e.g. `{accuracy: 1.0, format: 0.1, custom: {my_rewards.py:brevity: 0.5}, timeout_s: 10}`."""

    RESERVED = ("custom", "timeout_s", "overlong_buffer", "overlong_penalty", "process", "normalize")  # not rewards

    weights: dict[str, float] = field(default_factory=lambda: {"accuracy": 1.0})
    """Registered rule rewards (rewards/) and their weights, written straight in the group: {accuracy: 1.0,
    format: 0.1}. A group that names no reward at all, here or in `custom`, gets {accuracy: 1.0}."""
    custom: dict[str, float] = field(default_factory=dict)
    """Your own reward functions, `path/to/file.py:function` -> weight; a relative path is read from the current
    directory. On the command line: 'rewards.custom={path/to/file.py:function: 0.5}'."""
    timeout_s: float = 10.0
    """Wall-clock bound in seconds on each reward call, one completion per call; past it the sample scores 0 and
    counts in reward/timeouts."""
    overlong_buffer: int = 0
    """DAPO's soft overlong punishment (rewards/overlong.py): the last N tokens of rollout.max_new_tokens, over which
    a completion's reward falls linearly by up to overlong_penalty (a truncated one loses all of it); 0: off. Online
    methods."""
    overlong_penalty: float = 1.0
    """The weight of the overlong punishment: what a completion that reaches the budget loses."""
    process: str = "none"
    """Step rewards for the methods that train on them (grpo_ps): none; steps, the embedded task's rule, each worked
    line checked (rewards/steps.py); model, a process reward model at reward_model.process_path; turns, each model
    turn of an episode (env.name) a step, rewarded by the environment's reply to it, the last turn by the outcome
    rewards too."""
    normalize: str = "none"
    """Each objective (rule, custom function, reward model) z-scored before the weighted sum (GDPO): none, the plain
    weighted sum; group, over the samples of each prompt; batch, over each process's samples of the step (each
    dynamic-sampling round apart). Online methods that train on the reward's spread (not Online RFT's threshold)."""

    def __post_init__(self):
        if self.process not in PROCESS_REWARDS:
            raise ConfigError(f"process: unknown {self.process!r}; known: {', '.join(PROCESS_REWARDS)}")
        if self.normalize not in REWARD_NORMS:
            raise ConfigError(f"normalize: unknown {self.normalize!r}; known: {', '.join(REWARD_NORMS)}")
        if not self.timeout_s > 0:
            raise ConfigError(f"timeout_s: must be > 0 (got {self.timeout_s})")
        if self.overlong_buffer < 0:
            raise ConfigError(f"overlong_buffer: must be ≥ 0 (got {self.overlong_buffer})")
        if self.overlong_penalty < 0:
            raise ConfigError(f"overlong_penalty: must be ≥ 0 (got {self.overlong_penalty})")


@dataclass
class RayConfig(Freezable):
    """The `ray` group: the Ray cluster that places the rollout workers under rollout.launcher=ray
    (docs/distributed.md)."""

    address: str = "auto"
    """The cluster to join: auto, the one `ray start` made on this machine (or RAY_ADDRESS), else a local one
    started for the run and stopped with it; or an address, e.g. 10.0.0.1:6379."""
    strategy: str = "PACK"
    """How the placement group lays the workers' bundles (one a worker) on the nodes: PACK (as few nodes as fit),
    SPREAD (as many), STRICT_PACK (one node) or STRICT_SPREAD (a node each)."""

    def __post_init__(self):
        if not self.address.strip():
            raise ConfigError("address: empty; give auto or the cluster's address, e.g. 10.0.0.1:6379")
        if self.strategy not in RAY_STRATEGIES:
            raise ConfigError(f"strategy: unknown {self.strategy!r}; known: {', '.join(RAY_STRATEGIES)}")


@dataclass
class EnvConfig(Freezable):
    """The `env` group: multi-turn rollouts in an environment (environments/, docs/environments.md)."""

    name: str | None = None
    """The environment each episode runs in: a registered name (calculator, python) or path/to/file.py:Class (an
    Environment subclass in a local file); null: one completion per prompt."""
    max_turns: int = 4
    """The most model turns an episode takes; the last one ends it whatever the environment says."""
    max_turn_tokens: int | None = None
    """Token budget of one model turn; null: rollout.max_new_tokens. rollout.max_new_tokens bounds the whole
    response, the model's tokens and the environment's together."""
    check_template: bool = False
    """At every turn, check that the conversation so far, rendered (by the chat template, or plainly) and tokenised,
    is a prefix of the trajectory's ids; the first position where it is not stops the run with one line."""
    timeout_s: float = 5.0
    """Wall-clock bound in seconds on each call into the environment (its creation and reset, each step), run in a
    bounded worker process; past it the model sees an error as the environment's reply."""
    sandbox: str = "bwrap"
    """How the python tool isolates the model's code: bwrap (a bubblewrap jail: own namespaces, no network, a
    read-only view of the system, one writable directory, an unprivileged user, seccomp; the run is refused where it
    cannot be set up) or none (the interpreter's own checks only, which code written to beat them gets past: for
    trusted code on a machine without bubblewrap)."""

    def __post_init__(self):
        if self.max_turns < 1:
            raise ConfigError(f"max_turns: must be ≥ 1 (got {self.max_turns})")
        if self.max_turn_tokens is not None and self.max_turn_tokens < 1:
            raise ConfigError(f"max_turn_tokens: must be ≥ 1, or null (got {self.max_turn_tokens})")
        if not self.timeout_s > 0:
            raise ConfigError(f"timeout_s: must be > 0 (got {self.timeout_s})")
        if self.sandbox not in ("bwrap", "none"):
            raise ConfigError(f"sandbox: must be bwrap or none (got {self.sandbox!r})")
        if self.sandbox != "bwrap" and self.name is None:
            raise ConfigError("sandbox: set without env.name; it isolates the python tool's code in episodes")


# The trackers `report_to` names (posttrain.train.tracking), each with the packages that provide it: any one will do
# (accelerate's TensorBoard tracker takes torch.utils.tensorboard, which needs tensorboard, else tensorboardX).
TRACKERS = {"tensorboard": ("tensorboardX", "tensorboard"), "wandb": ("wandb",), "trackio": ("trackio",)}


@dataclass
class RunConfig(Freezable):
    description: str = ""
    """One line saying what the recipe does (shown by `posttrain recipes`)."""
    output_dir: str = "runs/run"
    """Where config.yaml, metrics.jsonl, summary.json and the final model go."""
    overwrite: bool = False
    """Replace a non-empty output_dir (only once the new run has finished)."""
    resume: bool | str = "auto"
    """Continue an interrupted run. auto (the default): from the newest complete checkpoint in `<output_dir>.partial`
    when there is one (not with overwrite=true), else afresh, saying which; true: from that checkpoint, and an error
    when there is none; a path: from that checkpoints/step_N directory; false: never (an interrupted run's
    checkpoints are then refused, not discarded). The config must match the run's, but for the keys that may change
    (posttrain.train.checkpoint.MAY_CHANGE: train.steps, saving, report_to)."""
    report_to: str = "none"
    """Trackers that get every line of metrics.jsonl and the resolved config, through accelerate's: none, tensorboard
    (`<output_dir>/tensorboard`), wandb (`<output_dir>/wandb`; WANDB_MODE=offline works without a network) or trackio
    (its local database), or several comma-separated, e.g. tensorboard,wandb; `pip install 'posttrain[tracking]'`."""
    seed: int = 0
    """Seed of the model init, sampling and data order, and of the embedded model's warm-up (another seed, another
    warm-up); runs with the same seed repeat exactly on one CPU when they run on the same threads (pin train.threads
    where a busy machine could change the fitted count)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    data: DataConfig = field(default_factory=DataConfig)
    algorithm: Any = None
    """The method's own hyperparameters, validated against its plugin's Config; `name` picks the plugin."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    """Rule rewards and their weights, e.g. {accuracy: 1.0, format: 0.1}; your own in `custom`; each call bounded."""
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    """Multi-turn rollouts: the environment the online methods' samples act in, turn by turn."""
    ray: RayConfig = field(default_factory=RayConfig)
    """The Ray cluster of rollout.launcher=ray."""

    def __post_init__(self):
        names = [name.strip() for name in self.report_to.split(",")]
        for name in names:
            if name not in ("none", *TRACKERS):
                near = difflib.get_close_matches(name, TRACKERS, n=1)
                hint = f"did you mean {near[0]!r}? " if near else ""
                raise ConfigError(f"report_to: unknown tracker {name!r}; {hint}known: none, {', '.join(TRACKERS)} "
                                  "(several: comma-separated)")
        if "none" in names and len(names) > 1:
            raise ConfigError(f"report_to: none names no tracker and goes alone (got {self.report_to!r})")
        if self.rollout.launcher != "ray":
            moved = [f.name for f in dataclasses.fields(RayConfig) if getattr(self.ray, f.name) != f.default]
            if moved:
                raise ConfigError(f"ray.{moved[0]}: applies to rollout.launcher=ray (got launcher="
                                  f"{self.rollout.launcher})")

    @property
    def trackers(self) -> tuple[str, ...]:
        """The trackers `report_to` names, each once, in its order; () for none."""
        return tuple(dict.fromkeys(n.strip() for n in self.report_to.split(",") if n.strip() != "none"))


def cache_root(cfg: RunConfig) -> Path:
    """Where warm-ups and sample sets are cached: warmup.cache_dir, else $POSTTRAIN_CACHE, else ~/.cache/posttrain."""
    root = cfg.warmup.cache_dir or os.environ.get("POSTTRAIN_CACHE") or Path.home() / ".cache" / "posttrain"
    return Path(root)
