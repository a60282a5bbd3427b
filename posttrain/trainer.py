"""The engine: one training loop for every method.

Each step: the plugin's data source makes a `Batch` (offline rows, or policy samples with rewards); the engine scores
whatever the plugin asked for (reference and old log-probs); the plugin prepares the batch (advantages) and gives a
gradient coefficient per token; the engine turns it into −aggregate(stopgrad(GC) · log πθ), accumulates gradients
over micro-batches and steps the optimizer. Nothing here depends on which method runs.

Distribution goes through accelerate: one process by default, DDP under `accelerate launch`. Losses are divided by
the token and sequence counts of the whole step across processes (and multiplied by the process count, since DDP
averages gradients), so the update does not depend on how the batch is split.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

from posttrain import config as config_mod
from posttrain import data, rewards, sources
from posttrain.aggregation import Totals, aggregate
from posttrain.batch import Batch
from posttrain.config import RunConfig
from posttrain.critic import token_values
from posttrain.errors import UserError
from posttrain.evaluate import evaluate
from posttrain.memory import PhasePeaks, RoleBytes, batch_bytes, optimizer_bytes, tensor_bytes
from posttrain.outputs import RunDir, write_json
from posttrain.progress import Progress
from posttrain.scoring import token_logprobs


def load_model(path: str | Path, dtype: str = "float32", key: str = "model.path"):
    """A causal LM and its tokenizer from a local Hugging Face directory; errors name the config `key`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not (path / "config.json").is_file():
        raise UserError(f"{key}: '{path}' is not a Hugging Face model directory (no config.json)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    except (OSError, ValueError, KeyError) as err:
        raise UserError(f"{key}: cannot load '{path}' ({str(err).splitlines()[0]})") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def load_data(cfg: RunConfig) -> tuple[list[dict], list[dict]]:
    """Training and held-out rows, with the fields the method reads checked on every row."""
    d = cfg.data
    offline = config_mod.algorithm_of(cfg).source == "offline"
    fields = [d.prompt_field, d.response_field if offline else d.answer_field]
    return data.load_splits(d, fields, cfg.eval.num_problems)


class Engine:
    """Holds the models, optimizers and data source of one run; `step` does one step of the method."""

    def __init__(self, cfg: RunConfig, model_path: str | Path, accelerator: Accelerator,
                 splits: tuple[list[dict], list[dict]] | None = None):
        from posttrain.warmup import cache_root

        self.cfg, self.acc, self.model_path = cfg, accelerator, Path(model_path)
        self.cache_dir = cache_root(cfg)
        self.plugin = config_mod.algorithm_of(cfg)
        self.needs = self.plugin.needs(cfg.algorithm)
        self.train_rows, self.test_rows = splits or load_data(cfg)
        self.sampler = data.RowSampler(self.train_rows, cfg.seed, accelerator.process_index,
                                       accelerator.num_processes)
        policy, self.tokenizer = load_model(model_path, cfg.model.dtype)
        self.reward_fn = self.reward_model = None
        if "reward" in self.needs:
            self.reward_fn = rewards.combine(cfg.rewards)
            if cfg.reward_model.path:
                from posttrain.rewards.model import RewardModel

                self.reward_model = RewardModel(cfg.reward_model.path, accelerator.device)
        self.ref = ref_model = None
        if "ref_logp" in self.needs:  # loaded only when the plugin asks for it
            ref_path = cfg.model.ref_path or model_path
            self.ref = load_model(ref_path, cfg.model.dtype, "model.ref_path")[0]
            self.ref.eval().requires_grad_(False).to(accelerator.device)
        ref_model = self.ref
        t = cfg.train
        optimizer = torch.optim.AdamW(policy.parameters(), lr=t.lr, weight_decay=t.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / (t.warmup_steps + 1)))
        self.policy, self.optimizer, self.scheduler = accelerator.prepare(policy, optimizer, scheduler)
        self.model = accelerator.unwrap_model(self.policy)
        self.critic = None
        if "values" in self.needs:  # a critic, its gradients and its AdamW state: loaded only when asked for
            from posttrain.critic import load_critic

            a = cfg.algorithm
            critic = load_critic(a.critic_path or model_path, cfg.model.dtype, self.tokenizer,
                                 "algorithm.critic_path" if a.critic_path else "model.path")
            critic_opt = torch.optim.AdamW(critic.parameters(), lr=a.critic_lr, weight_decay=t.weight_decay)
            self.critic, self.critic_opt = accelerator.prepare(critic, critic_opt)
        # Log-probs are scored at the sampling temperature for sampled data, at 1 for fixed rows.
        self.temperature = cfg.rollout.temperature if self.plugin.source == "online" else 1.0
        self.mode, self.norm = self.plugin.aggregation(cfg.algorithm) or (
            t.loss_agg, t.loss_agg_norm or float(cfg.rollout.max_new_tokens))
        self.micro = max(self.plugin.unit, t.micro_batch_size // self.plugin.unit * self.plugin.unit)
        self.source = sources.SOURCES[self.plugin.source](self)  # may use the reference once, then free it
        self.roles, self.phases = RoleBytes(), PhasePeaks()
        for role, model in (("policy_weights", self.model), ("reference_weights", ref_model),
                            ("critic_weights", self.critic), ("reward_model_weights", getattr(self.reward_model,
                                                                                             "model", None))):
            if model is not None:
                self.roles.observe(role, tensor_bytes(model.parameters()))

    def judge(self, rows: list[dict], completions: list[str]) -> tuple[torch.Tensor, dict[str, float]]:
        """Rewards of completions to `rows` (one row per completion): weighted rule rewards, plus a reward model."""
        answers = [str(r[self.cfg.data.answer_field]) for r in rows]
        total, parts = self.reward_fn(completions, answers)
        if self.reward_model is not None:
            parts["model"] = self.reward_model(data.prompt_texts(rows, self.cfg.data), completions)
            total = [t + self.cfg.reward_model.weight * m for t, m in zip(total, parts["model"])]
        stats = {"reward": sum(total) / len(total), **{f"reward/{k}": sum(v) / len(v) for k, v in parts.items()}}
        return torch.tensor(total), stats

    @torch.no_grad()
    def score(self, model, batch: Batch) -> torch.Tensor:
        """log π of the response tokens under a model not being trained here (reference, or policy as π_old)."""
        parts = [token_logprobs(model, mb.input_ids, mb.attention_mask, mb.prompt_len, temperature=self.temperature)
                 for mb in batch.split(self.micro)]
        return torch.cat(parts)  # [B, R]

    @torch.no_grad()
    def values(self, batch: Batch) -> torch.Tensor:
        """The critic's values of the response positions at sampling time."""
        return torch.cat([token_values(self.critic, mb.input_ids, mb.attention_mask, mb.prompt_len)
                          for mb in batch.split(self.micro)])  # [B, R]

    # -- update -----------------------------------------------------------------------------------------------
    def accumulate(self, batch: Batch, totals: Totals) -> dict[str, torch.Tensor]:
        """Back-propagates the loss of the whole batch, one micro-batch at a time (gradients add up)."""
        cfg, acc = self.cfg, self.acc
        micro = batch.split(self.micro)
        loss_sum, metrics = torch.zeros((), device=acc.device), {}
        for i, mb in enumerate(micro):
            with contextlib.ExitStack() as stack:
                if i < len(micro) - 1:  # gradients are all-reduced once, after the last micro-batch
                    for model in filter(None, (self.policy, self.critic)):
                        stack.enter_context(acc.no_sync(model))
                logp = token_logprobs(self.policy, mb.input_ids, mb.attention_mask, mb.prompt_len,
                                      temperature=self.temperature)  # [b, R]
                gc, m = self.plugin.coefficient(mb, logp.detach(), cfg.algorithm)  # [b, R]
                loss = -aggregate(gc.detach() * logp, mb.mask, self.mode, totals, self.norm)
                acc.backward(loss * acc.num_processes)  # DDP averages; totals already span every process
                if self.critic is not None:
                    values = token_values(self.critic, mb.input_ids, mb.attention_mask, mb.prompt_len)  # [b, R]
                    per_token, cm = self.plugin.critic_loss(mb, values, cfg.algorithm)  # [b, R]
                    critic_loss = aggregate(per_token, mb.mask, "token_mean", totals)
                    acc.backward(critic_loss * acc.num_processes)
                    m = {**m, **cm, "critic_loss": critic_loss * len(micro)}
            loss_sum += loss.detach()
            for k, v in m.items():
                metrics[k] = metrics.get(k, 0) + v.detach() / len(micro)
        metrics["loss"] = loss_sum
        return metrics

    def update(self, batch: Batch, totals: Totals) -> dict[str, torch.Tensor]:
        """One optimizer step (policy, and critic if any) on the gradient of the whole batch."""
        metrics = self.accumulate(batch, totals)
        max_norm = self.cfg.train.max_grad_norm
        if max_norm > 0:
            metrics["grad_norm"] = self.acc.clip_grad_norm_(self.policy.parameters(), max_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.roles.observe("policy_gradients", tensor_bytes(p.grad for p in self.model.parameters()))
        self.roles.observe("policy_optimizer_state", optimizer_bytes(self.optimizer))
        self.optimizer.zero_grad(set_to_none=True)
        if self.critic is not None:
            if max_norm > 0:
                metrics["critic_grad_norm"] = self.acc.clip_grad_norm_(self.critic.parameters(), max_norm)
            self.critic_opt.step()
            self.roles.observe("critic_gradients", tensor_bytes(p.grad for p in self.critic.parameters()))
            self.roles.observe("critic_optimizer_state", optimizer_bytes(self.critic_opt))
            self.critic_opt.zero_grad(set_to_none=True)
        return metrics

    def totals(self, batch: Batch) -> Totals:
        """Sequences and tokens of `batch` summed over every process: the denominators of its loss."""
        local = Totals.of(batch.mask)
        counts = torch.tensor([local.seqs, local.tokens], device=self.acc.device)
        return Totals(*self.acc.reduce(counts, "sum").tolist())

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
        with self.phases.phase("rollout"):  # sampling and rewards for online sources; collation otherwise
            batch, stats = self.source.next()
            batch = batch.to(self.acc.device)
        t0 = time.perf_counter()
        with self.phases.phase("scoring"):
            if self.ref is not None:
                batch.ref_logp = self.score(self.ref, batch)
            if "old_logp" in self.needs:
                batch.old_logp = self.score(self.policy, batch)
            if self.critic is not None:
                batch.extra["values"] = self.values(batch)
        stats["time/score"] = time.perf_counter() - t0
        batch, prep = self.plugin.prepare(batch, self.cfg.algorithm)
        self.roles.observe("rollout_batch", batch_bytes(batch))
        t0 = time.perf_counter()
        metrics = dict(prep)
        with self.phases.phase("update"):
            for _ in range(self.plugin.epochs(self.cfg.algorithm)):
                for minibatch in self.minibatches(batch):
                    metrics.update(self.update(minibatch, self.totals(minibatch)))
        stats["time/update"] = time.perf_counter() - t0
        reduced = {k: float(self.acc.reduce(torch.as_tensor(v, device=self.acc.device).float(), "mean"))
                   for k, v in sorted(metrics.items())}
        elapsed = time.perf_counter() - t_start
        trained = float(batch.mask.sum())
        return {**stats, **reduced, "trained_tokens": trained, "lr": self.scheduler.get_last_lr()[0],
                "tokens_per_s": (trained + stats.get("generated_tokens", 0.0)) / elapsed, "time/step": elapsed}

    def evaluate(self) -> dict:
        e = self.cfg.eval
        return evaluate(self.model, self.tokenizer, self.test_rows[: e.num_problems], self.cfg.data,
                        max_new_tokens=e.max_new_tokens or self.cfg.rollout.max_new_tokens,
                        batch_size=e.batch_size, accelerator=self.acc)


def run(cfg: RunConfig, resolved: dict, *, quiet: bool = False) -> dict:
    """Trains as `cfg` says and writes the run directory. Returns the summary."""
    from posttrain import warmup

    t_start = time.perf_counter()
    run_dir = RunDir(cfg.output_dir, cfg.overwrite)  # refuse a non-empty output_dir before any work
    acc = Accelerator(cpu=not torch.cuda.is_available())
    main = acc.is_main_process
    summary: dict = {"algorithm": config_mod.algorithm_of(cfg).name}
    splits = load_data(cfg)  # bad data fails here, before any warm-up or training
    if cfg.model.path is None:
        model_path, summary["warmup"] = warmup.ensure(cfg, quiet=quiet)
    else:
        model_path = cfg.model.path
    set_seed(cfg.seed)
    engine = Engine(cfg, model_path, acc, splits)
    out = run_dir.create() if main else run_dir.path
    if main:
        import yaml

        (out / "config.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False, allow_unicode=True))
        if not quiet:
            print(f"posttrain: {summary['algorithm']} run writing to {out} (moved to {run_dir.final} when done)",
                  file=sys.stderr)
    acc.wait_for_everyone()
    if cfg.eval.num_problems:
        summary["eval_before"] = engine.evaluate()
    steps = cfg.train.steps
    with open(out / "metrics.jsonl", "w") if main else contextlib.nullcontext() as log, \
            Progress(steps, enabled=main and not quiet) as bar:
        for step in range(1, steps + 1):
            metrics = {"step": step, **engine.step()}
            if cfg.eval.num_problems and cfg.eval.every and (step % cfg.eval.every == 0 or step == steps):
                summary["eval_after"] = engine.evaluate()  # the last one is the final evaluation
                metrics["eval_accuracy"] = summary["eval_after"]["accuracy"]
            metrics["wall_seconds"] = time.perf_counter() - t_start
            if main:
                log.write(json.dumps(metrics) + "\n")
                log.flush()
                bar.update(metrics)
                if cfg.train.save_every and step % cfg.train.save_every == 0:
                    save_model(engine, out / "checkpoints" / f"step_{step}")
            acc.wait_for_everyone()
    if cfg.eval.num_problems and not cfg.eval.every:
        summary["eval_after"] = engine.evaluate()
    if main:
        save_model(engine, out / "model")
        summary.update(steps=steps, wall_seconds=time.perf_counter() - t_start, **engine.phases.run_peak(),
                       memory={"roles_bytes": engine.roles.peak, **engine.phases.summary()},
                       output_dir=str(run_dir.final))
        write_json(out / "summary.json", summary)
        run_dir.commit()
    acc.wait_for_everyone()
    return summary


def save_model(engine: Engine, path: Path) -> None:
    """The policy as an ordinary Hugging Face directory (safetensors + tokenizer)."""
    engine.model.save_pretrained(path, safe_serialization=True)
    engine.tokenizer.save_pretrained(path)

