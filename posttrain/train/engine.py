"""The engine: one training step for every method.

Each step: the plugin's data source makes a `Batch` (offline rows, or policy samples with rewards); the engine scores
whatever the plugin asked for (reference and old log-probs, critic values); the plugin prepares the batch (advantages)
and gives a gradient coefficient per token; the engine turns it into −aggregate(stopgrad(GC) · log πθ), accumulates
gradients over micro-batches, steps the optimizer through the backend, and hands the new weights to the rollout
engine. Nothing here depends on which method runs, how training is distributed, or which engine samples.

Losses are divided by the token and sequence counts of the whole step across processes (`totals`), so the update does
not depend on how the batch is split into micro-batches or over processes.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from pathlib import Path

import torch

from posttrain import judge, rollout
from posttrain.backends import Backend, Trained
from posttrain.config import algorithm_of
from posttrain.core.aggregation import Totals, aggregate
from posttrain.core.batch import Batch
from posttrain.core.errors import TrainingError
from posttrain.core.heap import large_allocations_mapped
from posttrain.core.memory import PhasePeaks, RoleBytes, batch_bytes
from posttrain.core.schedules import adapted_temperature, beta_at, lr_factor
from posttrain.data import RowSampler, uses_chat
from posttrain.data.curriculum import Curriculum
from posttrain.data.difficulty import PassRates
from posttrain.models import lora
from posttrain.models.gated_mlp import lean_gated_mlps
from posttrain.models.loading import load, stop_token_ids
from posttrain.models.scoring import token_logprobs, token_values
from posttrain.schema import RunConfig, cache_root, weights_dtype
from posttrain.sources import SOURCES, Deps
from posttrain.train.evaluation import evaluate


def mean_metrics(updates: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Each metric averaged over the updates that logged it (PPO and GRPO with μ > 1 take several per step)."""
    keys = dict.fromkeys(k for u in updates for k in u)
    return {k: sum(u[k] for u in updates if k in u) / sum(k in u for u in updates) for k in keys}


class Engine:
    """Holds the models, optimizers, rollout engine and data source of one run; `step` does one step of the method.

    Args:
        cfg: the validated config.
        model_path: the starting policy's directory.
        backend: how training is distributed.
        splits: (training rows, held-out rows).
    """

    def __init__(self, cfg: RunConfig, model_path: str | Path, backend: Backend,
                 splits: tuple[list[dict], list[dict]]):
        # its own copy of the algorithm's config, whose β train.beta_schedule sets each step
        cfg = dataclasses.replace(cfg, algorithm=dataclasses.replace(cfg.algorithm))
        self.cfg, self.backend, self.model_path = cfg, backend, Path(model_path)
        self.plugin = algorithm_of(cfg)
        self.needs = self.plugin.needs(cfg.algorithm)
        self.train_rows, self.test_rows = splits
        t, a = cfg.train, cfg.algorithm
        precision = backend.precision  # as it runs: train.precision=auto resolved for the device
        dtype, frozen = weights_dtype(precision, trained=True), weights_dtype(precision, trained=False)
        policy, self.tokenizer = load(model_path, dtype=dtype)
        lean_gated_mlps(policy)  # trained models keep two of each MLP's four activations for backward
        adapters = cfg.model.lora
        if adapters.r:
            policy = lora.apply(policy, adapters, model_path)
        uses_chat(self.tokenizer, cfg.data)  # chat_template=true without a template fails here, before any work
        self.judge = judge.build(cfg, backend.device, with_reward_model="reward" in self.needs, place=backend.freeze,
                                 tokenizer=self.tokenizer, with_process_model="step_reward" in self.needs,
                                 precision=precision)
        # The reference: none, its own frozen model, or (LoRA, no model.ref_path) the policy with its adapter off.
        self.ref, self.ref_is_base = None, False
        if "ref_logp" in self.needs:  # loaded only when the plugin asks for it
            if adapters.r and cfg.model.ref_path is None:
                self.ref_is_base = True
            else:
                self.ref = backend.freeze(load(cfg.model.ref_path or model_path, dtype=frozen,
                                               key="model.ref_path")[0])
        self.parameters = lora.parameter_counts(policy)  # counted whole, before a backend shards them
        updates = t.steps * self.plugin.epochs(a) * self.plugin.minibatches(a)  # optimizer steps of the run
        schedule = functools.partial(lr_factor, schedule=t.lr_schedule, warmup=t.warmup_steps, total=updates,
                                     cycles=t.lr_cycles, floor=t.min_lr / t.lr)
        self.policy = backend.train(policy, lr=t.lr, weight_decay=t.weight_decay, schedule=schedule,
                                    max_grad_norm=t.max_grad_norm)
        self.critic = None
        if "values" in self.needs:  # a critic, its gradients and its AdamW state: loaded only when asked for
            critic, _ = load(a.critic_path or model_path, "critic", dtype=dtype, same_vocab_as=self.tokenizer,
                             key="algorithm.critic_path" if a.critic_path else "model.path")
            lean_gated_mlps(critic)
            if adapters.r:  # its own adapter and value head on its own copy of the base (docs/lora.md says why)
                critic = lora.apply(critic, adapters, a.critic_path or model_path, kind="critic")
            self.critic = backend.train(critic, lr=a.critic_lr, weight_decay=t.weight_decay,
                                        max_grad_norm=t.max_grad_norm)
        sampler = lora.hf_model(backend.generation_model(self.policy))  # adapters in place when adapted
        self.rollout = rollout.get(cfg.rollout.engine).start(rollout.Setup(
            policy=sampler, model_path=self.model_path, pad_id=self.tokenizer.pad_token_id,
            stop_ids=stop_token_ids(sampler, self.tokenizer), sampling=cfg.rollout, precision=precision,
            seed=cfg.seed + backend.rank, max_seqs=max(t.batch_size * self.plugin.samples_per_prompt(a),
                                                       cfg.eval.batch_size),
            agree=backend.agree if backend.sharded else None))
        # What reaches the rollout engine after each update: nothing when it samples from the trained module itself;
        # else every weight, LoRA adapters merged in (cheaper than an adapter for vLLM to load from disk each step).
        self.weight_sync = "none" if self.rollout.colocated else ("merged" if adapters.r else "full")
        source = SOURCES.find(self.plugin.source)
        self.tis_cap = cfg.rollout.tis_cap
        if source.on_policy and self.plugin.epochs(a) * self.plugin.minibatches(a) > 1:
            # The trainer's log-probs under the sampling weights, for the mismatch and truncated IS: after the first
            # optimizer step the update's own forward no longer gives them.
            self.needs = self.needs | {"old_logp"}
        # Samples of the current policy are scored at the sampling temperature; fixed responses at 1.
        self.temperature = cfg.rollout.temperature if source.on_policy else 1.0
        self.mode, self.norm = self.plugin.aggregation(a) or (t.loss_agg, t.loss_agg_norm or
                                                             float(cfg.rollout.max_new_tokens))
        unit = self.plugin.unit
        self.micro = max(unit, t.micro_batch_size // unit * unit)
        d = cfg.data
        with_rates = cfg.rollout.adaptive_group_size or d.curriculum == "pass_rate"
        self.pass_rates = PassRates(d.prompt_field) if with_rates else None  # the online source keeps them
        draws = RowSampler(self.train_rows, cfg.seed, backend.rank, backend.world_size)
        if d.curriculum != "none":
            draws = Curriculum(self.train_rows, cfg.seed, backend.rank, backend.world_size, mode=d.curriculum,
                                 field=d.difficulty_field, start=d.curriculum_start,
                                 ramp_steps=d.curriculum_steps or max(1, t.steps // 2),
                                 pass_rate=self.pass_rates and self.pass_rates.get, floor=d.curriculum_floor)
        with backend.autocast():  # sources that sample a fixed set (RFT) do it here
            self.source = source.from_deps(Deps(
                tokenizer=self.tokenizer, data=cfg.data, batch_size=t.batch_size, sampler=draws,
                micro_batch_size=t.micro_batch_size, seed=cfg.seed, algorithm=a,
                samples_per_prompt=self.plugin.samples_per_prompt(a), rollout=self.rollout, sampling=cfg.rollout,
                judge=self.judge,
                score_reference=(lambda b: self.reference_logp(b.to(backend.device))) if self.has_reference else None,
                model_path=self.model_path, cache_dir=cache_root(cfg), agree=backend.agree,
                rewards=cfg.rewards, needs=frozenset(self.needs), pass_rates=self.pass_rates))
        ref = self.ref
        if self.source.scores_reference:
            self.ref, self.ref_is_base = None, False  # the source holds the reference log-probs it needs
        self.roles, self.phases = RoleBytes(), PhasePeaks()
        self.skipped, self.skipped_steps, self.skipped_in_a_row = False, 0, 0  # non-finite updates skipped
        self.steps_done = 0  # steps of the run so far (a resumed run starts from its checkpoint's)
        self.mismatch = torch.zeros(3, device=backend.device)  # this step's Σ k3, tokens, max |Δ log π|
        self.elite_sums = torch.zeros(2, device=backend.device)  # this step's Σ elite weight, replayed tokens
        rm = getattr(self.judge.reward_model, "model", None)
        for role, model in (("policy_weights", sampler), ("reference_weights", ref),
                            ("critic_weights", self.critic and self.critic.module), ("reward_model_weights", rm)):
            if model is not None:
                self.roles.observe(role, backend.weight_bytes(model))

    def micro_batches(self, batch: Batch) -> list[tuple[torch.Tensor, Batch]]:
        """The batch in micro-batches of whole units, longest rows first so that rows of similar length go together,
        each trimmed of the columns that are padding in all its rows; with the rows of `batch` each one holds.

        The loss is normalised by the whole step's counts, so neither the order nor the split changes the update.
        """
        unit = self.plugin.unit
        length = batch.lengths().view(-1, unit).max(-1).values  # [B / unit] longest row of each unit
        order = torch.argsort(length, descending=True, stable=True)  # [B / unit]
        rows = (order[:, None] * unit + torch.arange(unit, device=order.device)).flatten()  # [B]
        return [(idx, batch.select(idx).trimmed()) for idx in rows.split(self.micro)]

    def _per_token(self, batch: Batch, fn) -> torch.Tensor:
        """`fn(micro-batch)` -> [b, R'] for every micro-batch, put back into the rows and columns of `batch`."""
        out = torch.zeros(batch.mask.shape, device=batch.mask.device)  # [B, R]
        for rows, mb in self.micro_batches(batch):
            part = fn(mb)  # [b, R']
            out[rows, : part.shape[1]] = part
        return out

    @torch.no_grad()
    def score(self, model, batch: Batch) -> torch.Tensor:
        """log π of the response tokens under a model not being trained here (reference, or policy as π_old)."""
        with self.backend.autocast():
                return self._per_token(batch, lambda mb: token_logprobs(
                model, mb.input_ids, mb.attention_mask, mb.prompt_len, temperature=self.temperature))  # [B, R]

    @property
    def has_reference(self) -> bool:
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
                                                                  mb.prompt_len))  # [B, R]

    def observe_mismatch(self, trainer: torch.Tensor, sampled: torch.Tensor, mask: torch.Tensor) -> None:
        """Adds tokens to this step's train-inference mismatch: `self.mismatch` = [Σ k3, tokens, max |Δ log π|]."""
        s = mismatch_sums(trainer, sampled, mask)
        self.mismatch[:2] += s[:2]
        self.mismatch[2] = torch.maximum(self.mismatch[2], s[2])

    # -- update -----------------------------------------------------------------------------------------------
    def accumulate(self, batch: Batch, totals: Totals) -> dict[str, torch.Tensor]:
        """Back-propagates the loss of the whole batch, one micro-batch at a time (gradients add up)."""
        cfg, backend = self.cfg, self.backend
        micro = [mb for _, mb in self.micro_batches(batch)]
        trained = [t for t in (self.policy, self.critic) if t is not None]
        loss_sum, metrics = torch.zeros((), device=backend.device), {}
        for i, mb in enumerate(micro):
            with backend.accumulating(trained, sync=i == len(micro) - 1):  # all-reduced once, after the last
                with backend.autocast():
                    logp = token_logprobs(self.policy.module, mb.input_ids, mb.attention_mask, mb.prompt_len,
                                          temperature=self.temperature)  # [b, R] float32
                gc, m = self.coefficient(mb, logp.detach())  # [b, R]
                loss = -aggregate(gc.detach() * logp, mb.mask, self.mode, totals, self.norm)
                backend.backward(loss, self.policy)
                if self.critic is not None:
                    with backend.autocast():
                        values = token_values(self.critic.module, mb.input_ids, mb.attention_mask, mb.prompt_len)
                    per_token, cm = self.plugin.critic_loss(mb, values, cfg.algorithm)  # [b, R]
                    critic_loss = aggregate(per_token, mb.mask, "token_mean", totals)
                    backend.backward(critic_loss, self.critic)
                    m = {**m, **cm, "critic_loss": critic_loss * len(micro)}
            loss_sum += loss.detach()
            for k, v in m.items():
                metrics[k] = metrics.get(k, 0) + v.detach() / len(micro)
        metrics["loss"] = loss_sum
        return metrics

    def coefficient(self, mb: Batch, logp: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """GC of each token of a micro-batch ([b, R]) and the plugin's metrics: the plugin's GC, times the truncated
        importance weight when `rollout.tis_cap` is set and the rollout engine reported its log-probs; on rows replayed
        from an elite pool (sources/elite.py), times V-trace's min(π_old / μ, rollout.elite_is_cap) instead."""
        gc, m = self.plugin.coefficient(mb, logp, self.cfg.algorithm)  # [b, R]
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
            weight = tis_weight(at_sampling, mb.rollout_logp, self.tis_cap)  # [b, R]
            capped = ((weight == self.tis_cap).float() * fresh).sum() / fresh.sum().clamp(min=1)
            m = {**m, "mismatch/tis_capped": capped}
        if replayed is not None:  # the same truncated ratio, of π_old to μ (the replayed rows' rollout_logp)
            elite = tis_weight(at_sampling, mb.rollout_logp, self.cfg.rollout.elite_is_cap)  # [b, R]
            weight = torch.where(replayed[:, None] > 0, elite, weight)  # [b, R]
            on = mb.mask * replayed[:, None]  # [b, R] replayed tokens
            self.elite_sums += torch.stack([(elite * on).sum(), on.sum()]).detach()  # the step's, for elite/is_weight
        return gc * weight, m

    def update(self, batch: Batch, totals: Totals) -> dict[str, torch.Tensor]:
        """One optimizer step (policy, and critic if any) on the gradient of the whole batch.

        A non-finite loss (on any process) or gradient norm skips the step: the gradients are dropped, the weights,
        AdamW state and schedule stay as they were, and `self.skipped` says so."""
        metrics = self.accumulate(batch, totals)
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
        n = self.plugin.minibatches(self.cfg.algorithm)
        if n == 1:
            return [batch]
        unit = self.plugin.unit
        order = torch.randperm(len(batch) // unit, device=batch.input_ids.device)  # [units]
        rows = (order[:, None] * unit + torch.arange(unit, device=order.device)).flatten()  # [B]
        size = -(-len(batch) // unit // n) * unit
        return [batch.select(rows[i : i + size]) for i in range(0, len(batch), size)]

    def step(self) -> dict[str, float]:
        t_start = time.perf_counter()
        phases = self.phases
        self.steps_done += 1
        t, scheduled = self.cfg.train, self.cfg.train.beta_schedule != "constant"
        if scheduled:
            self.cfg.algorithm.beta = beta_at(self.steps_done, schedule=t.beta_schedule, values=t.beta_values,
                                              total=t.steps, beta=self.cfg.algorithm.beta)
        self.source.sampler.at(self.steps_done - 1)  # a curriculum's progress: the steps done before this one
        if self.source.on_policy:  # scored at the temperature the batch is sampled at
            self.temperature = self.source.temperature
        with phases.phase("rollout"), self.backend.autocast():  # sampling and rewards; collation if offline
            batch, stats = self.source.next()
            batch = batch.to(self.backend.device)
        if self.cfg.rollout.adaptive_temperature:
            stats.update(self.adapt_temperature(batch))
        with phases.phase("scoring"):
            if self.has_reference:
                batch.ref_logp = self.reference_logp(batch)
            if "old_logp" in self.needs:
                batch.old_logp = self.score(self.policy.module, batch)
            if self.critic is not None:
                batch.extra["values"] = self.values(batch)
        self.mismatch = torch.zeros(3, device=self.backend.device)
        self.elite_sums = torch.zeros(2, device=self.backend.device)  # Σ weight, Σ tokens over replayed tokens
        if batch.rollout_logp is not None and batch.old_logp is not None:
            self.observe_mismatch(batch.old_logp, batch.rollout_logp, fresh_mask(batch))
        batch, prep = self.plugin.prepare(batch, self.cfg.algorithm)
        self.roles.observe("rollout_batch", batch_bytes(batch))
        updates = []
        self.rollout.release()
        skipped, lr = 0, self.policy.scheduler.get_last_lr()[0]  # the rate of this step's first update
        with phases.phase("update"), large_allocations_mapped():
            for _ in range(self.plugin.epochs(self.cfg.algorithm)):
                for minibatch in self.minibatches(batch):
                    updates.append(self.update(minibatch, self.totals(minibatch)))
                    skipped += self.skipped
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped else 0
        self.skipped_steps += bool(skipped)
        stats.update(skipped_updates=float(skipped), skipped_steps=float(self.skipped_steps))
        t0 = time.perf_counter()
        self.rollout.restore()
        self.sync_rollout()
        stats.update({"time/score": phases.seconds["scoring"], "time/update": phases.seconds["update"],
                      "time/weight_sync": time.perf_counter() - t0})
        metrics = {**prep, **mean_metrics(updates)}
        reduced = {k: float(self.backend.reduce(torch.as_tensor(v, device=self.backend.device).float(), "mean"))
                   for k, v in sorted(metrics.items())}
        if self.cfg.rollout.elite_pool:  # the mean over every replayed token of the step, on every process
            weights, tokens = self.backend.reduce(self.elite_sums, "sum").tolist()
            reduced["elite/is_weight"] = weights / max(tokens, 1.0)
        if batch.rollout_logp is not None:
            kl, tokens = self.backend.reduce(self.mismatch[:2], "sum").tolist()
            reduced["mismatch/kl"] = kl / max(tokens, 1.0)
            reduced["mismatch/max"] = float(self.backend.reduce(self.mismatch[2], "max"))
        elapsed = time.perf_counter() - t_start
        trained = float(batch.mask.sum())
        return {**stats, **reduced, "trained_tokens": trained, "lr": lr,
                **({"beta": self.cfg.algorithm.beta} if scheduled else {}),
                "tokens_per_s": (trained + stats.get("generated_tokens", 0.0)) / elapsed, "time/step": elapsed}

    def adapt_temperature(self, batch: Batch) -> dict[str, float]:
        """Sets the next step's sampling temperature from this batch's entropy (`adapted_temperature`), the same on
        every process; returns this step's temperature and entropy for the metrics."""
        r, fresh = self.cfg.rollout, fresh_mask(batch)  # an elite's log-probs are an older policy's
        sums = torch.stack([-(batch.rollout_logp * fresh).sum(), fresh.sum()]).float()
        nats, tokens = self.backend.reduce(sums.to(self.backend.device), "sum").tolist()
        entropy = nats / max(tokens, 1.0)  # per sampled token, over every process
        source = self.source
        if source.target_entropy is None:  # no target given: the first step's entropy
            source.target_entropy = entropy
        source.temperature = adapted_temperature(self.temperature, entropy, source.target_entropy, r.min_temperature,
                                                 r.max_temperature)
        return {"temperature": self.temperature, "entropy": entropy}

    def sync_rollout(self) -> None:
        """Gives a rollout engine that holds its own copy of the weights (vLLM) the policy's current ones."""
        if not self.rollout.colocated:
            self.rollout.load_weights(self.backend.weights(self.policy))

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
                            temperature=self.cfg.rollout.temperature, top_p=self.cfg.rollout.top_p)


def mismatch_sums(trainer: torch.Tensor, sampled: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[Σ k3, Σ tokens, max |Δ|] over the response tokens, where Δ = log π_trainer − log π_rollout of each sampled
    token and k3 = e^Δ − 1 − Δ ≥ 0, whose mean estimates KL(π_rollout ‖ π_trainer) from the rollout's own samples."""
    d = (trainer - sampled) * mask  # [B, R]
    k3 = (d.exp() - 1 - d) * mask  # [B, R]
    return torch.stack([k3.sum(), mask.sum(), d.abs().max() if d.numel() else d.new_zeros(())])


def fresh_mask(batch: Batch) -> torch.Tensor:
    """[B, R] `mask` less the rows replayed from an elite pool (`extra["replayed"]`, sources/elite.py): the tokens
    this step's rollout engine drew, whose `rollout_logp` measures the train-inference mismatch."""
    replayed = batch.extra.get("replayed")  # [B] or None
    return batch.mask if replayed is None else batch.mask * (1 - replayed)[:, None].to(batch.mask.dtype)


def tis_weight(trainer: torch.Tensor, sampled: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance sampling's per-token factor on GC, min(π_trainer / π_rollout, C): [B, R] -> [B, R].

    The rollout engine draws o_t from π_rollout, which differs from the π_trainer the gradient assumes (other
    kernels, another precision). Weighting each token's term by the capped ratio corrects that, with variance bounded
    by C. A constant of the gradient, like the advantage (no gradient flows through it).
    """
    return torch.exp(trainer - sampled).clamp(max=cap).detach()
