"""`posttrain explain`: what one step of a run does, in plain words, before anything runs.

Batch sizes are where users of RL trainers most often lose their way: prompts or sequences, per process or over all
of them, how many optimizer steps one batch gives, how far behind the policy a trained sample may be. `explain`
answers from the run's plan (posttrain/train/plan.py), the one `build` assembles the run from and summary.json records
under `plan`: explain puts it in words and adds the memory estimate, and decides nothing of its own
(tests/test_plan.py checks that the plan it prints is the plan the run records, and that the step does what it says).
It loads no model and trains nothing; it reads the model's config.json (when `model.path` is given) for the memory
estimate only.

The plan's rules:

1. A step draws `train.batch_size` prompts (online source), rows (offline), kept samples (RFT's samples drawn once) or
   pairs (DPO) on each process. An online source samples n completions of each prompt (the plugin's
   `samples_per_prompt`); a pair is two rows (the plugin's `unit`). The world size is WORLD_SIZE (default 1).
2. The batch is cut into the plugin's `minibatches`, of ⌈rows / unit / minibatches⌉ whole units each (so a batch
   that does not divide gives fewer), and the plugin goes over them `epochs` times (μ): one optimizer step each
   (`Engine.minibatches`).
3. Each minibatch runs in micro-batches of `train.micro_batch_size` rows rounded down to whole units (at least one),
   the last one smaller (`Engine.micro_batches`); the scoring passes before the update split the whole batch alike.
   `train.micro_batch_tokens`, when set, wins: micro-batches of at most that many tokens, counted here with every row
   at its bounds (rule 5), so that the plan shows the most micro-batches a step can take; shorter rows take fewer.
4. Models: the policy; a reference iff the plugin needs "ref_logp" (with LoRA and no `model.ref_path`, the policy
   with its adapter off); a critic iff "values"; a reward model iff "reward" and `reward_model.path`; a process
   reward model iff "step_reward" and `rewards.process=model`. The engine also scores old log-probs ("old_logp")
   when an on-policy source gives more than one update per batch (μ × minibatches > 1).
5. Token counts are upper bounds: every prompt at `data.max_prompt_len` and every response at its budget
   (`rollout.max_new_tokens` for sampled responses, `data.max_response_len` for responses from a file).
6. Memory is `posttrain estimate`'s (posttrain/apps/estimate.py) for this config: the model's shape from its
   config.json, or the embedded model's from `warmup.hidden` and `warmup.layers`; the precision `auto` resolves to on
   this machine.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import textwrap
from dataclasses import dataclass, field

from posttrain import config
from posttrain.apps import estimate
from posttrain.core.errors import UserError
from posttrain.schema import RunConfig
from posttrain.train.plan import Machine, RunPlan, launched_processes
from posttrain.train.plan import plan as make_plan

# Each built-in source in words (what train.batch_size counts is the plan's); a source registered later is described
# by its name.
SOURCES = {
    "online": "samples of the current policy, drawn and judged every step",
    "offline": "fixed (prompt, response) rows",
    "samples_once": "correct samples of the starting model, drawn once before step 1",
    "pairs": "fixed pairs of a preferred and a dispreferred response to one prompt",
}
# train.precision as it runs -> (estimate's dtype, fp32 master weights): mixed precision keeps fp32 weights and AdamW
# state, which is what estimate's bf16/fp16 weights plus an fp32 master copy add up to (16 bytes a parameter).
PRECISIONS = {"fp32": ("fp32", False), "bf16-mixed": ("bf16", True), "fp16-mixed": ("fp16", True),
              "bf16": ("bf16", False)}
WIDTH = 110  # of the text render() prints


@dataclass(frozen=True)
class Model:
    """A model the run loads: its role, where it comes from, whether it is trained, and why it is there."""

    role: str
    origin: str
    trained: bool
    why: str


@dataclass(frozen=True)
class Stage:
    """One stage of the step's data pipeline: the key that turns it on, and what it does."""

    key: str
    what: str


@dataclass(frozen=True)
class MemoryRow:
    role: str
    gpu_bytes: int
    cpu_bytes: int


@dataclass
class Memory:
    """`posttrain estimate`'s figures for this config, per GPU (one process each)."""

    model: str  # the model's name and shape
    precision: str  # as it runs here, and why
    gpu_bytes: int
    cpu_bytes: int
    rows: list[MemoryRow]


@dataclass
class Plan:
    """One step of a run, per process unless a name says otherwise. A row is one sequence: a prompt and a response."""

    recipe: str
    method: str
    source: str  # the data source the plugin names (`posttrain.sources`)
    on_policy: bool  # the batch holds samples of the current policy
    world_size: int
    steps: int  # train.steps
    batch_size: int  # train.batch_size: what it counts is `batch_unit`
    batch_unit: str  # prompts, rows, samples or pairs
    samples_per_prompt: int  # completions sampled per prompt each step (1 when the source samples nothing each step)
    rows: int  # sequences trained on per step
    sampled_rows: tuple[int, int]  # sequences sampled per step: least and most (dynamic sampling may take rounds)
    sampled_once: int  # sequences sampled from the starting model once, before step 1 (at most)
    micro_batch_size: int  # rows per micro-batch: train.micro_batch_size rounded down to whole units, or the rows a
    # token budget holds at the bounds
    micro_batch_tokens: int | None  # train.micro_batch_tokens (None: micro-batches by rows)
    packed: bool  # train.packing: sequences packed end to end in each micro-batch
    epochs: int  # μ: passes over each batch
    minibatch_rows: list[int]  # rows of each minibatch of a pass: one optimizer step each
    micro_batch_rows: list[list[int]]  # rows of each micro-batch, per minibatch
    updates_per_step: int  # optimizer steps per batch: epochs × minibatches
    updates: int  # optimizer steps of the run
    scheduled_updates: int  # the optimizer steps the learning-rate schedule is spread over
    prompt_tokens: int  # at most, per step
    response_tokens: int  # at most, per step: the tokens trained on
    sampled_tokens: tuple[int, int]  # at most, per step: tokens generated, least and most rounds ((0, 0) if none)
    response_budget: str  # the key that bounds a response
    scored: list[str]  # what is scored over the whole batch before the update: ref_logp, old_logp, values
    models: list[Model] = field(default_factory=list)
    placement: list[tuple[str, str]] = field(default_factory=list)  # (role, where it runs), in words
    stages: list[Stage] = field(default_factory=list)
    max_lag: int | None = None  # optimizer steps a fresh sample's policy may be behind the one it updates
    lag: list[str] = field(default_factory=list)  # the same, in words
    memory: Memory | None = None
    memory_note: str = ""  # why there is no estimate, or what it assumes
    notes: list[str] = field(default_factory=list)  # settings that do not do what they seem to
    run: RunPlan | None = None  # the run's plan, as summary.json records it under `plan`

    @property
    def micro_batches_per_step(self) -> int:
        """Forward and backward passes of the update, over all epochs."""
        return self.epochs * sum(map(len, self.micro_batch_rows))


def explain(cfg: RunConfig, recipe: str = "", world: int = 1) -> Plan:
    """One step of the run `cfg` describes on `world` processes of this machine, as its plan
    (posttrain/train/plan.py) has it: this adds words and the memory estimate, and decides nothing."""
    run = make_plan(cfg, dataclasses.replace(Machine.here(cfg), world_size=world))
    s, update = run.shape, run.passes.update
    plan = Plan(
        recipe=recipe, method=run.method, source=run.source, on_policy=run.on_policy, world_size=run.world_size,
        steps=run.steps, batch_size=s.batch_size, batch_unit=s.batch_unit, samples_per_prompt=s.samples_per_prompt,
        rows=s.rows, sampled_rows=s.sampled_rows, sampled_once=s.sampled_once, micro_batch_size=s.micro_batch_rows,
        micro_batch_tokens=update.tokens, packed=update.packing, epochs=s.epochs,
        minibatch_rows=list(s.minibatch_rows), micro_batch_rows=[list(m) for m in s.micro_batches],
        updates_per_step=s.updates_per_step, updates=s.updates, scheduled_updates=s.scheduled_updates,
        prompt_tokens=s.prompt_tokens, response_tokens=s.response_tokens, sampled_tokens=s.sampled_tokens,
        response_budget=s.response_budget, scored=list(run.scored), run=run)
    plugin = config.algorithm_of(cfg)
    plan.models, plan.notes = models(cfg, plugin, run)
    plan.placement = placement(cfg, run)
    plan.stages, unknown = stages(cfg, plugin, run)
    plan.notes += unknown
    plan.max_lag, plan.lag = lag(run)
    if plan.scheduled_updates != plan.updates:
        parts = plugin.minibatches(cfg.algorithm)
        plan.notes.append(f"the learning-rate schedule is spread over {plan.scheduled_updates} optimizer steps "
                          f"(train.steps × μ × {parts} minibatches), but {plan.rows} rows make "
                          f"{len(plan.minibatch_rows)} minibatches, so the run takes {plan.updates}")
    plan.memory, plan.memory_note = memory(cfg, plugin, run)
    return plan


def models(cfg: RunConfig, plugin, run: RunPlan) -> tuple[list[Model], list[str]]:
    """The models the plan holds, in words, and notes on paths given but not loaded."""
    a, adapters, name, r = cfg.algorithm, cfg.model.lora.r, plugin.name, run.rollout
    start = cfg.model.path or "the embedded tiny model, warmed up with SFT (cached)"
    trained = f"LoRA adapters of rank {adapters} trained, the base frozen" if adapters else "every weight trained"
    samples = "samples the rollouts; " if run.on_policy and r.weight_sync == "none" else ""
    out, notes = [Model("policy", start, True, f"{samples}{trained}")], []
    sent = {"adapter": " (the LoRA adapter alone)", "merged": " (LoRA adapters merged in)"}.get(r.weight_sync, "")
    if r.placement == "separate":  # started for every run: evaluation samples through them too
        out.append(Model("rollout workers", f"rollout.placement=separate: {_n(r.workers, 'process')} "
                         f"running rollout.engine={r.engine}, each its own copy of the policy's weights"
                         + (f", started by the first of the {run.world_size} training processes and shared by all"
                            if r.shared_workers else ""), False,
                         f"sample; take the policy's weights after each step{sent}"))
    elif r.weight_sync != "none":  # started for every run: evaluation samples through it too
        out.append(Model("rollout engine", f"rollout.engine={r.engine}, its own copy of the policy's weights", False,
                         f"samples; gets the policy's weights after each step{sent}"))
    reference = run.role("reference")
    if reference is not None:
        beta = getattr(a, "beta", None)
        why = (f"for the KL penalty to it (algorithm.beta={beta:g})" if plugin.kl_penalty and beta is not None
               else f"the loss of {name} compares the policy's log-probs with its log-probs")
        if reference.scored_once:
            why += "; it scores the data once when the run starts and is then freed"
        origin = cfg.model.ref_path or "a copy of the starting policy"
        if reference.where == "adapter_off":
            origin = "the policy with its LoRA adapter off (no second model)"
        elif reference.where == "workers":
            origin += ", held by each rollout worker (rollout.reference_on=workers), not by the trainer"
            why += "; the workers score each batch they sample"
        out.append(Model("reference", origin, False, why))
    elif cfg.model.ref_path:
        notes.append(f"model.ref_path is set, but {name} with these settings needs no reference: not loaded")
    teacher = run.role("teacher")
    if teacher is not None:
        origin = (teacher.origin if teacher.origin != "embedded" else "the embedded teacher: the tiny model warmed up "
                  "on worked solutions that never slip (cached)")
        why = ("scores every sampled token at the sampling temperature; the GC is its log-prob minus the policy's (the "
               "per-token reverse KL)")
        if teacher.where == "workers":
            origin += ", held by each rollout worker (rollout.reference_on=workers), not by the trainer"
            why += "; the workers score each batch they sample"
        out.append(Model("teacher", origin, False, why))
    elif cfg.model.teacher_path:
        notes.append(f"model.teacher_path is set, but {name} learns from no teacher: not loaded")
    if run.role("critic") is not None:
        origin = getattr(a, "critic_path", None) or "the starting policy's weights, with a value head"
        lr = getattr(a, "critic_lr", None)
        why = "values of the response tokens, for the advantages" + (f"; trained at algorithm.critic_lr={lr:g}"
                                                                  if lr is not None else "")
        if adapters:
            why += "; its own LoRA adapter and value head on its own copy of the base"
        out.append(Model("critic", origin, True, why))
    rm = cfg.reward_model
    if run.role("reward_model") is not None:
        out.append(Model("reward model", rm.path, False, f"its score × reward_model.weight={rm.weight:g} is added "
                         "to the rule rewards"))
    if run.role("process_reward_model") is not None:
        out.append(Model("process reward model", rm.process_path, False, "scores each step of the samples trained "
                         "on (rewards.process=model)"))
    return out, notes


def placement(cfg: RunConfig, run: RunPlan) -> list[tuple[str, str]]:
    """Where each role of the run runs: the training processes, the sampler (in them, or each rollout worker: a
    process of the first training process, or a Ray actor in its placement group bundle), and the reference."""
    r, world = run.rollout, run.world_size
    threads = f"{_n(run.threads, 'thread')} each" if run.threads else "threads fitted to the free cores as it goes"
    out = [("trainer", f"{_n(world, 'training process')} on the machine `posttrain run` (or torchrun) starts on, "
                       f"{threads}")]
    if r.placement != "separate":
        out.append(("sampler", "in the training process, between updates (rollout.placement=colocated)"))
    gpus = cfg.rollout.gpus
    weights = {"nccl": "; weights over NCCL from the trainer's GPU", "gloo": "; weights over gloo"}.get(r.transport, "")
    for i in range(r.workers):
        if r.launcher == "ray":
            bundle = f"CPU: {r.worker_threads}" + (f", GPU: {gpus}" if gpus else "")
            where = (f"a Ray actor in bundle {i} of a placement group of {_n(r.workers, 'bundle')} of "
                     f"{{{bundle}}} (ray.strategy={cfg.ray.strategy}), on the node Ray gives that "
                     f"bundle in the cluster at ray.address={cfg.ray.address}; summary.json records each node")
        else:
            cores = (f"on core{'s' if len(r.worker_cpus[i]) > 1 else ''} {', '.join(map(str, r.worker_cpus[i]))}"
                     if r.worker_cpus else "on cores it shares")
            device = (f", on GPU {', '.join(map(str, r.worker_gpus[i]))} (its CUDA_VISIBLE_DEVICES)"
                      if r.worker_gpus else "")
            where = (f"a process the first training process starts on its machine (rollout.launcher=local), "
                     f"{cores}, {_n(r.worker_threads, 'thread')}{device}")
        out.append((f"rollout worker {i}", where + weights))
    for name in ("reference", "teacher"):
        frozen = run.role(name)
        if frozen is not None:
            out.append((name, {"workers": "on each rollout worker, beside its sampler (rollout.reference_on=workers)",
                               "adapter_off": "the training processes' policy, its LoRA adapter off"}
                        .get(frozen.where, "in the training processes")))
    for role in ("critic", "reward_model"):
        if run.role(role) is not None:
            out.append((role.replace("_", " "), "in the training processes"))
    return out


def stages(cfg: RunConfig, plugin, run: RunPlan) -> tuple[list[Stage], list[str]]:
    """What a step's data goes through, in order: the row draws, the round an online source draws (group sizes,
    sampling, the judge), then the stages of its pipeline the plan switches on, in their order; and notes naming any
    stage this module does not describe."""
    d, r, rw, t = cfg.data, cfg.rollout, cfg.rewards, cfg.train
    out, notes = [], []
    if d.curriculum == "field":
        out.append(Stage("data.curriculum=field", f"rows drawn easiest first by {d.difficulty_field}: the easiest "
                         f"{d.curriculum_start:.0%} at step 1, every row from step "
                         f"{d.curriculum_steps or max(1, t.steps // 2)}"))
    elif d.curriculum == "pass_rate":
        out.append(Stage("data.curriculum=pass_rate", "prompts drawn in proportion to max(1 − running pass rate, "
                         f"{d.curriculum_floor:g})"))
    if not run.on_policy:
        return out, notes
    if r.adaptive_group_size:
        out.append(Stage("rollout.adaptive_group_size", f"each prompt's group size from its running pass rate, in "
                         f"[{r.min_group_size}, {r.max_group_size}], {run.shape.rows} samples in all"))
    temperature = (f"temperature {r.temperature:g} at step 1, then set by rollout.adaptive_temperature"
                   if r.adaptive_temperature else f"temperature {r.temperature:g}")
    out.append(Stage(f"rollout.engine={r.engine}", f"{_n(run.shape.samples_per_prompt, 'completion')} per prompt of "
                     f"at most {r.max_new_tokens} tokens, {temperature}, top_p {r.top_p:g}"))
    parts = [f"{k} × {w:g}" for k, w in {**rw.weights, **rw.custom}.items()]
    if run.role("reward_model") is not None:
        parts.append(f"reward model × {cfg.reward_model.weight:g}")
    norm = f", each objective z-scored over the {rw.normalize} first" if rw.normalize != "none" else ""
    out.append(Stage("rewards", f"the judge scores each completion: {' + '.join(parts)}{norm}"))
    for key in run.stages:
        describe = STAGE_WORDS.get(key)
        if describe is None:
            notes.append(f"the online pipeline also has a stage switched on by {key}, not described here")
        else:
            out.append(Stage(key, describe(cfg)))
    return out, notes


def _dynamic_sampling(cfg: RunConfig) -> str:
    r, b = cfg.rollout, cfg.train.batch_size
    return (f"only groups whose rewards differ are kept: rounds of {b} more prompts, at most {r.max_sampling_rounds}, "
            f"until {b} such groups (then equal ones fill the batch)")


def _overlong(cfg: RunConfig) -> str:
    rw, budget = cfg.rewards, cfg.rollout.max_new_tokens
    return (f"the reward falls linearly by up to {rw.overlong_penalty:g} over the last {rw.overlong_buffer} of the "
            f"{budget} tokens; a truncated completion loses all of it")


# What each stage of posttrain.stages.STAGES does, by the key that switches it on (the plan says which are on).
STAGE_WORDS = {
    "rollout.adaptive_group_size | data.curriculum=pass_rate":
        lambda cfg: "each prompt's running pass rate is updated from the judge's verdicts",
    "rewards.overlong_buffer": _overlong,
    "rollout.dynamic_sampling": _dynamic_sampling,
    "rollout.elite_pool": lambda cfg: (f"the best completion so far of up to {cfg.rollout.elite_pool} prompts is kept; "
                                       "a group that does worse gets it back in place of its worst sample"),
    "rewards.process": lambda cfg: f"each step of the completions trained on is scored ({cfg.rewards.process})",
    "rollout.adaptive_temperature": lambda cfg: (
        "the next step's temperature moves toward a target entropy of the sampled tokens, within "
        f"[{cfg.rollout.min_temperature:g}, {cfg.rollout.max_temperature:g}]"),
}


def lag(run: RunPlan) -> tuple[int | None, list[str]]:
    """How far behind the policy it updates the policy that drew a trained sample may be: optimizer steps (None for
    data no policy of the run drew), and the same in words; the correction as the plan resolved it."""
    r, s = run.rollout, run.shape
    if not run.on_policy:
        if s.sampled_once:
            return None, ["fixed data: samples of the starting model, drawn once; they are never drawn again, so at "
                          f"step k they are (k − 1) × {s.updates_per_step} optimizer steps behind the policy"]
        return None, ["fixed data: rows no policy of the run drew"]
    ahead = r.max_staleness * s.updates_per_step  # optimizer steps the workers may sample ahead
    behind = ahead + s.updates_per_step - 1
    words = ["the step's first optimizer step trains on samples of the policy it updates (on-policy)"]
    correction = (f"each token's GC is weighted by the truncated importance ratio (rollout.tis_cap={r.tis_cap:g}, "
                  f"{r.tis_mode})" if r.tis_cap is not None else "")
    if r.proximal == "sampler":
        correction = ("the clipped ratio is taken against the log-probs the sampler reported (rollout.proximal="
                      "sampler): it weights each token by π_θ / π_rollout and stops pushing a token that moved past "
                      "its clip")
    if ahead:
        words = [f"rollout.max_staleness={r.max_staleness}: the workers sample up to {_n(r.max_staleness, 'step')} "
                 f"ahead, so the step's first optimizer step trains on samples of a policy up to "
                 f"{_n(ahead, 'optimizer step')} behind the one it updates; {correction}"]
    elif r.proximal == "sampler":
        words.append(correction)
    if s.updates_per_step > 1:
        words.append(f"each later one is one step further behind: the last is {_n(behind, 'optimizer step')} behind "
                     f"({f'{ahead} + ' if ahead else ''}μ={s.epochs} × "
                     f"{_n(len(s.minibatch_rows), 'minibatch')} − 1); " + (
                         "the clipped ratio's π_old is the sampler's log-probs" if r.proximal == "sampler" else
                         "the sampling policy's log-probs (old_logp) are scored before the first, for the clipped "
                         "ratio"))
    if "rollout.elite_pool" in run.stages:
        words.append("replayed elite completions were drawn by the policy of an earlier step, any number of steps "
                     f"behind; their GC is weighted by min(π_old / μ, rollout.elite_is_cap={r.elite_is_cap:g})")
    if r.engine != "hf" and not ahead:
        cap = f"; rollout.tis_cap={r.tis_cap:g} weights each token ({r.tis_mode})" if r.tis_cap is not None else ""
        words.append(f"{r.engine} samples with its own kernels, so its log-probs differ slightly from the trainer's "
                     f"(logged as mismatch/kl){cap}")
    return behind, words


def embedded_spec(cfg: RunConfig) -> estimate.ModelSpec:
    """The shape of the embedded tiny model `posttrain run` warms up when `model.path` is null: `build_model_dir`
    with `warmup.hidden`, `warmup.layers` and its own defaults (posttrain/apps/warmup.py), read without building it."""
    from posttrain.models import embedded

    w = cfg.warmup
    heads = inspect.signature(embedded.build_model_dir).parameters["heads"].default
    return estimate.ModelSpec("embedded tiny model", hidden=w.hidden, layers=w.layers, heads=heads, kv_heads=heads,
                              intermediate=3 * w.hidden, vocab=len(embedded.SPECIALS) + len(embedded.CHARS), tied=True,
                              head_dim=w.hidden // heads)


def memory(cfg: RunConfig, plugin, run: RunPlan) -> tuple[Memory | None, str]:
    """`estimate`'s per-GPU figures for `cfg` as `run` plans it (its processes, precision and step), and what they
    assume; (None, why) when the estimator cannot size this config (a model it does not know, a setting outside its
    range)."""
    a, t, r, rows = cfg.algorithm, cfg.train, cfg.rollout, run.shape.rows
    try:
        spec = estimate.model_spec(cfg.model.path) if cfg.model.path else embedded_spec(cfg)
        dtype, master = PRECISIONS[run.precision]
        group, beta = plugin.samples_per_prompt(a), getattr(a, "beta", 0.0)
        per_item = estimate.method_profile(plugin.name, group, beta)[3]  # sequences per batch item, as it counts
        est = estimate.estimate(
            spec, plugin.name, gpus=run.world_size, backend=t.backend, offload=t.offload, lora=cfg.model.lora.r,
            batch=-(-rows // per_item), group=group, prompt_len=cfg.data.max_prompt_len,
            response_len=run.shape.response_tokens // rows, grad_ckpt=False, dtype=dtype,
            master_weights=master, reward_model=bool(cfg.reward_model.path), beta=beta, rollout=r.engine,
            gpu_memory_utilization=r.gpu_memory_utilization)
    except (UserError, KeyError) as err:
        return None, f"not estimated: {err}"
    shape = (f"{spec.name}: {spec.n_params:,} parameters, {spec.layers} layers, hidden {spec.hidden}, "
             f"vocab {spec.vocab}")
    rows_ = [MemoryRow(x.role, x.gpu_bytes, x.cpu_bytes) for x in est.rows]
    note = (f"as `posttrain estimate` counts: {rows} sequences of {cfg.data.max_prompt_len} + "
            f"{est.settings['response_len']} tokens in one forward (the micro-batches make the activations "
            "smaller), no gradient checkpointing, and the larger of the KV cache and the activations")
    return Memory(shape, f"{run.precision} ({run.precision_reason})", est.gpu_total, est.cpu_total, rows_), note


def as_dict(plan: Plan) -> dict:
    """The plan as plain data (for --json), with the counts over all processes beside the per-process ones."""
    w = plan.world_size
    out = {k: v for k, v in dataclasses.asdict(plan).items() if k != "run"}
    return {**out, "plan": plan.run.to_dict(), "micro_batches_per_step": plan.micro_batches_per_step,
            "all_processes": {"batch_size": plan.batch_size * w, "rows": plan.rows * w,
                              "sampled_rows": [s * w for s in plan.sampled_rows],
                              "sampled_once": plan.sampled_once * w, "prompt_tokens": plan.prompt_tokens * w,
                              "response_tokens": plan.response_tokens * w,
                              "sampled_tokens": [s * w for s in plan.sampled_tokens]}}


def _span(low: int, high: int) -> str:
    return f"{low:,}" if low == high else f"{low:,} to {high:,}"


def _n(count: int, word: str) -> str:
    """1 epoch, 2 epochs; 2 processes, 2 minibatches."""
    return f"{count:,} {word}" + ("" if count == 1 else "es" if word.endswith(("s", "x", "sh", "tch")) else "s")


def _pieces(sizes: list[int], word: str) -> str:
    """[8] -> "1 micro-batch of 8 rows"; [8, 8] -> "2 micro-batches of 8 rows each"; [8, 8, 4] -> "3 micro-batches
    of 8, 8 and 4 rows"."""
    many = f"{_n(len(sizes), word)} of "
    if len(sizes) == 1:
        return f"{many}{sizes[0]} rows"
    if len(set(sizes)) == 1:
        return f"{many}{sizes[0]} rows each"
    if len(sizes) > 3 and len(set(sizes[:-1])) == 1:  # [3] * 85 + [1] -> "86 micro-batches: 85 of 3 rows, 1 of 1"
        return f"{_n(len(sizes), word)}: {len(sizes) - 1} of {sizes[0]} rows, 1 of {sizes[-1]}"
    return f"{many}{', '.join(map(str, sizes[:-1]))} and {sizes[-1]} rows"


def _size(nbytes: int) -> str:
    """Decimal units, as `posttrain estimate` quotes them."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale / 10:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


def _wrap(text: str, indent: str = "  ", first: str | None = None) -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=indent if first is None else first, subsequent_indent=indent,
                         break_on_hyphens=False)


def render(plan: Plan) -> str:
    """The plan in plain words, lines within WIDTH characters."""
    w, p = plan.world_size, plan
    words = SOURCES.get(p.source, f"the {p.source} source")
    lines = _wrap(f"{'recipe ' + p.recipe + ': ' if p.recipe else ''}{p.method} on {_n(w, 'process')} "
                  f"(WORLD_SIZE={w}). Nothing was run: this is what each step of the run does.", "")
    lines += [""] + _wrap(f"Data: {words} (source {p.source}).", "")
    table = [(f"{p.batch_unit} (train.batch_size)", p.batch_size, p.batch_size)]
    if p.on_policy:
        table.append((f"sequences sampled ({p.samples_per_prompt} per prompt)", *p.sampled_rows))
    table += [("sequences trained on", p.rows, p.rows), ("prompt tokens, at most", p.prompt_tokens, p.prompt_tokens),
              ("response tokens trained on, at most", p.response_tokens, p.response_tokens)]
    if p.on_policy:
        table.append(("tokens sampled, at most", *p.sampled_tokens))
    every = f"{f'all {w} processes':>22}" if w > 1 else ""
    lines += ["", f"  {'One step':<40}{'per process':>22}{every}"]
    for name, lo, hi in table:
        lines.append(f"  {name:<40}{_span(lo, hi):>22}" + (f"{_span(lo * w, hi * w):>22}" if w > 1 else ""))
    lines += _wrap(f"Token counts are bounds: every prompt at data.max_prompt_len, every response at "
                   f"{p.response_budget}; real ones are shorter.")
    if p.on_policy and p.sampled_rows[0] != p.sampled_rows[1]:
        lines += _wrap("Dynamic sampling draws rounds of prompts until enough groups differ: it may sample more "
                       "than it trains on.")
    if p.sampled_once:
        lines += _wrap(f"Before step 1, each process draws up to {p.sampled_once:,} samples of the starting model "
                       "(algorithm.num_prompts × samples_per_prompt), judges and caches them; the steps draw from "
                       "those.")
    splits = dict.fromkeys(_pieces(m, "micro-batch") for m in p.micro_batch_rows)
    lines += ["", "Update:"]
    lines += _wrap(f"{_n(p.epochs, 'epoch')} (μ) × {_pieces(p.minibatch_rows, 'minibatch')} = "
                   f"{_n(p.updates_per_step, 'optimizer step')} per batch; {_n(p.steps, 'step')} = "
                   f"{_n(p.updates, 'optimizer step')} in the run.")
    packing = ", packed end to end (train.packing)" if p.packed else ""
    if p.micro_batch_tokens is None:
        lines += _wrap(f"Micro-batches of at most {p.micro_batch_size} rows (train.micro_batch_size, in whole units "
                       f"of the method{packing}): each minibatch runs as {' or '.join(splits)}, gradients adding up "
                       f"until its optimizer step; {_n(p.micro_batches_per_step, 'forward/backward pass')} per step.")
    else:
        lines += _wrap(f"Micro-batches of at most {p.micro_batch_tokens:,} tokens (train.micro_batch_tokens, which "
                       f"wins over train.micro_batch_size; {'real tokens' if p.packed else 'rows × the longest row'}"
                       f"{packing}): with every row at its bounds each minibatch runs as {' or '.join(splits)}, "
                       f"gradients adding up until its optimizer step; at most "
                       f"{_n(p.micro_batches_per_step, 'forward/backward pass')} per step, fewer for shorter rows.")
    if p.scored:
        names = {"ref_logp": "reference log-probs", "teacher_logp": "teacher log-probs",
                 "old_logp": "old log-probs (the policy as it sampled)", "values": "values (the critic)"}
        forwards = math.ceil(p.rows / p.micro_batch_size)
        lines += _wrap(f"Before the update, scored over the whole batch, {_n(forwards, 'forward pass')} each: "
                       + ", ".join(names[s] for s in p.scored) + ".")
    lines += ["", "Models:"]
    for m in p.models:
        lines += _wrap(f"{m.origin}. {m.why[:1].upper()}{m.why[1:]}.", " " * 28, f"  {m.role:<17}{'trained' if m.trained else 'frozen':<9}")
    if p.placement:
        lines += ["", "Where each role runs:"]
        for role, where in p.placement:
            lines += _wrap(f"{where[:1].upper()}{where[1:]}.", " " * 20, f"  {role:<18}")
    if p.stages:
        lines += ["", "Data pipeline of a step, in order:"]
        for i, s in enumerate(p.stages, 1):
            lines += _wrap(f"{s.key}: {s.what}.", "     ", f"  {i}. ")
    lines += ["", "How far off-policy:"]
    for x in p.lag:
        lines += _wrap(f"{x}.", "    ", "  - ")
    lines += ["", "Memory per GPU (posttrain estimate):"]
    if p.memory is None:
        lines += _wrap(p.memory_note)
    else:
        m = p.memory
        lines += _wrap(f"{m.model}; {m.precision}.")
        cpu = m.cpu_bytes > 0  # offloaded: a column of its own
        lines.append(f"  {'role':<40}{'GPU':>12}" + (f"{'CPU':>12}" if cpu else ""))
        lines += [f"  {r.role:<40}{_size(r.gpu_bytes):>12}" + (f"{_size(r.cpu_bytes):>12}" if cpu else "")
                  for r in m.rows]
        lines.append(f"  {'total':<40}{_size(m.gpu_bytes):>12}" + (f"{_size(m.cpu_bytes):>12}" if cpu else ""))
        lines += _wrap(f"Counted {p.memory_note}.")
    if p.notes:
        lines += ["", "Notes:"]
        for x in p.notes:
            lines += _wrap(f"{x}.", "    ", "  - ")
    return "\n".join(lines)


def main(recipe: str, overrides: list[str], as_json: bool = False) -> int:
    """`posttrain explain recipe=NAME [key=value ...] [--json]`: print the plan, return 0; bad input: UserError."""
    cfg, _ = config.load(recipe, overrides)
    plan = explain(cfg, recipe, launched_processes())
    print(json.dumps(as_dict(plan), indent=2) if as_json else render(plan))
    return 0
