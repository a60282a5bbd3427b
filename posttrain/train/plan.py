"""The plan of a run: every decision about how it is assembled, made once, from the validated config.

`plan(cfg, machine)` is pure (it loads no model and reads no file): what the method needs, every model role and where
it lives, precision and threads as resolved for the machine, the rollout engine and its placement, the off-policy
correction, how each pass cuts a batch into micro-batches, the online stages in order, the evaluation schedule, and
the shape of one step (rows, minibatches, optimizer steps, token bounds). `build` turns it into finished parts,
`posttrain explain` prints it, and summary.json records it under `plan`; none of them decides any of it again.

`Machine.here` is the one place that looks at the hardware (the device's precision, the cores this process may use,
the number of training processes); it is kept apart so that the plan of another machine can be made from its figures.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from posttrain.core.errors import UserError
from posttrain.core.launch import cuda_devices, local_world, worker_gpus
from posttrain.schema import STALE_TIS_CAP, RunConfig


@dataclass(frozen=True)
class Machine:
    """What the plan needs to know of the hardware it runs on."""

    world_size: int = 1  # training processes
    precision: str = "fp32"  # train.precision as it runs here (`auto` resolved)
    precision_reason: str = ""
    cores: int = 1  # the cores this process may use (affinity, cgroup quota, processes sharing the machine)
    cpus: tuple[int, ...] = (0,)  # the CPUs it may run on, in order
    gpus: int = 0  # the CUDA devices this process sees
    local_world: int = 1  # training processes on this machine (LOCAL_WORLD_SIZE): they use the first GPUs

    @classmethod
    def here(cls, cfg: RunConfig, choice=None) -> Machine:
        """This machine, for `cfg`: the processes a launcher started, its device's precision
        (posttrain.core.precision; `choice`, where the caller has resolved it already) and its cores."""
        from posttrain.config import settle_precision
        from posttrain.core.threads import allowed_cpus, usable_cores

        if choice is None:
            _, choice = settle_precision(cfg)
        return cls(world_size=launched_processes(), precision=choice.precision, precision_reason=choice.reason,
                   cores=usable_cores(), cpus=tuple(sorted(allowed_cpus())), gpus=cuda_devices(),
                   local_world=local_world())


def launched_processes() -> int:
    """The number of processes a launcher starts (WORLD_SIZE, as torchrun and accelerate set it; default 1)."""
    import os

    raw = os.environ.get("WORLD_SIZE", "1")
    if not raw.isdigit() or int(raw) < 1:
        raise UserError(f"WORLD_SIZE={raw}: expected a positive number of processes")
    return int(raw)


@dataclass(frozen=True)
class Role:
    """A model the run holds: what it is for, where it lives, where it comes from, and whether it is trained."""

    role: str  # policy, reference, teacher, critic, reward_model, process_reward_model
    where: str  # trainer; adapter_off (the policy with its LoRA adapter off); workers (rollout.reference_on=workers)
    origin: str  # a directory, "start" (the starting policy) or "embedded" (the embedded teacher, built and cached)
    trained: bool
    scored_once: bool = False  # the source scores its data with it once, at the start, and it is freed (DPO)


@dataclass(frozen=True)
class Rollout:
    """How samples are drawn and how stale they may be, with the off-policy correction as resolved."""

    engine: str  # rollout.engine
    placement: str  # colocated, or separate (worker processes)
    launcher: str  # what starts the workers: local (processes of the first training process), ray (Ray actors)
    workers: int  # worker processes (0 when colocated)
    worker_threads: int  # each worker's threads (0 when colocated)
    worker_cpus: tuple[tuple[int, ...], ...] | None  # each worker's cores, where every worker and the trainer get
    # their own; None: not pinned
    worker_gpus: tuple[tuple[int, ...], ...] | None  # each local worker's CUDA devices (rollout.gpus); None: none
    # chosen here (CPU workers, or Ray's bundles choose)
    transport: str  # how weights reach the workers: gloo (from CPU memory), nccl (GPU to GPU); none when colocated
    shared_workers: bool  # several training processes sample through the first one's workers
    shared_rng: bool  # the workers sample from the training processes' generators (one worker at k = 0)
    weight_sync: str  # what reaches the engine after each update: none (it samples from the trained module), full,
    # merged (LoRA merged in), adapter (the adapter alone, to workers that hold the same adapted model)
    max_staleness: int  # policy versions a trained sample may be behind
    proximal: str  # π_old of a clipped ratio: trainer (its log-probs as the batch was sampled) or sampler
    tis_mode: str
    tis_cap: float | None  # the truncated importance weight's C; None: off
    elite_is_cap: float  # the bound on a replayed elite row's weight min(π_old / μ, C)


@dataclass(frozen=True)
class MicroBatching:
    """How one pass over a batch cuts it: micro-batches of `rows` rows (whole units), or under a token budget."""

    rows: int
    tokens: int | None = None  # train.micro_batch_tokens: wins over rows when set
    packing: bool = False  # sequences packed end to end (where every model scored can confine attention)


@dataclass(frozen=True)
class Passes:
    """The micro-batching of every pass of a step."""

    update: MicroBatching  # the policy's forward and backward (and the critic's)
    trainer_scoring: MicroBatching  # reference and old log-probs, values, before the update
    worker_scoring: MicroBatching | None  # the reference or teacher on the rollout workers (rollout.reference_on=workers)


@dataclass(frozen=True)
class Evaluation:
    """When the held-out problems are evaluated, and on what."""

    num_problems: int  # 0: never
    every: int  # 0: before and after only
    batch_size: int
    max_new_tokens: int
    k: int  # pass@k and maj@k from n samples (k = 0: greedy only)
    n: int
    stop_on: str | None  # early stopping's metric
    patience: int


@dataclass(frozen=True)
class Shape:
    """One step, per process, at its bounds (a row is one sequence: a prompt and a response)."""

    batch_size: int  # train.batch_size, counted in `batch_unit`
    batch_unit: str  # prompts, rows, samples or pairs
    samples_per_prompt: int  # sampled per prompt each step (1 where the source samples nothing each step)
    rows: int  # sequences trained on
    sampled_rows: tuple[int, int]  # sequences sampled, least and most (dynamic sampling may take rounds)
    sampled_once: int  # sequences sampled from the starting model once, before step 1 (at most)
    micro_batch_rows: int  # rows per micro-batch: by rows, or what a token budget holds with rows at their bounds
    epochs: int  # μ
    minibatch_rows: tuple[int, ...]  # rows of each minibatch of a pass: one optimizer step each
    micro_batches: tuple[tuple[int, ...], ...]  # rows of each micro-batch, per minibatch
    updates_per_step: int
    updates: int  # optimizer steps of the run
    scheduled_updates: int  # the optimizer steps the learning-rate schedule is spread over
    prompt_tokens: int  # at most
    response_tokens: int  # at most: the tokens trained on
    sampled_tokens: tuple[int, int]  # at most, least and most rounds ((0, 0) if nothing is sampled)
    response_budget: str  # the key that bounds a response


@dataclass(frozen=True)
class RunPlan:
    """How a run is assembled (module docstring)."""

    method: str
    source: str  # the data source the plugin names
    on_policy: bool  # the batch holds samples of the current policy
    needs: tuple[str, ...]  # what the engine provides the plugin, old_logp included where it scores it
    scored: tuple[str, ...]  # what the trainer scores over the whole batch before the update
    roles: tuple[Role, ...]
    world_size: int
    precision: str
    precision_reason: str
    threads: int  # the trainer's threads as the run starts (0: fitted to the free cores as it goes)
    steps: int
    rollout: Rollout
    passes: Passes
    stages: tuple[str, ...]  # the online source's stages, by key, in order
    episodes: bool  # samples are multi-turn episodes in env.name
    evaluation: Evaluation
    shape: Shape

    def role(self, name: str) -> Role | None:
        return next((r for r in self.roles if r.role == name), None)

    @property
    def reference_on(self) -> str | None:
        """Where the frozen models that score a batch (the reference, the distillation teacher) do it: trainer (each
        step, or once by the source), workers, or None where the method has neither."""
        frozen = [r for r in self.roles if r.role in ("reference", "teacher")]
        return None if not frozen else "workers" if any(r.where == "workers" for r in frozen) else "trainer"

    def to_dict(self) -> dict:
        """The plan as plain data (summary.json's `plan`, `posttrain explain --json`'s): tuples as lists."""
        return _plain(dataclasses.asdict(self))


def _plain(value):
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def plan(cfg: RunConfig, machine: Machine = Machine()) -> RunPlan:
    """The plan of the run `cfg` describes on `machine` (pure: the module docstring)."""
    from posttrain.config import algorithm_of
    from posttrain.sources import SOURCES

    plugin, a, t, r = algorithm_of(cfg), cfg.algorithm, cfg.train, cfg.rollout
    source = SOURCES.find(plugin.source)
    needs = plugin.needs(a)
    if source.on_policy and plugin.epochs(a) * plugin.minibatches(a) > 1:
        # the trainer's log-probs under the sampling weights, for the mismatch and the clipped ratio: after the first
        # optimizer step the update's own forward no longer gives them
        needs = needs | {"old_logp"}
    roles = _roles(cfg, plugin, source, needs)
    rollout = _rollout(cfg, plugin, machine)
    ref = next((x for x in roles if x.role == "reference"), None)
    on_workers = {x.role for x in roles if x.where == "workers"}  # scored by the workers as they make the batch
    scored = tuple(k for k in ("ref_logp", "teacher_logp", "old_logp", "values") if k in needs and not (
        k == "ref_logp" and ref is not None and (ref.scored_once or ref.where == "workers")) and not (
        k == "teacher_logp" and "teacher" in on_workers))
    rows = MicroBatching(max(plugin.unit, t.micro_batch_size // plugin.unit * plugin.unit), t.micro_batch_tokens,
                         t.packing)
    # the workers score the frozen models as the trainer scores (posttrain.core.micro, one implementation)
    worker = rows if on_workers else None
    e = cfg.eval
    evaluation = Evaluation(num_problems=e.num_problems, every=e.every, batch_size=e.batch_size,
                            max_new_tokens=e.max_new_tokens or r.max_new_tokens, k=e.k, n=e.n, stop_on=e.stop_on,
                            patience=e.patience)
    return RunPlan(
        method=plugin.name, source=plugin.source, on_policy=source.on_policy, needs=tuple(sorted(needs)),
        scored=scored, roles=roles, world_size=machine.world_size, precision=machine.precision,
        precision_reason=machine.precision_reason, threads=_trainer_threads(cfg, machine), steps=t.steps,
        rollout=rollout, passes=Passes(update=rows, trainer_scoring=rows, worker_scoring=worker),
        stages=_stages(cfg, source, needs), episodes=cfg.env.name is not None, evaluation=evaluation,
        shape=_shape(cfg, plugin, source))


def correction(r, plugin) -> tuple[str, float | None]:
    """(proximal, tis_cap) as they apply. Stale samples are never trained on as if fresh: where they may be (separate
    placement, max_staleness ≥ 1) and no correction is given, a method with a clipped ratio takes it against the
    sampler's log-probs (PPO's own objective, which kept the synchronous run's accuracy at k = 1 where the truncated
    weight did not: docs/async.md); another method, or a run that gives tis_cap, tis_mode or an elite pool, gets the
    truncated importance weight, C = 2 unless given. Elsewhere π_old is the trainer's."""
    proximal, cap = r.proximal, r.tis_cap
    if proximal is None:
        chosen = cap is not None or r.tis_mode != "token_truncate" or r.elite_pool  # the weight's road
        proximal = "sampler" if r.stale and plugin.clips_ratio and not chosen else "trainer"
    if r.stale and proximal == "trainer" and cap is None:
        cap = STALE_TIS_CAP
    return proximal, cap


def worker_cores(r, machine: Machine) -> tuple[int, tuple[tuple[int, ...], ...] | None]:
    """Each rollout worker's threads, and its cores (the last ones, where every worker and the trainer get their own;
    else None: not pinned)."""
    cpus = machine.cpus
    threads = r.worker_threads or max(1, machine.cores // (r.workers + 1))
    if r.workers * threads >= len(cpus):
        return threads, None
    return threads, tuple(tuple(cpus[len(cpus) - (i + 1) * threads : len(cpus) - i * threads])
                          for i in range(r.workers))


def _trainer_threads(cfg: RunConfig, machine: Machine) -> int:
    """train.threads as the run starts: under separate placement, unless pinned, the cores the workers leave."""
    r = cfg.rollout
    if cfg.train.threads or r.placement != "separate":
        return cfg.train.threads
    return max(1, machine.cores - r.workers * worker_cores(r, machine)[0])


def _rollout(cfg: RunConfig, plugin, machine: Machine) -> Rollout:
    from posttrain import rollout as engines

    r, lora = cfg.rollout, bool(cfg.model.lora.r)
    engine = engines.get(r.engine)
    separate = r.placement == "separate"
    # hf workers hold the same adapted model as the trainer and take the adapter alone
    takes_adapter = separate and lora and engine.colocated
    colocated = not separate and engine.colocated
    weight_sync = "none" if colocated else "adapter" if takes_adapter else "merged" if lora else "full"
    threads, cpus = worker_cores(r, machine) if separate else (0, None)
    if r.launcher == "ray":  # Ray places each worker on a node of its choosing: its bundle reserves the CPUs
        cpus = None
    gpus = (worker_gpus(r.workers, r.gpus, machine.gpus, machine.local_world)
            if separate and r.gpus and r.launcher == "local" else None)
    transport = "none" if not separate else "nccl" if r.gpus and machine.gpus else "gloo"
    proximal, cap = correction(r, plugin)
    return Rollout(engine=r.engine, placement=r.placement, launcher=r.launcher if separate else "local",
                   workers=r.workers if separate else 0,
                   worker_threads=threads, worker_cpus=cpus, worker_gpus=gpus, transport=transport,
                   shared_workers=separate and machine.world_size > 1,
                   shared_rng=separate and r.max_staleness == 0 and r.workers == 1, weight_sync=weight_sync,
                   max_staleness=r.max_staleness, proximal=proximal, tis_mode=r.tis_mode, tis_cap=cap,
                   elite_is_cap=r.elite_is_cap)


def _roles(cfg: RunConfig, plugin, source, needs: frozenset[str]) -> tuple[Role, ...]:
    """The models the run holds for `needs`: a reference iff "ref_logp" (its own model, the policy with its adapter
    off under LoRA without model.ref_path, or on the rollout workers); a teacher iff "teacher_logp"; a critic iff
    "values"; a reward model iff "reward" and reward_model.path; a process reward model iff "step_reward" and
    rewards.process=model."""
    a, adapters = cfg.algorithm, bool(cfg.model.lora.r)
    out = [Role("policy", "trainer", "start", True)]
    if "ref_logp" in needs:
        origin = cfg.model.ref_path or "start"
        if cfg.rollout.reference_on == "workers":
            out.append(Role("reference", "workers", origin, False))
        elif adapters and cfg.model.ref_path is None:
            out.append(Role("reference", "adapter_off", "start", False, scored_once=source.scores_reference))
        else:
            out.append(Role("reference", "trainer", origin, False, scored_once=source.scores_reference))
    if "teacher_logp" in needs:  # rollout.reference_on=workers puts every frozen model that scores a batch there
        out.append(Role("teacher", "workers" if cfg.rollout.reference_on == "workers" else "trainer",
                        cfg.model.teacher_path or "embedded", False))
    if "values" in needs:
        out.append(Role("critic", "trainer", getattr(a, "critic_path", None) or "start", True))
    if "reward" in needs and cfg.reward_model.path:
        out.append(Role("reward_model", "trainer", cfg.reward_model.path, False))
    if "step_reward" in needs and cfg.rewards.process == "model":
        out.append(Role("process_reward_model", "trainer", cfg.reward_model.process_path, False))
    return tuple(out)


def _stages(cfg: RunConfig, source, needs: frozenset[str]) -> tuple[str, ...]:
    """The online source's stages the config switches on, in their order (posttrain.stages.STAGES)."""
    from posttrain.stages import STAGES

    if not source.on_policy:
        return ()
    return tuple(s.key for s in STAGES if s.on(cfg, needs))


def _chunks(total: int, size: int) -> tuple[int, ...]:
    """The sizes of `total` items cut in order into pieces of `size`, the last one smaller."""
    return (size,) * (total // size) + ((total % size,) if total % size else ())


# What `train.batch_size` counts with each built-in source; a source registered later counts rows.
BATCH_UNITS = {"online": "prompts", "offline": "rows", "samples_once": "samples", "pairs": "pairs"}


def _shape(cfg: RunConfig, plugin, source) -> Shape:
    """One step at its bounds: the rules of Engine.minibatches and Engine.micro_batches, with every prompt at
    data.max_prompt_len and every response at its budget (rollout.max_new_tokens when sampled, data.max_response_len
    when from a file). A token budget is counted with every row at its bounds: the most micro-batches a step takes."""
    a, t, r, d = cfg.algorithm, cfg.train, cfg.rollout, cfg.data
    unit = plugin.unit
    n = plugin.samples_per_prompt(a) if source.on_policy else 1
    rows = t.batch_size * (plugin.rows_per_item(a) if source.on_policy else unit)
    micro = max(unit, t.micro_batch_size // unit * unit)
    from_file = plugin.source == "offline" or bool(getattr(a, "pairs_path", None))
    response = d.max_response_len if from_file else r.max_new_tokens
    if t.micro_batch_tokens is not None:
        micro = max(unit, t.micro_batch_tokens // (d.max_prompt_len + response) // unit * unit)
    epochs, parts = plugin.epochs(a), plugin.minibatches(a)
    minibatch_rows = _chunks(rows, -(-rows // unit // parts) * unit)
    rounds = r.max_sampling_rounds if r.dynamic_sampling else 1
    sampled = (t.batch_size * n, t.batch_size * n * rounds) if source.on_policy else (0, 0)
    once = 0 if source.on_policy or from_file or not hasattr(a, "num_prompts") else a.num_prompts * a.samples_per_prompt
    return Shape(
        batch_size=t.batch_size, batch_unit=BATCH_UNITS.get(plugin.source, "rows"), samples_per_prompt=n, rows=rows,
        sampled_rows=sampled, sampled_once=once, micro_batch_rows=micro, epochs=epochs, minibatch_rows=minibatch_rows,
        micro_batches=tuple(_chunks(m, micro) for m in minibatch_rows), updates_per_step=epochs * len(minibatch_rows),
        updates=t.steps * epochs * len(minibatch_rows), scheduled_updates=t.steps * epochs * parts,
        prompt_tokens=rows * d.max_prompt_len, response_tokens=rows * response,
        sampled_tokens=(sampled[0] * r.max_new_tokens, sampled[1] * r.max_new_tokens),
        response_budget="data.max_response_len" if from_file else "rollout.max_new_tokens")
