"""The engine: one training step for every method.

The run's parts are built once (posttrain/train/build.py); each step only runs them. Each step: the plugin's data
source makes a `Batch` (offline rows, or policy samples with rewards); the engine scores
whatever the plugin asked for (reference and old log-probs, critic values); the plugin prepares the batch (advantages)
and gives a gradient coefficient per token; the engine turns it into −aggregate(stopgrad(GC) · log πθ), accumulates
gradients over micro-batches, steps the optimizer through the backend, and hands the new weights to the rollout
engine. Nothing here depends on which method runs, how training is distributed, or which engine samples.

Losses are divided by the token and sequence counts of the whole step across processes (`totals`), so the update does
not depend on how the batch is split into micro-batches or over processes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import torch

from posttrain.backends import Backend, Trained
from posttrain.core import micro
from posttrain.core.aggregation import Totals, aggregate
from posttrain.core.batch import Batch
from posttrain.core.errors import TrainingError, UserError
from posttrain.core.heap import large_allocations_mapped
from posttrain.core.memory import PhasePeaks, RoleBytes, batch_bytes
from posttrain.models import lora
from posttrain.models.scoring import packs, token_logprobs, token_values
from posttrain.rollout.base import Workers
from posttrain.schema import RunConfig
from posttrain.stages.elite import fresh_mask
from posttrain.train.evaluation import evaluate
from posttrain.train.plan import RunPlan


def mean_metrics(updates: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Each metric averaged over the updates that logged it (PPO and GRPO with μ > 1 take several per step)."""
    keys = dict.fromkeys(k for u in updates for k in u)
    return {k: sum(u[k] for u in updates if k in u) / sum(k in u for u in updates) for k in keys}


class Engine:
    """One run's parts, built once by `posttrain.train.build.build` as the run's plan (posttrain/train/plan.py) says,
    and `step`, which runs them: it constructs nothing and writes no config. No attribute is set from outside after
    construction; what changes from step to step lives in `controllers` (posttrain.train.controllers) and in the
    engine's own counters, which only its methods move.

    Args:
        cfg: the validated config; plan: how the run is assembled.
        plugin: the method's plugin.
        policy, critic: the trained models as the backend wraps them (critic None when not needed).
        ref, ref_is_base: the frozen reference model, or (LoRA) True to score the policy with its adapter off.
        teacher: the frozen distillation teacher (None when the method has none).
        rollout: the rollout engine; judge: rewards and verdicts; controllers: the run's changing state.
        test_rows: the held-out rows; parameters: trained and total parameter counts; roles: bytes by role.
        episodes: with env.name, the Episodes the source and the evaluation sample with (sources/episodes.py).
        make_source: the data source, given what scores the reference log-probs of a batch (None: nothing does);
            made once the rollout engine holds the starting weights, since a source may sample as it is made (RFT).
        make_producer: the thread that makes the source's batches ahead (rollout.placement=separate), or None.
    """

    def __init__(self, *, cfg: RunConfig, plan: RunPlan, backend: Backend, model_path: Path, plugin, tokenizer,
                 judge, policy: Trained, ref, ref_is_base: bool, critic: Trained | None, rollout, controllers,
                 teacher=None,
                 test_rows: list[dict], parameters: dict, roles: RoleBytes, episodes=None,
                 make_source: Callable, make_producer: Callable | None = None):
        self.cfg, self.plan, self.backend, self.model_path, self.plugin = cfg, plan, backend, model_path, plugin
        self.needs = frozenset(plan.needs)
        self.tokenizer, self.judge, self.policy, self.critic, self.rollout = tokenizer, judge, policy, critic, rollout
        self.ref, self.ref_is_base, self.controllers, self.episodes = ref, ref_is_base, controllers, episodes
        self.teacher = teacher
        self.test_rows, self.parameters, self.roles, self.phases = test_rows, parameters, roles, PhasePeaks()
        t, a, r = cfg.train, cfg.algorithm, plan.rollout
        self.weight_sync = r.weight_sync  # what reaches the rollout engine after each update (the plan's)
        self.samples: list[dict] = []  # the step's trained samples, when train.log_samples asks for them
        self.tis_cap, self.tis_mode, self.proximal = r.tis_cap, r.tis_mode, r.proximal  # the correction as resolved
        self.elite_is_cap = r.elite_is_cap
        self.loss_agg = (t.loss_agg, t.loss_agg_norm or float(cfg.rollout.max_new_tokens))  # the config's
        self.mode, self.norm = plugin.aggregation(a) or self.loss_agg
        update = plan.passes.update
        self.micro = update.rows
        self.micro_tokens = update.tokens  # None: micro-batches of self.micro rows
        # train.packing where every model scored confines attention to each packed sequence; else padded (run notes)
        self.packed = update.packing and packs_all(policy.module, ref, teacher, critic and critic.module)
        config = getattr(lora.hf_model(policy.module), "config", None)
        self.model_type = f"{getattr(config, 'model_type', '?')} ({getattr(config, '_attn_implementation', '?')})"
        self.algorithm = a  # the plugin's config of the step under way: the validated one, or with a scheduled β
        self.skipped, self.skipped_steps, self.skipped_in_a_row = False, 0, 0  # non-finite updates skipped
        self.steps_done = 0  # steps of the run so far (a resumed run starts from its checkpoint's: `resume_at`)
        self.mismatch = torch.zeros(3, device=backend.device)  # this step's Σ k3, tokens, max |Δ log π|
        self.elite_sums = torch.zeros(2, device=backend.device)  # this step's Σ elite weight, replayed tokens
        if r.placement == "separate":  # version 0, before a source samples through them: the workers loaded the
            self.sync_rollout()  # start model's files, and an adapter starts afresh
        with backend.autocast():  # sources that sample a fixed set (RFT) do it here
            self.source = make_source((lambda b: self.reference_logp(b.to(backend.device))) if self.has_reference
                                      else None)
        reference = plan.role("reference")
        if reference is not None and reference.scored_once:
            self.ref, self.ref_is_base = None, False  # the source holds the reference log-probs it needs
        self.producer = make_producer(self.source) if make_producer is not None else None

    def resume_at(self, step: int, skipped: tuple[int, int]) -> None:
        """Counts `step` steps done and the skipped updates' counts (steps, in a row) as a checkpoint holds them:
        first, since the rollout engine's policy version is the steps done."""
        self.steps_done = step
        self.skipped_steps, self.skipped_in_a_row = skipped

    def micro_batches(self, batch: Batch) -> list[tuple[torch.Tensor | None, Batch]]:
        """The batch in micro-batches of whole units, longest rows first so that rows of similar length go together,
        each trimmed of the columns that are padding in all its rows; with the rows of `batch` each one holds.
        Micro-batches are `self.micro` rows, or under a token budget (`micro.token_budget`) as many units as it fits; then,
        on several processes, every process runs as many as the one with most, the others padded with empty
        micro-batches (rows None: one row of `batch` whose mask is all zeros), so that sharded backends' gathers and
        reductions pair up.

        The loss is normalised by the whole step's counts, so neither the order nor the split changes the update.
        """
        parts = micro.split(batch.lengths(), self.plugin.unit, self.micro, self.micro_tokens, self.packed)
        out = [(idx, batch.select(idx).trimmed()) for idx in parts]
        if self.micro_tokens is None:
            return out
        most = int(self.backend.reduce(torch.tensor(float(len(out)), device=self.backend.device), "max"))
        if most > len(out):
            empty = batch.select(parts[0][:1]).trimmed()
            empty = dataclasses.replace(empty, mask=torch.zeros_like(empty.mask))
            out += [(None, empty)] * (most - len(out))
        return out

    def _per_token(self, batch: Batch, fn) -> torch.Tensor:
        """`fn(micro-batch)` -> [b, R'] for every micro-batch, put back into the rows and columns of `batch`."""
        out = torch.zeros(batch.mask.shape, device=batch.mask.device)  # [B, R]
        for rows, mb in self.micro_batches(batch):
            part = fn(mb)  # [b, R']
            if rows is not None:
                out[rows, : part.shape[1]] = part
        return out

    @torch.no_grad()
    def score(self, model, batch: Batch) -> torch.Tensor:
        """log π of the response tokens under a model not being trained here (reference, or policy as π_old)."""
        with self.backend.autocast():
            return self._per_token(batch, lambda mb: token_logprobs(
                model, mb.input_ids, mb.attention_mask, mb.prompt_len, temperature=batch.temperature,
                packed=self.packed))  # [B, R]

    def scored(self, batch: Batch) -> Batch:
        """`batch` with what the plugin asked the engine for (reference, teacher and old log-probs, the critic's
        values)."""
        if self.has_reference:
            batch.ref_logp = self.reference_logp(batch)
        if self.teacher is not None:  # at the sampling temperature, as the reference
            batch.teacher_logp = self.score(self.teacher, batch)
        if "old_logp" in self.needs:
            batch.old_logp = self.score(self.policy.module, batch)
        if self.critic is not None:
            batch.extra["values"] = self.values(batch)
        return batch

    @property
    def has_reference(self) -> bool:
        """Whether the trainer scores the reference log-probs of each step's batch."""
        return self.ref is not None or self.ref_is_base

    def reference_logp(self, batch: Batch) -> torch.Tensor:
        """log π_ref of the response tokens: the reference model's, or the policy's with its adapter off."""
        if self.ref is not None:
            return self.score(self.ref, batch)
        with lora.adapter_off(self.policy.module):
            return self.score(self.policy.module, batch)

    @torch.no_grad()
    def values(self, batch: Batch) -> torch.Tensor:
        """The critic's values of the response positions at sampling time."""
        with self.backend.autocast():
            return self._per_token(batch, lambda mb: token_values(self.critic.module, mb.input_ids, mb.attention_mask,
                                                                  mb.prompt_len, packed=self.packed))  # [B, R]

    def observe_mismatch(self, trainer: torch.Tensor, sampled: torch.Tensor, mask: torch.Tensor) -> None:
        """Adds tokens to this step's train-inference mismatch: `self.mismatch` = [Σ k3, tokens, max |Δ log π|]."""
        s = mismatch_sums(trainer, sampled, mask)
        self.mismatch[:2] += s[:2]
        self.mismatch[2] = torch.maximum(self.mismatch[2], s[2])

    # -- update -----------------------------------------------------------------------------------------------
    def accumulate(self, batch: Batch, totals: Totals, loss_fn: Callable | None = None) -> dict[str, torch.Tensor]:
        """Back-propagates the loss of the whole batch, one micro-batch at a time (gradients add up). Logs the loss and,
        beside it, the method's `objective` (algorithms/base.py), aggregated the same way and computed without grad.

        `loss_fn`, when given, replaces the plugin's GC: `loss_fn(micro_batch, logp)` -> a per-token loss [b, R] (or
        that and a dict of metrics), a differentiable function of the policy's log-probs `logp` [b, R], aggregated
        as the run aggregates (train.loss_agg); the critic, if any, is not trained, and no objective is logged."""
        backend, algorithm = self.backend, self.algorithm
        micro = self.micro_batches(batch)
        real = sum(rows is not None for rows, _ in micro)  # the rest are empty (see micro_batches)
        critic = self.critic if loss_fn is None else None
        trained = [t for t in (self.policy, critic) if t is not None]
        loss_sum, metrics = torch.zeros((), device=backend.device), {}
        objective_sum = torch.zeros((), device=backend.device)
        for i, (rows, mb) in enumerate(micro):
            with backend.accumulating(trained, sync=i == len(micro) - 1):  # all-reduced once, after the last
                with backend.autocast():
                    logp = token_logprobs(self.policy.module, mb.input_ids, mb.attention_mask, mb.prompt_len,
                                          temperature=mb.temperature, packed=self.packed)  # [b, R] float32
                if rows is None:  # an empty micro-batch: the forwards and backwards of the others, with no gradient
                    self.empty_backward(mb, logp)
                    continue
                if loss_fn is not None:
                    per_token, m = own_loss(loss_fn, mb, logp)  # [b, R]
                    loss = aggregate(per_token, mb.mask, self.mode, totals, self.norm)
                else:
                    gc, m = self.coefficient(mb, logp.detach())  # [b, R]
                    loss = -aggregate(gc.detach() * logp, mb.mask, self.mode, totals, self.norm)
                backend.backward(loss, self.policy)
                if critic is not None:
                    with backend.autocast():
                        values = token_values(critic.module, mb.input_ids, mb.attention_mask, mb.prompt_len,
                                              packed=self.packed)
                    per_token, cm = self.plugin.critic_loss(mb, values, algorithm)  # [b, R]
                    critic_mode, critic_norm = self.plugin.critic_aggregation(algorithm)
                    critic_loss = aggregate(per_token, mb.mask, critic_mode, totals, critic_norm)
                    backend.backward(critic_loss, critic)
                    m = {**m, **cm, "critic_loss": critic_loss * real}
            loss_sum += loss.detach()
            if loss_fn is None:
                with torch.no_grad():  # logged only: the gradient, and so the weights, are the loss's alone
                    objective = self.plugin.objective(self.for_plugin(mb), logp.detach(), algorithm)  # [b, R]
                    objective_sum += aggregate(objective, mb.mask, self.mode, totals, self.norm)
            for k, v in m.items():
                metrics[k] = metrics.get(k, 0) + torch.as_tensor(v).detach() / real
        metrics["loss"] = loss_sum
        if loss_fn is None:
            metrics["objective"] = objective_sum
        metrics["micro_batches"] = torch.tensor(float(len(micro)))  # counted over the step (`step`), not averaged
        return metrics

    def empty_backward(self, mb: Batch, logp: torch.Tensor) -> None:
        """The backward of an empty micro-batch: zero times the policy's forward (and the critic's), so that every
        parameter takes part and a sharded backend's reductions run as on the other processes."""
        self.backend.backward(logp.sum() * 0.0, self.policy)
        if self.critic is not None:
            with self.backend.autocast():
                values = token_values(self.critic.module, mb.input_ids, mb.attention_mask, mb.prompt_len,
                                      packed=self.packed)
            self.backend.backward(values.sum() * 0.0, self.critic)

    def coefficient(self, mb: Batch, logp: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """GC of each token of a micro-batch ([b, R]) and the plugin's metrics: the plugin's GC, times the importance
        weight of `rollout.tis_cap` and `tis_mode` when the cap is set and the rollout engine reported its log-probs; on
        rows replayed from an elite pool (stages/elite.py), times V-trace's min(π_old / μ, rollout.elite_is_cap)
        instead. Under `rollout.proximal=sampler` the plugin's π_old is the sampler's log-probs (`for_plugin`), whose
        ratio carries the importance weight (tis_cap is then off)."""
        gc, m = self.plugin.coefficient(self.for_plugin(mb), logp, self.algorithm)  # [b, R]
        if mb.rollout_logp is None:
            return gc, m
        # log π_trainer under the weights that sampled: old_logp, or this forward when it is the step's only update
        # (the engine asks for old_logp otherwise)
        at_sampling = mb.old_logp if mb.old_logp is not None else logp  # [b, R]
        fresh = fresh_mask(mb)  # [b, R] a replayed row's rollout_logp is μ's, not this step's rollout engine's
        if mb.old_logp is None:
            self.observe_mismatch(at_sampling, mb.rollout_logp, fresh)
        replayed = mb.extra.get("replayed")  # [b] 1.0 on rows an older policy μ drew; None: no elite pool
        if self.tis_cap is None and replayed is None:
            return gc, m
        weight = torch.ones_like(gc)  # [b, R]
        if self.tis_cap is not None:
            weight, bounded = tis_weight(at_sampling, mb.rollout_logp, self.tis_cap, self.tis_mode, mb.mask)  # [b, R]
            m = {**m, "mismatch/tis_capped": (bounded.float() * fresh).sum() / fresh.sum().clamp(min=1)}
        if replayed is not None:  # the same truncated ratio, of π_old to μ (the replayed rows' rollout_logp)
            elite, _ = tis_weight(at_sampling, mb.rollout_logp, self.elite_is_cap)  # [b, R]
            weight = torch.where(replayed[:, None] > 0, elite, weight)  # [b, R]
            on = mb.mask * replayed[:, None]  # [b, R] replayed tokens
            self.elite_sums += torch.stack([(elite * on).sum(), on.sum()]).detach()  # the step's, for elite/is_weight
        return gc * weight, m

    def for_plugin(self, mb: Batch) -> Batch:
        """The micro-batch as the plugin's GC and objective see it: under `rollout.proximal=sampler`, with the log-probs
        the rollout engine reported as π_old (the plugin's `prepare`, PPO's KL reward among it, kept the trainer's)."""
        if self.proximal != "sampler":
            return mb
        if mb.rollout_logp is None:
            raise TrainingError("rollout.proximal: sampler takes π_old from the log-probs the rollout engine reports, "
                                "and this batch has none")
        return dataclasses.replace(mb, old_logp=mb.rollout_logp)

    def update(self, batch: Batch, totals: Totals) -> dict[str, torch.Tensor]:
        """One optimizer step (policy, and critic if any) on the gradient of the whole batch (`apply`)."""
        return self.apply(self.accumulate(batch, totals))

    def apply(self, metrics: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The optimizer step on the gradients accumulated, whose loss `metrics` holds; returns `metrics` with the
        gradient norms (and loss scales) added.

        A non-finite loss (on any process) or gradient norm skips the step: the gradients are dropped, the weights,
        AdamW state and schedule stay as they were, and `self.skipped` says so."""
        max_norm = self.cfg.train.max_grad_norm
        finite = torch.isfinite(metrics["loss"]).float().to(self.backend.device)
        self.skipped = not bool(self.backend.reduce(finite, "min"))  # every process decides alike
        if self.skipped and not self.backend.skips_nonfinite:
            raise TrainingError(f"train.backend={self.backend.name}: the loss is not finite, and DeepSpeed's "
                                "accumulated gradients cannot be dropped here; lower train.lr or use ddp or fsdp2, "
                                "which skip such steps")
        for name, trained in self.trained().items():
            self.roles.observe(f"{name}_gradients", self.backend.gradient_bytes(trained))
            if self.skipped:
                trained.optimizer.zero_grad(set_to_none=True)
                continue
            norm = self.backend.step(trained, max_norm)  # itself skips a non-finite norm
            if norm is not None:
                metrics["grad_norm" if name == "policy" else "critic_grad_norm"] = norm
                if not torch.isfinite(norm) and not self.backend.skips_nonfinite:
                    raise TrainingError(f"train.backend={self.backend.name}: the {name}'s gradient norm is {float(norm)}"
                                        " and the optimizer has already stepped; lower train.lr or use ddp or fsdp2,"
                                        " which skip such steps")
                self.skipped |= not bool(torch.isfinite(norm))
            if trained.scale is not None:  # fp16-mixed: S after this step (halved by an overflow)
                metrics["loss_scale" if name == "policy" else "critic_loss_scale"] = torch.tensor(trained.scale.scale)
            self.roles.observe(f"{name}_optimizer_state", self.backend.optimizer_bytes(trained))
        return metrics

    def totals(self, batch: Batch) -> Totals:
        """Sequences and tokens of `batch` summed over every process: the denominators of its loss."""
        local = Totals.of(batch.mask)
        counts = torch.tensor([local.seqs, local.tokens], device=self.backend.device)
        return Totals(*self.backend.reduce(counts, "sum").tolist())

    def minibatches(self, batch: Batch) -> list[Batch]:
        """The batch cut into the plugin's number of minibatches, whole units each, shuffled each epoch."""
        n = self.plugin.minibatches(self.algorithm)
        if n == 1:
            return [batch]
        unit = self.plugin.unit
        order = torch.randperm(len(batch) // unit, device=batch.input_ids.device)  # [units]
        rows = (order[:, None] * unit + torch.arange(unit, device=order.device)).flatten()  # [B]
        size = -(-len(batch) // unit // n) * unit
        return [batch.select(rows[i : i + size]) for i in range(0, len(batch), size)]

    def sample(self) -> tuple[Batch, dict[str, float]]:
        """The first part of a step: the step counted, the controllers moved to it, and the source's batch (sampled,
        judged and staged, or the offline rows) on the device, with its statistics."""
        phases, backend = self.phases, self.backend
        self.steps_done += 1
        self.controllers.at(self.steps_done, draws=self.producer is None)  # the producer moves its own draws
        self.algorithm = self.controllers.algorithm(self.cfg.algorithm)  # a copy with this step's β, if scheduled
        with phases.phase("rollout"), backend.autocast():  # sampling, rewards and the source's stages; collation
            batch, stats = self.source.next() if self.producer is None else self.producer.next(self.steps_done)
            batch = batch.to(backend.device)
        if self.producer is not None:
            self.check_staleness(batch)
        self.samples = sample_records(self.tokenizer, batch, self.steps_done) if self.cfg.train.log_samples else []
        return batch, stats

    def prepared(self, batch: Batch) -> tuple[Batch, dict[str, torch.Tensor]]:
        """The second: the batch scored for what the plugin needs (reference, teacher and old log-probs, values) and
        prepared by it (advantages), with the plugin's metrics."""
        backend = self.backend
        with self.phases.phase("scoring"):
            self.scored(batch)
        self.mismatch = torch.zeros(3, device=backend.device)
        self.elite_sums = torch.zeros(2, device=backend.device)  # Σ weight, Σ tokens over replayed tokens
        if batch.rollout_logp is not None and batch.old_logp is not None:
            self.observe_mismatch(batch.old_logp, batch.rollout_logp, fresh_mask(batch))
        batch, prep = self.plugin.prepare(batch, self.algorithm)
        self.roles.observe("rollout_batch", batch_bytes(batch))
        return batch, prep

    def step(self) -> dict[str, float]:
        """One step: the source's batch, scored for what the plugin needs, then μ × minibatches optimizer steps on
        it, then the new weights to the rollout engine. Returns the step's metrics."""
        t_start = time.perf_counter()
        clock = {"clock/step_start": self.producer.clock()} if self.producer is not None else {}
        phases, backend = self.phases, self.backend
        batch, stats = self.sample()
        batch, prep = self.prepared(batch)
        updates = []
        self.rollout.release()
        skipped, lr = 0, self.policy.scheduler.get_last_lr()[0]  # the rate of this step's first update
        with phases.phase("update"), large_allocations_mapped():
            for _ in range(self.plugin.epochs(self.algorithm)):
                for minibatch in self.minibatches(batch):
                    updates.append(self.update(minibatch, self.totals(minibatch)))
                    skipped += self.skipped
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped else 0
        self.skipped_steps += bool(skipped)
        stats.update(skipped_updates=float(skipped), skipped_steps=float(self.skipped_steps), updates=float(len(updates)),
                     micro_batches=float(sum(float(u.pop("micro_batches")) for u in updates)))
        t0 = time.perf_counter()
        self.rollout.restore()
        self.sync_rollout()
        stats.update({"time/score": phases.seconds["scoring"], "time/update": phases.seconds["update"],
                      "time/weight_sync": time.perf_counter() - t0})
        metrics = {**prep, **mean_metrics(updates)}
        reduced = {k: float(backend.reduce(torch.as_tensor(v, device=backend.device).float(), "mean"))
                   for k, v in sorted(metrics.items())}
        if "replayed" in batch.extra:  # the mean over every replayed token of the step, on every process
            weights, tokens = backend.reduce(self.elite_sums, "sum").tolist()
            reduced["elite/is_weight"] = weights / max(tokens, 1.0)
        if batch.version is not None:  # policy versions between the sampler and the weights this step updates
            reduced.update(staleness(self.steps_done - 1 - batch.version, backend.reduce))
        if batch.rollout_logp is not None:
            kl, tokens = backend.reduce(self.mismatch[:2], "sum").tolist()
            reduced["mismatch/kl"] = kl / max(tokens, 1.0)
            reduced["mismatch/max"] = float(backend.reduce(self.mismatch[2], "max"))
        elapsed = time.perf_counter() - t_start
        trained = float(batch.mask.sum())
        beta = {"beta": self.algorithm.beta} if self.plugin.kl_penalty else {}  # this step's: scheduled or not
        if clock:  # the timeline of the trainer's side, on the producer's clock
            clock["clock/step_end"] = self.producer.clock()
        return {**stats, **reduced, **clock, "trained_tokens": trained, "lr": lr, **beta,
                "tokens_per_s": (trained + stats.get("generated_tokens", 0.0)) / elapsed, "time/step": elapsed}

    def check_staleness(self, batch: Batch) -> None:
        """Refuses a fresh row (not an elite replay) sampled by a policy more than rollout.max_staleness versions
        behind the weights this step updates: the bound holds by construction, and this says so if it ever did not."""
        behind = self.steps_done - 1 - batch.version  # [B]
        if "replayed" in batch.extra:
            behind = behind[~batch.extra["replayed"].bool().to(behind.device)]
        k = self.cfg.rollout.max_staleness
        if len(behind) and int(behind.max()) > k:
            raise TrainingError(f"rollout.max_staleness: step {self.steps_done} got a row sampled {int(behind.max())} "
                                f"versions behind its weights, more than {k}")

    def sync_rollout(self) -> None:
        """Gives a rollout engine that holds its own copy of the weights (vLLM, rollout workers) the policy's current
        ones, and the policy version they are (the steps trained so far), which it stamps on what it samples."""
        self.rollout.version = self.steps_done
        if self.weight_sync == "adapter":  # the trained parameters alone, as the workers' adapted model names them
            model = lora.hf_model(self.backend.generation_model(self.policy))
            self.rollout.load_weights((name, self.backend.whole(p)) for name, p in model.named_parameters()
                                      if p.requires_grad)
        elif not self.rollout.colocated:
            self.rollout.load_weights(self.backend.weights(self.policy))

    @contextlib.contextmanager
    def method(self, plugin, algorithm):
        """Within it, `plugin`'s GC with `algorithm` (its config) trains, aggregated as it says (the primitives'
        `forward_backward` with another registered method's loss); the run's own after."""
        saved = self.plugin, self.algorithm, self.mode, self.norm, self.needs
        self.plugin, self.algorithm = plugin, algorithm
        self.mode, self.norm = plugin.aggregation(algorithm) or self.loss_agg
        self.needs = self.needs | (plugin.needs(algorithm) & {"old_logp"})  # what `scored` adds for it
        try:
            yield
        finally:
            self.plugin, self.algorithm, self.mode, self.norm, self.needs = saved

    @contextlib.contextmanager
    def pipeline_state(self):
        """What a checkpoint keeps of batches made ahead (None when they are not), with the producer held between
        two batches so that the controllers it moves match."""
        if self.producer is None:
            yield None
            return
        with self.producer.paused() as state:
            yield state

    def close(self) -> None:
        """Stops the producer and the rollout engine's processes, if any."""
        if self.producer is not None:
            self.producer.stop()
        if isinstance(self.rollout, Workers):  # processes of their own
            self.rollout.close()
        if self.producer is not None:
            self.producer.join()

    def trained(self) -> dict[str, Trained]:
        """The models being trained, by role."""
        return {name: t for name, t in (("policy", self.policy), ("critic", self.critic)) if t is not None}

    def save_training_state(self, path: Path) -> None:
        """Writes the trained models' parameters, AdamW and schedule states under `path`/<role> (every process
        takes part; the backend decides who writes what)."""
        for name, trained in self.trained().items():
            self.backend.save_state(trained, path / name)

    def load_training_state(self, path: Path) -> None:
        for name, trained in self.trained().items():
            self.backend.load_state(trained, path / name)

    def evaluate(self) -> dict:
        e = self.cfg.eval
        with self.backend.autocast():
            return evaluate(self.rollout, self.judge, self.tokenizer, self.test_rows[: e.num_problems], self.cfg.data,
                            max_new_tokens=e.max_new_tokens or self.cfg.rollout.max_new_tokens,
                            batch_size=e.batch_size, backend=self.backend, k=e.k, n=e.n,
                            temperature=self.cfg.rollout.temperature, top_p=self.cfg.rollout.top_p,
                            episodes=self.episodes)


def own_loss(loss_fn: Callable, mb: Batch, logp: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """A loss function's per-token loss for a micro-batch ([b, R], checked) and its metrics."""
    out = loss_fn(mb, logp)
    per_token, metrics = out if isinstance(out, tuple) else (out, {})
    if not isinstance(per_token, torch.Tensor) or per_token.shape != logp.shape:
        shape = tuple(per_token.shape) if isinstance(per_token, torch.Tensor) else type(per_token).__name__
        raise UserError(f"loss: the function gave {shape}; give a per-token loss of the log-probs' shape "
                        f"{tuple(logp.shape)} (it is aggregated as train.loss_agg says)")
    return per_token, dict(metrics)


def packs_all(*models) -> bool:
    """Whether every model given (None: absent) scores packed sequences (posttrain.models.scoring.packs)."""
    return all(m is None or packs(m) for m in models)


def sample_records(tokenizer, batch: Batch, step: int) -> list[dict]:
    """One record per row of `batch` for samples.jsonl: step, prompt and completion text (special tokens dropped),
    and the reward and sampling version where the batch has them."""
    prompts = [ids[keep.bool()] for ids, keep in zip(batch.input_ids[:, : batch.prompt_len].cpu(),
                                                       batch.attention_mask[:, : batch.prompt_len].cpu())]
    responses = [ids[keep.bool()] for ids, keep in zip(batch.response_ids.cpu(),  # an episode's tool replies too
                                                       batch.attention_mask[:, batch.prompt_len :].cpu())]
    texts = tokenizer.batch_decode(prompts, skip_special_tokens=True), tokenizer.batch_decode(responses,
                                                                                             skip_special_tokens=True)
    records = []
    for i, (prompt, completion) in enumerate(zip(*texts)):
        record = {"step": step, "prompt": prompt, "completion": completion}
        if batch.reward is not None:
            record["reward"] = float(batch.reward[i])
        if batch.version is not None:
            record["version"] = int(batch.version[i])
        records.append(record)
    return records


def mismatch_sums(trainer: torch.Tensor, sampled: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[Σ k3, Σ tokens, max |Δ|] over the response tokens, where Δ = log π_trainer − log π_rollout of each sampled
    token and k3 = e^Δ − 1 − Δ ≥ 0, whose mean estimates KL(π_rollout ‖ π_trainer) from the rollout's own samples."""
    d = (trainer - sampled) * mask  # [B, R]
    k3 = (d.exp() - 1 - d) * mask  # [B, R]
    return torch.stack([k3.sum(), mask.sum(), d.abs().max() if d.numel() else d.new_zeros(())])


def staleness(behind: torch.Tensor, reduce) -> dict[str, float]:
    """`staleness/mean` and `staleness/max` over every process's rows: how many policy versions (optimizer steps of
    the loop) each row's sampler was behind the weights the step updates ([B] long). 0 for rows sampled this step;
    more for rows an older policy drew (an elite pool's replays)."""
    device = behind.device
    total, rows = reduce(torch.stack([behind.sum().float(), torch.tensor(float(len(behind)), device=device)]),
                         "sum").tolist()
    most = reduce(behind.max().float() if len(behind) else torch.zeros((), device=device), "max")
    return {"staleness/mean": total / max(rows, 1.0), "staleness/max": float(most)}


def tis_weight(trainer: torch.Tensor, sampled: torch.Tensor, cap: float, mode: str = "token_truncate",
               mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Importance sampling's factor on GC from ρ = π_trainer / π_rollout, bounded by C as `mode` says, and where the
    bound acted: ([B, R], [B, R] bool).

    The rollout engine draws o_t from π_rollout, which differs from the π_trainer the gradient assumes (other
    kernels, another precision, older weights). Weighting each token's term by the ratio corrects that; the bound
    keeps its variance finite at the cost of a bias: token_truncate, min(ρ_t, C) (TIS); token_mask, ρ_t·1[ρ_t ≤ C]
    (MIS, dropping the tokens the trainer finds far likelier than the sampler did); sequence_truncate and
    sequence_mask, the same on the sequence's ratio ρ = Π_t ρ_t over its response tokens (`mask`, [B, R]), on every
    token of it. A constant of the gradient, like the advantage (no gradient flows through it).
    """
    log_ratio = (trainer - sampled).detach()  # [B, R]
    if mode.startswith("sequence"):
        log_ratio = (log_ratio * mask).sum(-1, keepdim=True).expand_as(log_ratio)  # [B, R] log Π_t ρ_t on each token
    ratio = torch.exp(log_ratio)
    over = ratio > cap  # [B, R]
    weight = ratio.clamp(max=cap) if mode.endswith("truncate") else torch.where(over, torch.zeros_like(ratio), ratio)
    return weight, over
