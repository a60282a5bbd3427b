"""Building a run: every part of it made once, from the validated config, before the first step.

`build` loads the models (the policy; the reference, critic and reward models only when the plugin asks for what they
give), wraps them in the backend, starts the rollout engine, makes the judge, the controllers (the state that changes
as the run goes: posttrain.train.controllers) and the data source with its pipeline of stages, and hands them to an
`Engine`, whose `step` only runs them. A resumed run builds the same parts, then loads the checkpoint into them.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

from posttrain import judge as judges
from posttrain import rollout
from posttrain.backends import Backend
from posttrain.config import algorithm_of
from posttrain.core.errors import ConfigError
from posttrain.core.memory import RoleBytes
from posttrain.core.schedules import lr_factor
from posttrain.data import uses_chat
from posttrain.data.difficulty import AdaptiveGroups
from posttrain.data.lengths import check_token_budget
from posttrain.models import lora
from posttrain.models.gated_mlp import lean_gated_mlps
from posttrain.models.loading import check_same_vocab, load, load_tokenizer, model_dir, stop_token_ids
from posttrain.rollout.shared import Lanes, SharedPool
from posttrain.rollout.workers import START_S, WorkerPool, WorkerSpec
from posttrain.schema import RunConfig, cache_root, weights_dtype
from posttrain.sources import SOURCES, Deps
from posttrain.sources.episodes import episodes_for
from posttrain.train.controllers import build_controllers
from posttrain.train.engine import Engine
from posttrain.train.plan import Machine, RunPlan
from posttrain.train.plan import plan as make_plan
from posttrain.train.producer import Producer


def build(cfg: RunConfig, model_path: str | Path, backend: Backend, splits: tuple[list[dict], list[dict]],
          plan: RunPlan | None = None, teacher_path: str | Path | None = None, rewards: dict | None = None) -> Engine:
    """The run's engine with all its parts, as `plan` says.

    Args:
        cfg: the validated config (never changed after this).
        model_path: the starting policy's directory.
        backend: how training is distributed; `backend.precision` is the precision that runs.
        splits: (training rows, held-out rows).
        plan: how the run is assembled (posttrain/train/plan.py), which nothing here decides again; None: the plan of
            `cfg` on this machine.
        teacher_path: the distillation teacher's directory where the plan has a teacher: model.teacher_path, or the
            embedded teacher's (posttrain.apps.warmup.ensure_teacher).
        rewards: Python reward functions by name -> (function, weight), beside the config's (`Judge`'s `functions`).
    """
    plan = plan or make_plan(cfg, Machine.here(cfg))
    model_path = Path(model_path)
    plugin = algorithm_of(cfg)
    needs = frozenset(plan.needs)
    train_rows, test_rows = splits
    t, a, adapters = cfg.train, cfg.algorithm, cfg.model.lora
    precision = backend.precision  # as it runs: train.precision=auto resolved for the device
    dtype, frozen = weights_dtype(precision, trained=True), weights_dtype(precision, trained=False)
    roles = RoleBytes()

    policy, tokenizer = load(model_path, dtype=dtype)
    lean_gated_mlps(policy)  # trained models keep two of each MLP's four activations for backward
    if adapters.r:
        policy = lora.apply(policy, adapters, model_path)
    uses_chat(tokenizer, cfg.data)  # chat_template=true without a template fails here, before any work
    if not getattr(a, "pairs_path", None):  # a pair file's sequences are read by its source, not from the rows
        # the offline source trains on the rows' own responses; every other one on responses sampled up to
        # rollout.max_new_tokens (the prompts' lengths need the tokenizer, hence here)
        check_token_budget(tokenizer, train_rows, cfg, given=plugin.source == "offline")
    judge = judges.build(cfg, backend.device, with_reward_model="reward" in needs, place=backend.freeze,
                         tokenizer=tokenizer, with_process_model="step_reward" in needs, precision=precision,
                         functions=rewards)

    # The reference, where the plan puts it: its own frozen model on the trainer, the policy with its LoRA adapter
    # off, or the rollout workers' (which score each batch they make).
    reference, ref, ref_on_workers = plan.role("reference"), None, None
    if reference is not None and reference.where == "workers":
        ref_on_workers = reference_dir(cfg, model_path)
    elif reference is not None and reference.where == "trainer":
        ref = backend.freeze(load(cfg.model.ref_path or model_path, dtype=frozen, key="model.ref_path")[0])

    teacher, teacher_on_workers = None, None
    if plan.role("teacher") is not None:  # frozen and scored like the reference; its tokens must be the policy's
        if teacher_path is None:
            raise ConfigError("model.teacher_path: distillation needs a teacher, and none was given")
        if plan.role("teacher").where == "workers":  # its tokens checked here, the model held by each worker
            check_same_vocab(load_tokenizer(teacher_path, "model.teacher_path"), tokenizer, teacher_path,
                             "model.teacher_path")
            teacher_on_workers = Path(teacher_path)
        else:
            teacher = backend.freeze(load(teacher_path, dtype=frozen, key="model.teacher_path",
                                          same_vocab_as=tokenizer)[0])

    parameters = lora.parameter_counts(policy)  # counted whole, before a backend shards them
    schedule = functools.partial(lr_factor, schedule=t.lr_schedule, warmup=t.warmup_steps,
                                 total=plan.shape.scheduled_updates, cycles=t.lr_cycles, floor=t.min_lr / t.lr)
    trained_policy = backend.train(policy, lr=t.lr, weight_decay=t.weight_decay, schedule=schedule,
                                   max_grad_norm=t.max_grad_norm)
    critic = None
    if plan.role("critic") is not None:  # a critic, its gradients and its AdamW state: loaded only when asked for
        model, _ = load(a.critic_path or model_path, "critic", dtype=dtype, same_vocab_as=tokenizer,
                        key="algorithm.critic_path" if a.critic_path else "model.path")
        lean_gated_mlps(model)
        if adapters.r:  # its own adapter and value head on its own copy of the base (docs/lora.md says why)
            model = lora.apply(model, adapters, a.critic_path or model_path, kind="critic")
        critic = backend.train(model, lr=a.critic_lr, weight_decay=t.weight_decay, max_grad_norm=t.max_grad_norm)

    sampler = lora.hf_model(backend.generation_model(trained_policy))  # adapters in place when adapted
    setup = rollout.Setup(
        policy=sampler, model_path=model_path, pad_id=tokenizer.pad_token_id,
        stop_ids=stop_token_ids(sampler, tokenizer), sampling=cfg.rollout, precision=precision,
        seed=cfg.seed + backend.rank, max_seqs=max(t.batch_size * plugin.samples_per_prompt(a), cfg.eval.batch_size),
        agree=backend.agree if backend.sharded else None)
    p = plan.rollout
    lanes = share_workers(cfg, backend, judge) if p.shared_workers else None
    if p.placement != "separate":
        rollouts = rollout.get(cfg.rollout.engine).start(setup)
    elif lanes is None:
        rollouts = start_workers(cfg, plan, setup, dtype, ref_on_workers, teacher_on_workers)
    else:  # the first process holds the workers; every process samples through them in collective calls
        pool = start_workers(cfg, plan, setup, dtype, ref_on_workers, teacher_on_workers) if backend.rank == 0 else None
        backend.barrier()  # the others wait while the first starts them
        rollouts = SharedPool(pool, lanes.main, shared_rng=p.shared_rng, name=cfg.rollout.engine,
                              takes_adapter=p.weight_sync == "adapter")

    source_cls = SOURCES.find(plugin.source)
    ahead = p.placement == "separate" and source_cls.on_policy  # a producer thread makes the source's batches
    # Shared workers: the source, and the producer that runs it, call on the producer thread's lane; everything else
    # (evaluation, the samples RFT and DPO draw once at the start) on the main one.
    lane = (lanes.producer if ahead else lanes.main) if lanes is not None else None
    source_rollouts = rollouts.on(lane) if lane is not None else rollouts
    controllers = build_controllers(cfg, train_rows, backend.rank, backend.world_size, tokenizer.pad_token_id)
    r, n = cfg.rollout, plugin.samples_per_prompt(a)
    episodes = episodes_for(cfg.env, rollouts, tokenizer, cfg.data, setup.stop_ids,  # for sources and eval
                            turns="step_reward" in needs and cfg.rewards.process == "turns")

    def make_source(score_reference):
        return source_cls.from_deps(Deps(
            tokenizer=tokenizer, data=cfg.data, batch_size=t.batch_size, sampler=controllers.draws,
            micro_batch_size=t.micro_batch_size, seed=cfg.seed, algorithm=a, samples_per_prompt=n,
            rollout=source_rollouts, sampling=r, judge=judge, score_reference=score_reference, model_path=model_path,
            cache_dir=cache_root(cfg), agree=lane.agree if lane else backend.agree, rewards=cfg.rewards,
            needs=needs, pass_rates=controllers.pass_rates, temperature=controllers.temperature,
            elite=controllers.elite, reduce=lane.reduce if lane else lambda x, op: backend.reduce(x.to(backend.device), op),
            group_sizes=AdaptiveGroups(controllers.pass_rates, n, r.min_group_size, r.max_group_size,
                                       r.group_size_target) if r.adaptive_group_size else None,
            episodes=episodes, stages=plan.stages))

    def make_producer(source):  # the online source's batches, made ahead; the others sampled at the start
        return Producer(source, controllers.draws, source_rollouts, p.max_staleness, t.steps, backend.autocast,
                        frozen=ref_on_workers is not None or teacher_on_workers is not None)

    engine = Engine(cfg=cfg, plan=plan, backend=backend, model_path=model_path, plugin=plugin, tokenizer=tokenizer,
                    judge=judge, policy=trained_policy, ref=ref, ref_is_base=reference is not None and
                    reference.where == "adapter_off", teacher=teacher, critic=critic, rollout=rollouts, controllers=controllers,
                    test_rows=test_rows, parameters=parameters, roles=roles, episodes=episodes,
                    make_source=make_source,
                    make_producer=make_producer if ahead else None)
    rm = getattr(judge.reward_model, "model", None)
    for role, model in (("policy_weights", sampler), ("reference_weights", ref), ("teacher_weights", teacher),
                        ("critic_weights", critic and critic.module), ("reward_model_weights", rm)):
        if model is not None:
            roles.observe(role, backend.weight_bytes(model))
    return engine


def start_workers(cfg: RunConfig, plan: RunPlan, setup: rollout.Setup, dtype: str,
                  reference: Path | None = None, teacher: Path | None = None) -> WorkerPool:
    """The rollout workers of `rollout.placement=separate`, each on the cores the plan gives it (the trainer keeping
    the rest); holding the reference model in `reference` and the teacher in `teacher` when given."""
    r, p = cfg.rollout, plan.rollout
    began = time.perf_counter()
    spec = worker_spec(cfg, plan, setup, dtype, reference, teacher)
    launcher = None  # local: processes of this one
    if p.launcher == "ray":  # Ray actors, each in a placement group bundle of its own, on any node of the cluster
        from posttrain.rollout.workers.actors import RayLauncher

        launcher = RayLauncher(spec, p.workers, address=cfg.ray.address, strategy=cfg.ray.strategy,
                               max_restarts=r.max_worker_restarts, start_s=max(r.worker_timeout_s, START_S))
    pool = WorkerPool(spec, p.workers, cpus=[list(c) for c in p.worker_cpus] if p.worker_cpus is not None else None,
                      shared_rng=p.shared_rng, max_restarts=r.max_worker_restarts, bucket_mb=r.weight_bucket_mb,
                      launcher=launcher, gpus=[list(g) for g in p.worker_gpus] if p.worker_gpus else None)
    pool.start_s = time.perf_counter() - began  # joining the cluster and placing the bundles included (Ray)
    return pool


def worker_spec(cfg: RunConfig, plan: RunPlan, setup: rollout.Setup, dtype: str,
                reference: Path | None = None, teacher: Path | None = None) -> WorkerSpec:
    """What each rollout worker builds: the trainer's sampler, on its own copy of the starting policy; and the frozen
    reference model in `reference` and teacher in `teacher`, when given (rollout.reference_on=workers)."""
    r, p = cfg.rollout, plan.rollout
    scoring = plan.passes.worker_scoring
    return WorkerSpec(engine=r.engine, model_path=str(setup.model_path), dtype=dtype, precision=setup.precision,
                      lora=cfg.model.lora if p.weight_sync == "adapter" else None, sampling=r, pad_id=setup.pad_id,
                      stop_ids=tuple(setup.stop_ids), seed=setup.seed, max_seqs=setup.max_seqs,
                      threads=p.worker_threads, timeout_s=r.worker_timeout_s, gpus=r.gpus,
                      transport=p.transport if p.transport != "none" else "gloo",
                      attention=trainer_attention(setup.policy),
                      reference=str(reference) if reference is not None else None,
                      teacher=str(teacher) if teacher is not None else None,
                      reference_dtype=weights_dtype(setup.precision, trained=False),
                      **({"micro": scoring.rows, "micro_tokens": scoring.tokens, "packing": scoring.packing}
                         if scoring is not None else {}))


def reference_dir(cfg: RunConfig, model_path: Path) -> Path:
    """The reference model's directory for rollout.reference_on=workers: model.ref_path, checked here so that a bad
    one is a one-line error naming it rather than a worker that cannot start; else the starting policy (under LoRA,
    the base the adapter is added to, which is the policy with its adapter off)."""
    return model_path if cfg.model.ref_path is None else model_dir(cfg.model.ref_path, "model.ref_path")


def share_workers(cfg: RunConfig, backend: Backend, judge) -> Lanes:
    """The groups over which several training processes share the workers (posttrain.rollout.shared). Refused where
    the producer thread would run a sharded model's forward beside the trainer's collectives: a reward model or
    process reward model under fsdp2 or zero3; and for multi-turn episodes, whose turns the processes would have to
    take in step."""
    if cfg.env.name is not None:
        raise ConfigError("env.name: multi-turn episodes sample through rollout workers from one training process; "
                          "with several, use rollout.placement=colocated, for now")
    if backend.sharded and (judge.reward_model is not None or judge.process_model is not None):
        key = "reward_model.path" if judge.reward_model is not None else "reward_model.process_path"
        raise ConfigError(f"{key}: a reward model is sharded under train.backend={cfg.train.backend}, and its forward "
                          "would run beside the update; with rollout.placement=separate on several processes, "
                          "use train.backend=ddp or zero2")
    return Lanes(cfg.rollout.worker_timeout_s)


def trainer_attention(policy) -> str | None:
    """The attention the trainer's sampler computes with (the backend chose it for the update's backward: eager for
    bf16 on CPU). Workers sample with it too: at max_staleness 0 so that they sample exactly as the colocated run,
    and at every k because the model's own (SDPA) is no safe bet for bf16 decoding on CPU: on one thread it took 1.8x
    as long as eager attention where the CPU has AVX512-BF16 without AMX, though 20% less where it has AMX
    (docs/async.md)."""
    return getattr(getattr(policy, "config", None), "_attn_implementation", None)
