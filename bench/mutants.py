"""Fault injection (mutation testing) for the code that the invariant tests guard.

    python bench/mutants.py                 # every mutant; about 7 minutes on 2 CPU cores
    python bench/mutants.py --list          # the mutant list, nothing run
    python bench/mutants.py grpo-pop-std    # only the named mutants (ids, or prefixes ending in '*': 'dpo-*')
    python bench/mutants.py --markdown out.md

Run it from the repository root with the project's environment active, in a clean work tree. Each mutant is one
textual edit of one guarded file: `old` must occur exactly once in the file and is replaced by `new`. The file is
restored from memory afterwards, even on Ctrl-C. The mutant is run against the fast unit tests, its own module's test
file first, stopping at the first failure (`pytest -x`); aggregation mutants also run the engine's micro-batch
invariance test. A mutant is killed when pytest exits non-zero. A mutant marked `equivalent` carries the reason it
cannot change observable behaviour; it is expected to survive.

Exit status: 0 when every mutant not marked equivalent is killed and every one marked equivalent survives, else 1.
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FAST = ["tests/test_algorithms.py", "tests/test_grpo.py", "tests/test_ppo.py", "tests/test_dpo.py", "tests/test_online_dpo.py", "tests/test_rft.py", "tests/test_sft.py",
        "tests/test_gspo.py", "tests/test_cispo.py", "tests/test_sapo.py", "tests/test_rloo.py", "tests/test_reinforce_pp.py", "tests/test_aggregation.py",
        "tests/test_scoring.py", "tests/test_objective.py"]
ENGINE = "tests/test_engine.py::test_gradient_invariant_to_micro_batches"
DIST = "tests/test_distributed.py"
# Each guarded file's own tests first, so the test named as the killer is the nearest one.
FIRST = {"algorithms/base.py": ["tests/test_algorithms.py"], "posttrain/core/registry.py": ["tests/test_algorithms.py"],
         "algorithms/sft.py": ["tests/test_sft.py"], "algorithms/rft.py": ["tests/test_rft.py"],
         "algorithms/online_rft.py": ["tests/test_rft.py"], "algorithms/dpo.py": ["tests/test_dpo.py"],
         "algorithms/ppo.py": ["tests/test_ppo.py", "tests/test_grpo.py"], "algorithms/grpo.py": ["tests/test_grpo.py"],
         "algorithms/common.py": ["tests/test_grpo.py", "tests/test_ppo.py", "tests/test_rft.py",
                                  "tests/test_environments.py::test_gae_steps_over_the_environment_tokens"],
         "algorithms/gspo.py": ["tests/test_gspo.py"], "algorithms/cispo.py": ["tests/test_cispo.py"],
         "algorithms/sapo.py": ["tests/test_sapo.py"], "algorithms/online_dpo.py": ["tests/test_online_dpo.py"],
         "algorithms/distill.py": ["tests/test_distill.py"], "algorithms/rloo.py": ["tests/test_rloo.py"],
         "algorithms/reinforce_pp.py": ["tests/test_reinforce_pp.py"],
         "posttrain/core/aggregation.py": ["tests/test_aggregation.py"],
         "posttrain/models/scoring.py": ["tests/test_scoring.py", "tests/test_packing.py"], "posttrain/rollout/hf.py": ["tests/test_rollout.py"],
         "posttrain/core/batch.py": ["tests/test_data.py", "tests/test_engine.py"],
         "posttrain/train/engine.py": ["tests/test_grpo.py", "tests/test_lora.py", "tests/test_packing.py",
                                       "tests/test_distill.py::test_the_engine_scores_the_teacher_at_the_sampling_temperature",
                                       "tests/test_primitives.py::test_a_custom_per_token_loss_gets_autograds_gradient_"
                                       "through_micro_batches"],
         "posttrain/core/micro.py": ["tests/test_packing.py"],
         "posttrain/models/gated_mlp.py": ["tests/test_gated_mlp.py"], "posttrain/models/lora.py": ["tests/test_lora.py"],
         "posttrain/backends/fsdp.py": [f"{DIST}::test_two_rank_update_equals_one_process_on_the_same_global_batch"],
         "posttrain/backends/zero.py": [f"{DIST}::test_two_rank_update_equals_one_process_on_the_same_global_batch"],
         "posttrain/backends/base.py": ["tests/test_precision.py"],
         "posttrain/backends/loss_scale.py": ["tests/test_precision.py"],
         "posttrain/core/precision.py": ["tests/test_precision.py"],
         "posttrain/core/threads.py": ["tests/test_threads.py"],
         "posttrain/stages/__init__.py": ["tests/test_online.py", "tests/test_stage_pass_rates.py"],
         "posttrain/train/plan.py": ["tests/test_plan.py", "tests/test_explain.py", "tests/test_async.py"],
         "posttrain/rollout/workers/process.py": ["tests/test_async.py::test_a_workers_reference_scoring_puts_each_micro_batch_back_in_its_rows",
                                                  "tests/test_async.py::test_a_push_that_fails_or_hangs_half_way_never_reaches_the_engine"],
         "posttrain/rollout/workers/pool.py": ["tests/test_async.py::test_staleness_0_is_the_colocated_run_byte_for_byte"],
         "posttrain/rollout/workers/actors.py": ["tests/test_ray.py"], "posttrain/train/build.py": ["tests/test_ray.py"],
         "posttrain/judge.py": ["tests/test_api.py::test_reward_functions_are_called_as_trl_calls_them"],
         "posttrain/data/rows.py": ["tests/test_api.py::test_rows_from_python_train_as_the_same_rows_in_a_file"],
         "posttrain/models/gguf.py": ["tests/test_gguf.py"],
         "posttrain/core/launch.py": ["tests/test_api.py::test_a_script_without_a_main_guard_runs_and_leaving_the_run_stops_"
                                     "its_workers"],
         "posttrain/train/controllers.py": ["tests/test_schedules.py", "tests/test_early_stop.py",
                                            "tests/test_adaptive.py::test_adaptive_sampling_runs_and_resumes_exactly",
                                            "tests/test_resume.py::test_killed_twice_and_resumed_equals_uninterrupted"]}


@dataclass(frozen=True)
class Mutant:
    id: str
    path: str
    func: str
    what: str
    old: str
    new: str
    equivalent: str | None = None  # why the mutant cannot change observable behaviour


def m(id, path, func, what, old, new, equivalent=None):
    return Mutant(id, path, func, what, old, new, equivalent)


A, SFT, RFT, ORFT, DPO, PPO, GRPO = ("algorithms/base.py", "algorithms/sft.py", "algorithms/rft.py",
                                     "algorithms/online_rft.py", "algorithms/dpo.py", "algorithms/ppo.py",
                                     "algorithms/grpo.py")
GSPO, RLOO, RPP = "algorithms/gspo.py", "algorithms/rloo.py", "algorithms/reinforce_pp.py"
CISPO, SAPO, ODPO = "algorithms/cispo.py", "algorithms/sapo.py", "algorithms/online_dpo.py"
DISTILL = "algorithms/distill.py"
COMMON = "algorithms/common.py"  # helpers several methods share (group statistics, GAE, the clip, k3, RFT's indicator)
AGG, SCORE = "posttrain/core/aggregation.py", "posttrain/models/scoring.py"
HF, BATCH = "posttrain/rollout/hf.py", "posttrain/core/batch.py"
TRAIN = "posttrain/train/engine.py"
MICRO = "posttrain/core/micro.py"  # how every pass, the trainer's and the workers', cuts a batch
REG = "posttrain/core/registry.py"  # the registry behind algorithms/base.py's `register` and `get`
GMLP, LORA = "posttrain/models/gated_mlp.py", "posttrain/models/lora.py"
FSDP, ZERO = "posttrain/backends/fsdp.py", "posttrain/backends/zero.py"
BASE, SCALE = "posttrain/backends/base.py", "posttrain/backends/loss_scale.py"
PREC, THREADS = "posttrain/core/precision.py", "posttrain/core/threads.py"
STAGES, CONTROL = "posttrain/stages/__init__.py", "posttrain/train/controllers.py"
PLAN = "posttrain/train/plan.py"  # the run's decisions, made once
JUDGE, ROWS, GGUF = "posttrain/judge.py", "posttrain/data/rows.py", "posttrain/models/gguf.py"
LAUNCH = "posttrain/core/launch.py"
STAGE_LIST = ("[PassRateUpdates, OverlongPenalty, DynamicSampling, EliteReplay, StepRewards,\n"
              "                             AdaptiveTemperature]")
CONTROLLERS = ("draws", "pass_rates", "temperature", "elite", "beta", "early_stop")


STAGE_NAMES = ("PassRateUpdates", "OverlongPenalty", "DynamicSampling", "EliteReplay", "StepRewards",
               "AdaptiveTemperature")


def stage_left_out(name: str) -> Mutant:
    left = "[" + ", ".join(n for n in STAGE_NAMES if n != name) + "]"
    return m(f"stage-left-out-{name}", STAGES, "STAGES", f"the {name} stage is never built", STAGE_LIST, left)


def controller_not_restored(name: str) -> Mutant:
    # β under a schedule is a function of the step alone: `Controllers.at` sets it before the step reads it, so the
    # value a checkpoint restores is overwritten unread.
    equivalent = "β is recomputed from the step before it is read" if name == "beta" else None
    return m(f"controller-not-restored-{name}", CONTROL, "Controllers.load_state_dict",
             f"a resumed run starts its {name} controller afresh", "            c.load_state_dict(state[name])",
             f"            if name != {name!r}:\n                c.load_state_dict(state[name])", equivalent)

MUTANTS = [
    # posttrain/train/plan.py: a decision of the plan flipped; build, the engine and explain all follow it
    m("plan-proximal-flipped", PLAN, "correction", "stale samples of a clipped-ratio method get the truncated weight "
      "(proximal=trainer) and the others the sampler's π_old",
      'proximal = "sampler" if r.stale and plugin.clips_ratio and not chosen else "trainer"',
      'proximal = "trainer" if r.stale and plugin.clips_ratio and not chosen else "sampler"'),
    m("plan-reference-on-trainer", PLAN, "_roles", "rollout.reference_on=workers keeps the reference on the trainer",
      'out.append(Role("reference", "workers", origin, False))', 'out.append(Role("reference", "trainer", origin, False))'),
    m("plan-stage-dropped", PLAN, "_stages", "dynamic sampling is never switched on",
      "return tuple(s.key for s in STAGES if s.on(cfg, needs))",
      'return tuple(s.key for s in STAGES if s.on(cfg, needs) and s.key != "rollout.dynamic_sampling")'),
    m("plan-weight-sync-full", PLAN, "_rollout", "LoRA workers are sent every weight instead of the adapter",
      'weight_sync = "none" if colocated else "adapter" if takes_adapter else "merged" if lora else "full"',
      'weight_sync = "none" if colocated else "merged" if lora else "full"'),
    m("worker-scoring-ignores-budget", "posttrain/rollout/workers/process.py", "reference_logprobs",
      "the workers' reference scoring ignores train.micro_batch_tokens",
      "micro.split(batch.lengths(), 1, rows, tokens, packed)", "micro.split(batch.lengths(), 1, rows, None, packed)"),
    m("worker-scoring-ignores-packing", "posttrain/rollout/workers/process.py", "reference_logprobs",
      "the workers' reference scoring never packs", "packed = packing and packs(model)", "packed = False"),
    # a weight push's watchdog (a NCCL broadcast cannot time out by itself): left out on the trainer's side, a hung
    # push waits for gloo's own time-out (twice the bound); on the worker's, half a push counts as a version
    m("push-without-watchdog", "posttrain/rollout/workers/pool.py", "WorkerPool._push_to",
      "the trainer waits for a push's collectives in its own thread, unbounded",
      'bounded(send, self.spec.timeout_s, f"pushing weights version {version}")', "send()"),
    m("staging-keeps-half-push", "posttrain/rollout/workers/process.py", "Staging.receive",
      "a version that arrives half way still counts as the last complete one",
      "            self.staged = self.applied  # a complete version", "            pass  # a complete version"),
    # rollout.launcher=ray (tests/test_ray.py, a simulated cluster of three nodes): the launcher silently local, the
    # tests' faults never reaching the actors, a hung actor left alive (the trainer waits out its start-up bound)
    m("ray-launcher-ignored", "posttrain/train/build.py", "start_workers", "rollout.launcher=ray starts local workers",
      'if p.launcher == "ray":', 'if False:'),
    m("ray-fault-not-carried", "posttrain/rollout/workers/actors.py", "RolloutActor.__init__",
      "an actor never sees the fault the tests inject", "        if fault:  # the tests'", "        if False:  # the tests'"),
    m("ray-hung-actor-not-killed", "posttrain/rollout/workers/actors.py", "RayWorker.kill",
      "a worker that timed out is not killed: its restart waits for a process that never comes",
      "        if self.dead is None:\n            ray.kill(self.actor, no_restart=False)",
      "        if False:\n            ray.kill(self.actor, no_restart=False)"),
    # algorithms/base.py: the plugin base; posttrain/core/registry.py: the registry behind `register` and `get`
    m("base-needs", A, "Algorithm.needs", "default needs asks for a reward",
      "        return frozenset()\n", '        return frozenset({"reward"})\n'),
    m("base-samples", A, "Algorithm.samples_per_prompt", "default 1 -> 2 samples per prompt",
      '"""Completions sampled per prompt by an online source."""\n        return 1',
      '"""Completions sampled per prompt by an online source."""\n        return 2'),
    m("base-epochs", A, "Algorithm.epochs", "default 1 -> 2 epochs",
      '"""Optimizer steps taken on each batch (μ in the paper)."""\n        return 1',
      '"""Optimizer steps taken on each batch (μ in the paper)."""\n        return 2'),
    m("base-minibatches", A, "Algorithm.minibatches", "default 1 -> 2 minibatches",
      'this many minibatches."""\n        return 1', 'this many minibatches."""\n        return 2'),
    m("base-aggregation", A, "Algorithm.aggregation", "default fixes token_mean instead of deferring to train.loss_agg",
      'None uses `train.loss_agg`."""\n        return None', 'None uses `train.loss_agg`."""\n        return ("token_mean", 1.0)'),
    m("base-register-dup", REG, "Registry.register", "a second plugin under a taken name replaces the first",
      "            if name in self:\n                raise", "            if False:\n                raise"),
    m("base-get-unknown", REG, "Registry.find", "an unknown name gives None instead of a ConfigError",
      "        if name not in self:\n            near", "        if name not in self:\n            return None\n            near"),
    # algorithms/sft.py
    m("sft-gc-zero", SFT, "SFT.coefficient", "GC = 0 instead of 1", "torch.ones_like(logp)", "torch.zeros_like(logp)"),
    m("sft-gc-half", SFT, "SFT.coefficient", "GC = 0.5 instead of 1", "torch.ones_like(logp)", "0.5 * torch.ones_like(logp)"),
    # algorithms/rft.py and online_rft.py (their indicator_coefficient in algorithms/common.py)
    m("rft-threshold-gt", COMMON, "indicator_coefficient", "reward >= threshold -> reward > threshold",
      "batch.reward >= threshold", "batch.reward > threshold"),
    m("rft-threshold-flip", COMMON, "indicator_coefficient", "reward >= threshold -> reward <= threshold",
      "batch.reward >= threshold", "batch.reward <= threshold"),
    m("rft-threshold-half", RFT, "RFT.coefficient", "RFT's threshold 1.0 -> 0.5",
      "indicator_coefficient(batch, logp, 1.0)", "indicator_coefficient(batch, logp, 0.5)",
      equivalent="RFT's source keeps only correct samples and sets reward = 1 on every row "
                 "(posttrain/sources/samples.py), so any threshold in (0, 1] gives GC = 1"),
    m("rft-gc-reward", COMMON, "indicator_coefficient", "GC = the reward itself instead of I(reward >= threshold)",
      "correct = (batch.reward >= threshold).to(logp.dtype)", "correct = batch.reward.to(logp.dtype)"),
    m("orft-threshold-ignored", ORFT, "OnlineRFT.coefficient", "threshold fixed at 1.0 instead of cfg.threshold",
      "indicator_coefficient(batch, logp, cfg.threshold)", "indicator_coefficient(batch, logp, 1.0)"),
    m("orft-correct-frac-col1", ORFT, "OnlineRFT.coefficient", "correct_frac read from column 1",
      '"correct_frac": gc[:, 0].mean()', '"correct_frac": gc[:, 1].mean()'),
    m("orft-correct-frac-all", ORFT, "OnlineRFT.coefficient", "correct_frac as the mean over all [B, R] entries",
      '"correct_frac": gc[:, 0].mean()', '"correct_frac": gc.mean()',
      equivalent="GC is I(o) broadcast along each row, so the mean over all entries equals the mean of column 0"),
    # algorithms/dpo.py
    m("dpo-no-factor-2", DPO, "DPO.coefficient", "the factor 2 dropped from GC", "gc = (2 * cfg.beta", "gc = (cfg.beta"),
    m("dpo-no-beta", DPO, "DPO.coefficient", "β dropped from GC (2w instead of 2βw)", "gc = (2 * cfg.beta * w",
      "gc = (2 * w"),
    m("dpo-sign-swap", DPO, "DPO.coefficient", "sign [+1, −1] -> [−1, +1]", "torch.tensor([1.0, -1.0]",
      "torch.tensor([-1.0, 1.0]"),
    m("dpo-margin-swap", DPO, "margin", "z = β(ℓ⁻ − ℓ⁺)", "return cfg.beta * (chosen - rejected)",
      "return cfg.beta * (rejected - chosen)"),
    m("dpo-sigmoid-z", DPO, "DPO.coefficient", "w = σ(z) instead of σ(−z)",
      "w = (1 - eps) * torch.sigmoid(-z)", "w = (1 - eps) * torch.sigmoid(z)"),
    m("dpo-smoothing-sign", DPO, "DPO.coefficient", "cDPO term − ε σ(z) -> + ε σ(z)", "- eps * torch.sigmoid(z)",
      "+ eps * torch.sigmoid(z)"),
    m("dpo-logratio-no-mask", DPO, "DPO.coefficient", "padding tokens summed into ℓ (`* mask` dropped)",
      "logratio = ((logp - batch.ref_logp) * batch.mask).sum(-1)", "logratio = (logp - batch.ref_logp).sum(-1)"),
    m("dpo-logratio-no-ref", DPO, "DPO.coefficient", "ℓ from log πθ alone (reference dropped)",
      "logratio = ((logp - batch.ref_logp) * batch.mask).sum(-1)", "logratio = (logp * batch.mask).sum(-1)"),
    m("dpo-norm-by-R", DPO, "DPO.coefficient", "Eq. 12 divides by the padded width R, not |o|",
      "logratio = logratio / length", "logratio = logratio / R"),
    m("dpo-norm-flag", DPO, "DPO.coefficient", "length_normalize inverted", "if cfg.length_normalize:",
      "if not cfg.length_normalize:"),
    m("dpo-pair-layout", DPO, "DPO.coefficient", "pairs read as [all chosen, all rejected] instead of interleaved",
      "logratio.view(B // 2, 2).unbind(-1)", "logratio.view(2, B // 2).unbind(0)"),
    m("dpo-gc-no-mask", DPO, "DPO.coefficient", "GC not masked on padding", ".reshape(B, 1) * batch.mask",
      ".reshape(B, 1).expand(B, R)"),
    m("dpo-agg-swap", DPO, "DPO.aggregation", "sum and mean aggregations swapped",
      '("seq_mean_token_mean", 1.0) if cfg.length_normalize else ("seq_mean_token_sum_norm", 1.0)',
      '("seq_mean_token_sum_norm", 1.0) if cfg.length_normalize else ("seq_mean_token_mean", 1.0)'),
    m("dpo-loss-metric", DPO, "pair_loss", "dpo_loss metric (and objective) with σ(−z) and σ(z) swapped",
      "return -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)",
      "return -(1 - eps) * F.logsigmoid(-z) - eps * F.logsigmoid(z)"),
    m("dpo-accuracy-ge", DPO, "DPO.coefficient", "pair_accuracy counts z = 0 as correct", "(z > 0).to(", "(z >= 0).to(",
),
    # algorithms/common.py: group_stats, group_median, group_advantages, k3_coefficient; algorithms/grpo.py
    m("grpo-pop-std", COMMON, "group_stats", "population std instead of unbiased", "/ (size - 1).clamp(min=1)",
      "/ size"),
    m("grpo-std-no-clamp", COMMON, "group_stats", "no clamp on size − 1 (a group of one divides by 0)",
      "/ (size - 1).clamp(min=1)", "/ (size - 1)"),
    m("grpo-mean-denominator", COMMON, "group_stats", "group mean divided by size − 1", "reward) / size  #",
      "reward) / (size - 1)  #"),
    m("grpo-std-no-sqrt", COMMON, "group_stats", "variance used as the std", "var.sqrt()[idx]", "var[idx]"),
    m("grpo-stats-global", COMMON, "group_stats", "mean over the whole batch instead of the group",
      "return mean[idx], var.sqrt()[idx]", "return reward.mean().expand_as(reward), var.sqrt()[idx]"),
    m("grpo-no-eps", COMMON, "group_advantages", "eps dropped from the std", "/ (std + eps) if norm",
      "/ std if norm"),
    m("grpo-scale-flag", COMMON, "group_advantages", "adv_norm mean_std and none swapped", 'if norm == "mean_std" else',
      'if norm != "mean_std" else'),
    m("grpo-median-upper", COMMON, "group_median", "even group's median is the upper middle value, not the mean of two",
      "(size - 1) // 2] + ranked", "size // 2] + ranked"),
    m("grpo-median-unsorted", COMMON, "group_median", "values not sorted within each group",
      "order = by_value[torch.argsort(idx[by_value], stable=True)]", "order = torch.argsort(idx, stable=True)"),
    m("grpo-mad-no-const", COMMON, "group_advantages", "MAD not scaled by 1.4826",
      "scale = MAD_TO_STD * group_median(dev, group)", "scale = group_median(dev, group)"),
    m("grpo-mad-no-fallback", COMMON, "group_advantages", "MAD = 0 divides by eps (no mean-deviation scale)",
      "scale = torch.where(scale > 0, scale, MEAN_AD_TO_STD * group_stats(dev, group)[0])", "scale = scale"),
    m("grpo-mad-centre-mean", COMMON, "group_advantages", "median_mad centred on the mean",
      "return (reward - median) / (scale + eps)", "return (reward - group_stats(reward, group)[0]) / (scale + eps)"),
    m("grpo-no-centre", COMMON, "group_advantages", "mean not subtracted when scaling",
      "(reward - mean) / (std + eps)", "reward / (std + eps)"),
    m("grpo-truncated-flip", GRPO, "GRPO.prepare", "mask_truncated keeps only the truncated completions",
      "(~batch.truncated)", "(batch.truncated)"),
    m("grpo-zero-std-metric", GRPO, "GRPO.prepare", "zero_std_frac counts groups with spread", "(std == 0)",
      "(std > 0)"),
    m("grpo-ignore-old", GRPO, "GRPO.coefficient", "ratio against logp itself even when old_logp is stored",
      "old_logp = batch.old_logp if batch.old_logp is not None else logp", "old_logp = logp"),
    m("grpo-kl-inverted", COMMON, "k3_coefficient", "KL coefficient with πθ/π_ref instead of π_ref/πθ",
      "ref_ratio = torch.exp(batch.ref_logp - logp)", "ref_ratio = torch.exp(logp - batch.ref_logp)"),
    m("grpo-kl-sign", COMMON, "k3_coefficient", "KL term added with the wrong sign",
      "return beta * (ref_ratio - 1), masked_mean", "return -beta * (ref_ratio - 1), masked_mean"),
    m("grpo-kl-no-minus-1", COMMON, "k3_coefficient", "β π_ref/πθ without the − 1",
      "return beta * (ref_ratio - 1), masked_mean", "return beta * ref_ratio, masked_mean"),
    m("grpo-beta-ge", GRPO, "GRPO.coefficient", "the KL branch also runs at β = 0",
      "        if cfg.beta > 0 and cfg.kl_in_loss:\n", "        if cfg.beta >= 0 and cfg.kl_in_loss:\n"),
    m("grpo-kl-metric", COMMON, "k3_coefficient", "kl metric as k1 (−log ratio) instead of k3",
      "masked_mean(ref_ratio - torch.log(ref_ratio) - 1, batch.mask)", "masked_mean(-torch.log(ref_ratio), batch.mask)"),
    m("grpo-kl-metric-sign", COMMON, "k3_coefficient", "kl metric with + log instead of − log",
      "ref_ratio - torch.log(ref_ratio) - 1, batch.mask", "ref_ratio + torch.log(ref_ratio) - 1, batch.mask"),
    m("grpo-hook-ignored", GRPO, "GRPO.coefficient", "the family's own ratio term ignored: PPO's clip for every member",
      "gc, metrics = cls.policy_coefficient(adv, logp, old_logp, batch.mask, cfg)",
      "gc, metrics = GRPO.policy_coefficient(adv, logp, old_logp, batch.mask, cfg)"),
    m("grpo-needs-ref", GRPO, "GRPO.needs", "reference asked for at β = 0", '({"ref_logp"} if cfg.beta > 0',
      '({"ref_logp"} if cfg.beta >= 0'),
    m("grpo-needs-old", GRPO, "GRPO.needs", "old log-probs asked for at μ = 1", "old = cfg.mu > 1 or",
      "old = cfg.mu >= 1 or"),
    # algorithms/gspo.py
    m("gspo-sum-not-mean", GSPO, "sequence_log_ratio", "log s_i summed over tokens, not averaged (no 1/|o_i| power)",
      "sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)", "sum(-1, keepdim=True)"),
    m("gspo-padding", GSPO, "sequence_log_ratio", "padding tokens enter s_i",
      "((logp - old_logp) * mask).sum(-1, keepdim=True)", "(logp - old_logp).sum(-1, keepdim=True)"),
    m("gspo-token-ratio", GSPO, "GSPO.coefficient", "first token's ratio instead of the sequence's",
      "log_s = sequence_log_ratio(logp, old_logp, batch.mask)  # [B, 1]\n",
      "log_s = (logp - old_logp)[:, :1]\n"),
    m("gspo-eps-swap", GSPO, "GSPO.coefficient", "ε_low and ε_high swapped",
      "cfg.clip_eps,\n                                          cfg.clip_eps_high)",
      "cfg.clip_eps_high,\n                                          cfg.clip_eps)"),
    m("gspo-ignore-old", GSPO, "GSPO.coefficient", "s_i against logp itself even when old_logp is stored",
      "old_logp = batch.old_logp if batch.old_logp is not None else logp", "old_logp = logp"),
    m("gspo-clip-frac-all", GSPO, "GSPO.coefficient", "clip_frac counts sequences with Â = 0",
      "((batch.adv != 0) & (batch.mask.sum(-1) > 0))", "(batch.mask.sum(-1) > 0)"),
    m("gspo-no-kl", GSPO, "GSPO.coefficient", "k3 term dropped at β > 0", "        if cfg.beta > 0:\n            kl_gc",
      "        if cfg.beta < 0:\n            kl_gc"),
    m("gspo-agg", GSPO, "GSPO.aggregation", "token_mean instead of the per-sequence mean",
      'return "seq_mean_token_mean", 1.0', 'return "token_mean", 1.0'),
    # algorithms/distill.py
    m("distill-sign", DISTILL, "advantage", "the teacher and the student swapped in the KL: A = log π_old − log π_T",
      "return batch.teacher_logp - old, old", "return old - batch.teacher_logp, old"),
    m("distill-current-not-old", DISTILL, "advantage", "A from the current log-probs, not the sampling policy's (μ > 1)",
      "old = (batch.old_logp if batch.old_logp is not None else logp).detach()", "old = logp.detach()"),
    m("distill-no-clip", DISTILL, "Distill.coefficient", "no clip on the ratio at μ > 1",
      "gc, metrics = clipped_coefficient(adv, logp, old, batch.mask, cfg.clip_eps, cfg.clip_eps_high)",
      "gc, metrics = clipped_coefficient(adv, logp, old, batch.mask, 1e9, 1e9)"),
    m("distill-kl-metric-sign", DISTILL, "Distill.coefficient", "reverse_kl logged with the wrong sign",
      'metrics["reverse_kl"] = masked_mean(-adv, batch.mask)', 'metrics["reverse_kl"] = masked_mean(adv, batch.mask)'),
    m("teacher-temperature", TRAIN, "Engine.scored", "the teacher scored at temperature 1, not the sampling one",
      "            batch.teacher_logp = self.score(self.teacher, batch)",
      "            batch.teacher_logp = self.score(self.teacher, dataclasses.replace(batch, temperature=1.0))"),
    # posttrain from Python (posttrain/apps/api.py) and GGUF checkpoints
    m("python-reward-unweighted", JUDGE, "Judge.score", "a Python reward function logged but left out of the reward",
      "            total = [t + weight * (s or 0.0) for t, s in zip(total, parts[name])]",
      "            total = list(total)"),
    m("python-rows-ignored", ROWS, "load_splits", "rows given from Python ignored for the file their marker names",
      'train = read_rows(given.get("data.path", cfg.path), "data.path")', 'train = read_rows(cfg.path, "data.path")'),
    m("own-loss-ascended", TRAIN, "Engine.accumulate", "a loss function's per-token loss ascended, not descended",
      "                    loss = aggregate(per_token, mb.mask, self.mode, totals, self.norm)",
      "                    loss = -aggregate(per_token, mb.mask, self.mode, totals, self.norm)"),
    m("gguf-still-quantized", GGUF, "write_model_dir", "the loader's quantization record kept in the converted config",
      '        model.config.__dict__.pop("quantization_config", None)', "        pass"),
    m("main-imported", LAUNCH, "main_unimported", "worker processes import the caller's __main__ again",
      '        main.__dict__.pop("__file__", None)\n        main.__dict__["__spec__"] = None', "        pass"),
    m("teacher-is-policy", TRAIN, "Engine.scored", "the policy scored in the teacher's place",
      "            batch.teacher_logp = self.score(self.teacher, batch)",
      "            batch.teacher_logp = self.score(self.policy.module, batch)"),
    # algorithms/online_dpo.py
    m("odpo-swap", ODPO, "best_and_worst", "chosen and rejected swapped: the worst sample trained as preferred",
      "rows += [best, worst]", "rows += [worst, best]"),
    m("odpo-ties-count", ODPO, "OnlineDPO.pair_weight", "a tie trained as a preference (its first sample chosen)",
      "return batch.extra[RANKED][0::2]", "return torch.ones_like(batch.extra[RANKED][0::2])"),
    m("odpo-first-worst", ODPO, "best_and_worst", "rejected the first of the lowest, not the last (a tie's pair is "
      "then one row twice)", "worst = idx[len(idx) - 1 - int(torch.argmax((r.flip(0) == r.min()).int()))]",
      "worst = idx[int(torch.argmax((r == r.min()).int()))]"),
    m("odpo-tie-strict", ODPO, "best_and_worst", "a pair whose rewards differ called a tie where the gap is small",
      "ranked.append(bool(r.max() > r.min()))", "ranked.append(bool(r.max() - r.min() > 0.5))"),
    m("dpo-weight-ignored", DPO, "DPO.coefficient", "the method's pair weights ignored in GC",
      "        if weight is not None:\n            w = w * weight", "        if weight is None:\n            w = w * weight"),
    # algorithms/cispo.py
    m("cispo-sign", CISPO, "CISPO.policy_coefficient", "GC's sign flipped", "gc = weight * adv  #", "gc = -weight * adv  #"),
    m("cispo-clip-not-detached", CISPO, "clipped_weight", "the clipped weight not detached: GC gains ρ's derivative "
      "(the objective's gradient is then PPO-like, ρÂ, inside the bounds)", "ratio = torch.exp(logp - old_logp).detach()",
      "ratio = torch.exp(logp - old_logp)"),
    m("cispo-drop-clipped", CISPO, "CISPO.policy_coefficient", "bounded tokens dropped, as GRPO's clip does",
      "gc = weight * adv  #", "gc = weight * adv * (weight == ratio)  #"),
    m("cispo-no-upper", CISPO, "clipped_weight", "no upper bound on the weight",
      "ratio.clamp(1 - cfg.clip_eps, 1 + high)", "ratio.clamp(min=1 - cfg.clip_eps)"),
    m("cispo-eps-swap", CISPO, "clipped_weight", "ε_low used above, ε_high below",
      "ratio.clamp(1 - cfg.clip_eps, 1 + high)", "ratio.clamp(1 - high, 1 + cfg.clip_eps)"),
    # algorithms/sapo.py
    m("sapo-sign", SAPO, "SAPO.policy_coefficient", "GC's sign flipped", "gc = weight * ratio * adv",
      "gc = -weight * ratio * adv"),
    m("sapo-tau-swap", SAPO, "gate", "τ_pos on negative advantages, τ_neg on positive ones",
      "torch.where(adv > 0, cfg.tau_pos, cfg.tau_neg)", "torch.where(adv > 0, cfg.tau_neg, cfg.tau_pos)"),
    m("sapo-no-ratio", SAPO, "SAPO.policy_coefficient", "the gate's weight without the factor ρ of d ρ / d log πθ",
      "gc = weight * ratio * adv", "gc = weight * adv"),
    m("sapo-weight-2", SAPO, "SAPO.policy_coefficient", "w = 2σ(1 − σ): the 4/τ normalisation lost (w = 1/2 at ρ = 1)",
      "weight = 4 * s * (1 - s)", "weight = 2 * s * (1 - s)"),
    m("sapo-hard-clip", SAPO, "SAPO.policy_coefficient", "the weight 1 inside [0.8, 1.2], 0 outside: PPO's clip",
      "weight = 4 * s * (1 - s)", "weight = ((ratio - 1).abs() <= 0.2).to(ratio.dtype)"),
    # algorithms/rloo.py
    m("rloo-no-factor", RLOO, "leave_one_out", "r − group mean, without G/(G − 1)", "* n / (n - 1).clamp(min=1)", ""),
    m("rloo-kl-sign", RLOO, "RLOO.prepare", "sequence KL added to the reward", "reward - cfg.beta * kl",
      "reward + cfg.beta * kl"),
    m("rloo-kl-padding", RLOO, "RLOO.prepare", "padding summed into the sequence KL",
      "((batch.old_logp - batch.ref_logp) * batch.mask).sum(-1)", "(batch.old_logp - batch.ref_logp).sum(-1)"),
    m("rloo-kl-twice", RLOO, "RLOOConfig.kl_in_loss", "k3 in the loss as well as the KL in the reward",
      "return not self.kl_in_reward", "return True"),
    m("rloo-kl-in-loss-ignored", RLOO, "RLOO.prepare", "KL in the reward also with kl_in_reward=false",
      "        if cfg.beta > 0 and cfg.kl_in_reward:\n", "        if cfg.beta > 0:\n"),
    m("rloo-needs-old", GRPO, "GRPO.needs", "old log-probs not asked for with the KL in the reward",
      "old = cfg.mu > 1 or (cfg.beta > 0 and not cfg.kl_in_loss)", "old = cfg.mu > 1"),
    # algorithms/reinforce_pp.py
    m("rpp-baseline-flip", RPP, "ReinforcePP.prepare", "baseline inverted", "if baseline else batch.reward",
      "if not baseline else batch.reward"),
    m("rpp-baseline-auto", RPP, "ReinforcePP.prepare", "baseline off when null with G > 1", "else cfg.group_size > 1",
      "else False"),
    m("rpp-gamma", RPP, "ReinforcePP.prepare", "γ ignored", "cfg.gamma, 1.0)", "1.0, 1.0)"),
    m("rpp-no-whiten", RPP, "ReinforcePP.prepare", "returns not normalised", "adv=whiten(returns, mask)",
      "adv=returns"),
    m("rpp-kl-dropped", RPP, "ReinforcePP.prepare", "no KL in the token reward", "batch.ref_logp if in_reward else None",
      "None"),
    m("rpp-kl-loss-dropped", RPP, "ReinforcePPConfig.kl_in_loss", "no k3 in the loss with kl_in_reward=false",
      "return not self.kl_in_reward", "return False"),
    m("rpp-truncated-mask", RPP, "ReinforcePP.prepare", "rewards and normalisation on the unfiltered mask",
      "mask = batch.mask  # [B, R]", "mask = batch.attention_mask[:, batch.prompt_len:]  # [B, R]"),
    m("rpp-min-group", RPP, "ReinforcePPConfig", "groups of one refused", "MIN_GROUP: ClassVar[int] = 1",
      "MIN_GROUP: ClassVar[int] = 2"),
    # algorithms/common.py: clipped_coefficient (PPO, GRPO and its family, GSPO)
    m("clip-swap-eps", COMMON, "clipped_coefficient", "clip_eps and clip_eps_high swapped",
      "high = 1 + (clip_eps_high if clip_eps_high is not None else clip_eps)\n"
      "    unclipped = torch.where(adv > 0, ratio <= high, ratio >= 1 - clip_eps)",
      "high = 1 + clip_eps\n    unclipped = torch.where(adv > 0, ratio <= high, "
      "ratio >= 1 - (clip_eps_high if clip_eps_high is not None else clip_eps))"),
    m("clip-high-ignored", COMMON, "clipped_coefficient", "clip_eps_high ignored",
      "high = 1 + (clip_eps_high if clip_eps_high is not None else clip_eps)", "high = 1 + clip_eps"),
    m("clip-inverted-ratio", COMMON, "clipped_coefficient", "ρ = π_old/πθ", "ratio = torch.exp(logp - old_logp)",
      "ratio = torch.exp(old_logp - logp)"),
    m("clip-no-ratio", COMMON, "clipped_coefficient", "GC = A·1[unclipped] (ρ dropped)", "gc = adv * ratio * unclipped",
      "gc = adv * unclipped"),
    m("clip-no-clip", COMMON, "clipped_coefficient", "no clip (every token unclipped)", "gc = adv * ratio * unclipped",
      "gc = adv * ratio"),
    m("clip-sides-swapped", COMMON, "clipped_coefficient", "A > 0 checked against the lower bound and A < 0 the upper",
      "torch.where(adv > 0, ratio <= high, ratio >= 1 - clip_eps)",
      "torch.where(adv > 0, ratio >= 1 - clip_eps, ratio <= high)"),
    m("clip-lower-plus", COMMON, "clipped_coefficient", "lower bound 1 − ε -> 1 + ε", "ratio >= 1 - clip_eps)",
      "ratio >= 1 + clip_eps)"),
    m("clip-le-lt", COMMON, "clipped_coefficient", "ρ <= 1 + ε -> ρ < 1 + ε", "ratio <= high", "ratio < high",
      equivalent="the two differ only at ρ = 1 + ε exactly, the kink of min(ρA, clip(ρ)A), where either one-sided derivative "
                 "is a valid (sub)gradient"),
    m("clip-adv-ge", COMMON, "clipped_coefficient", "A > 0 -> A >= 0", "torch.where(adv > 0,", "torch.where(adv >= 0,",
      equivalent="the choice only matters where A = 0, and there GC = A·ρ·1[...] = 0 either way; clip_frac "
                 "excludes A = 0"),
    m("clip-frac-zero-adv", COMMON, "clipped_coefficient", "clip_frac counts tokens with A = 0",
      "(~unclipped & (adv != 0)).float()", "(~unclipped).float()"),
    # algorithms/common.py: kl_reward, gae, whiten (PPO, REINFORCE++); algorithms/ppo.py: prepare, critic_loss
    m("klr-sign", COMMON, "kl_reward", "KL penalty added instead of subtracted", "-beta * (old_logp - ref_logp) * mask",
      "beta * (old_logp - ref_logp) * mask"),
    m("klr-no-mask", COMMON, "kl_reward", "KL penalty on padding too", "-beta * (old_logp - ref_logp) * mask",
      "-beta * (old_logp - ref_logp)"),
    m("klr-last-off-by-one", COMMON, "kl_reward", "sequence reward one token after the last",
      ".argmax(-1, keepdim=True)  #", ".argmax(-1, keepdim=True).add(1).clamp(max=R - 1)  #"),
    m("klr-last-of-contiguous", COMMON, "kl_reward", "the last model token found as if the mask had no holes",
      "(mask * torch.arange(1, R + 1, device=mask.device)).argmax(-1, keepdim=True)",
      "(mask.sum(-1, keepdim=True).long() - 1).clamp(min=0)"),
    m("klr-first-token", COMMON, "kl_reward", "sequence reward on the first token", "token_reward.scatter_add(1, last,",
      "token_reward.scatter_add(1, last * 0,"),
    m("klr-first-model-token", COMMON, "kl_reward", "sequence reward on the first model token, not the last",
      "torch.arange(1, R + 1, device=mask.device)", "torch.arange(R, 0, -1, device=mask.device)"),
    m("klr-empty-row", COMMON, "kl_reward", "empty rows get their reward too", "(reward * mask.any(-1))", "(reward * 1.0)"),
    m("gae-forward-loop", COMMON, "gae", "loop runs forward in t", "for t in reversed(range(R)):", "for t in range(R):"),
    m("gae-no-lambda", COMMON, "gae", "γλ -> γ in the recursion", "gamma * lam * running", "gamma * running"),
    m("gae-no-gamma-next", COMMON, "gae", "γ dropped from δ", "token_reward[:, t] + gamma * next_value",
      "token_reward[:, t] + next_value"),
    m("gae-next-value-same", COMMON, "gae", "V_{t+1} taken as V_t", "gamma * next_value - values[:, t]",
      "gamma * values[:, t] - values[:, t]"),
    m("gae-next-value-of-holes", COMMON, "gae", "V_{t+1} read at an environment token, not the next model token",
      "next_value = torch.where(m, values[:, t], next_value)", "next_value = values[:, t]"),
    m("gae-adv-unmasked", COMMON, "gae", "A not masked", "adv[:, t] = torch.where(m, a, adv.new_zeros(()))",
      "adv[:, t] = a"),
    m("gae-running-unmasked", COMMON, "gae", "the recursion decays over environment tokens",
      "running = torch.where(m, a, running)", "running = a"),
    m("gae-returns-unmasked", COMMON, "gae", "returns not masked", "return adv, (adv + values) * mask",
      "return adv, adv + values"),
    m("gae-returns-no-values", COMMON, "gae", "returns = A instead of A + V", "return adv, (adv + values) * mask",
      "return adv, adv * mask"),
    m("whiten-unbiased", COMMON, "whiten", "unbiased variance instead of population",
      "var = masked_mean((x - mean) ** 2, mask)", "var = ((x - mean) ** 2 * mask).sum() / (mask.sum() - 1)"),
    m("whiten-no-eps", COMMON, "whiten", "eps dropped", "torch.rsqrt(var + eps)", "torch.rsqrt(var)"),
    m("whiten-no-mask", COMMON, "whiten", "padding not zeroed", "torch.rsqrt(var + eps) * mask", "torch.rsqrt(var + eps)"),
    m("whiten-no-centre", COMMON, "whiten", "mean not subtracted", "return (x - mean) * torch.rsqrt", "return x * torch.rsqrt"),
    m("whiten-unmasked-mean", COMMON, "whiten", "mean over padding too", "mean = masked_mean(x, mask)  #",
      "mean = x.mean()  #"),
    m("ppo-whiten-flag", PPO, "PPO.prepare", "whiten_advantages inverted", "if cfg.whiten_advantages:",
      "if not cfg.whiten_advantages:"),
    m("ppo-gamma-lam-swap", PPO, "PPO.prepare", "γ and λ swapped in the call to gae",
      "gae(token_reward, values, mask, cfg.gamma, cfg.lam)", "gae(token_reward, values, mask, cfg.lam, cfg.gamma)"),
    m("ppo-beta-ge", PPO, "PPO.prepare", "reference used at β = 0", "ref_logp = batch.ref_logp if cfg.beta > 0",
      "ref_logp = batch.ref_logp if cfg.beta >= 0",
      equivalent="at β = 0 `needs` leaves ref_logp out (test_plugin_contract), so the engine passes ref_logp = None "
                 "and both branches give None"),
    m("ppo-values-ignored", PPO, "PPO.prepare", "GAE with V = 0", "adv, returns = gae(token_reward, values, mask,",
      "adv, returns = gae(token_reward, values * 0, mask,"),
    m("ppo-needs-ref", PPO, "PPO.needs", "reference asked for at β = 0", '({"ref_logp"} if cfg.beta > 0',
      '({"ref_logp"} if cfg.beta >= 0'),
    m("critic-min", PPO, "PPO.critic_loss", "min of the two value losses instead of max",
      "loss = torch.maximum(loss, clipped_loss)", "loss = torch.minimum(loss, clipped_loss)"),
    m("critic-no-half", PPO, "PPO.critic_loss", "0.5 dropped", "return 0.5 * loss, metrics", "return loss, metrics"),
    m("critic-clip-around-returns", PPO, "PPO.critic_loss", "values clipped around the returns, not V_old",
      "clipped = old + (values - old).clamp(", "clipped = returns + (values - returns).clamp("),
    m("critic-ev", PPO, "PPO.critic_loss", "explained variance from uncentred second moments",
      "var_returns = masked_mean((returns - masked_mean(returns, mask)) ** 2, mask)",
      "var_returns = masked_mean(returns ** 2, mask)"),
    m("critic-no-lower-clip", PPO, "PPO.critic_loss", "value clip bounded above only",
      ".clamp(-cfg.value_clip, cfg.value_clip)", ".clamp(max=cfg.value_clip)"),
    m("critic-ev-sign", PPO, "PPO.critic_loss", "explained variance 1 + Var(R − V)/Var(R)",
      "1 - var_error / var_returns", "1 + var_error / var_returns"),
    m("critic-ev-floor", PPO, "PPO.critic_loss", "floor on Var(R) raised from 1e-8 to just above 1",
      "var_returns.clamp(min=1e-8)", "var_returns.clamp(min=1.00000001)"),
    m("critic-clip-frac-ge", PPO, "PPO.critic_loss", "value_clip_frac counts ties", "(clipped_loss > loss)",
      "(clipped_loss >= loss)"),
    # posttrain/core/aggregation.py
    m("agg-totals-empty", AGG, "Totals.of", "empty sequences counted", "(mask.sum(-1) > 0).sum()", "(mask.sum(-1) >= 0).sum()"),
    m("agg-masked-mean-clamp", AGG, "masked_mean", "no clamp: an empty mask divides by 0", "mask.sum().clamp(min=1)",
      "mask.sum()"),
    m("agg-masked-mean-min2", AGG, "masked_mean", "floor of the count 1 -> 2", "mask.sum().clamp(min=1)",
      "mask.sum().clamp(min=2)"),
    m("agg-masked-mean-unmasked", AGG, "masked_mean", "padding summed in", "return (x * mask).sum() / mask",
      "return x.sum() / mask"),
    m("agg-local-totals", AGG, "aggregate", "given totals ignored (local denominators)", "totals = totals or Totals.of(mask)",
      "totals = Totals.of(mask)"),
    m("agg-no-mask", AGG, "aggregate", "values not masked", "masked = values * mask  #", "masked = values  #"),
    m("agg-token-local", AGG, "aggregate", "token_mean over this micro-batch's tokens",
      "return masked.sum() / max(totals.tokens, 1.0)", "return masked.sum() / max(float(mask.sum()), 1.0)"),
    m("agg-token-per-seq", AGG, "aggregate", "token_mean divided by sequences", "return masked.sum() / max(totals.tokens, 1.0)",
      "return masked.sum() / max(totals.seqs, 1.0)"),
    m("agg-seq-width", AGG, "aggregate", "seq_mean_token_mean divides by the padded width",
      "per_seq = masked.sum(-1) / mask.sum(-1).clamp(min=1)", "per_seq = masked.sum(-1) / mask.shape[-1]"),
    m("agg-seq-no-clamp", AGG, "aggregate", "an empty sequence divides by 0", "mask.sum(-1).clamp(min=1)  #",
      "mask.sum(-1)  #"),
    m("agg-seq-local", AGG, "aggregate", "seq_mean_token_mean over this micro-batch's sequences",
      "return per_seq.sum() / max(totals.seqs, 1.0)", "return per_seq.mean()"),
    m("agg-norm-dropped", AGG, "aggregate", "L dropped from seq_mean_token_sum_norm", "/ (norm * max(totals.seqs, 1.0))",
      "/ max(totals.seqs, 1.0)"),
    m("agg-norm-tokens", AGG, "aggregate", "seq_mean_token_sum_norm over tokens", "/ (norm * max(totals.seqs, 1.0))",
      "/ (norm * max(totals.tokens, 1.0))"),
    m("agg-max-seqs", AGG, "aggregate", "no floor of 1 on the sequence count", "/ (norm * max(totals.seqs, 1.0))",
      "/ (norm * totals.seqs)"),
    # posttrain/models/scoring.py: the chunked output head
    m("head-no-temperature", SCORE, "_chunk_logits", "temperature forgotten",
      "return logits / temperature if temperature != 1.0 else logits", "return logits"),
    m("head-no-logsumexp", SCORE, "_HeadLogProb.forward", "raw logit instead of log-probability",
      ".squeeze(-1) - logits.logsumexp(-1)", ".squeeze(-1)"),
    m("head-no-float", SCORE, "_chunk_logits", "logits not upcast to float32",
      "bias.to(dtype)).to(torch.promote_types(dtype, torch.float32))", "bias.to(dtype))"),
    m("head-chunk-overlap", SCORE, "_HeadLogProb.forward", "a chunk's targets start one position late",
      "tgt = targets[s : s + chunk_rows, None]", "tgt = targets[s + 1 : s + chunk_rows + 1, None]"),
    m("head-grad-sign", SCORE, "_HeadLogProb.backward", "softmax term of the gradient added, not subtracted",
      ".mul_(-g)", ".mul_(g)"),
    m("head-grad-no-onehot", SCORE, "_HeadLogProb.backward", "one-hot term of the gradient dropped",
      "dz.scatter_add_(-1, targets[s : s + chunk_rows, None], g)", "pass"),
    m("head-grad-temperature", SCORE, "_HeadLogProb.backward", "1/τ missing from the gradient",
      "grad[s : s + chunk_rows, None].to(acc) / temperature", "grad[s : s + chunk_rows, None].to(acc)"),
    m("head-grad-weight-missing", SCORE, "_HeadLogProb.backward", "no gradient for the head's weight",
      "grad_w += dz.T @ h", "grad_w += 0 * (dz.T @ h)"),
    m("head-grad-hidden-wrong-chunk", SCORE, "_HeadLogProb.backward", "hidden gradient written one chunk row late",
      "grad_h[s : s + chunk_rows] = dz @ w", "grad_h[s : s + chunk_rows] = (dz @ w).roll(1, 0)"),
    m("head-keep-shifted", SCORE, "token_logprobs", "the head keeps the positions one later",
      "torch.nn.functional.pad(keep, (0, 1))", "torch.nn.functional.pad(keep, (1, 0))"),
    m("head-targets-unmasked", SCORE, "token_logprobs", "log-probs put back at the wrong positions",
      ".masked_scatter(keep, flat)", ".masked_scatter(keep.flip(-1), flat)"),
    # posttrain/models/scoring.py: packed sequences (train.packing)
    m("pack-positions-run-on", SCORE, "pack", "position ids run on across a packed row instead of restarting",
      "pos[row, at : at + L] = torch.arange(L, device=input_ids.device)",
      "pos[row, at : at + L] = torch.arange(at, at + L, device=input_ids.device)"),
    m("pack-attention-leaks", SCORE, "_packed_logprobs", "a mask of ones: attention spans the whole packed row",
      "kwargs = dict(input_ids=p.input_ids, position_ids=p.position_ids, attention_mask=None,",
      "kwargs = dict(input_ids=p.input_ids, position_ids=p.position_ids, attention_mask=torch.ones_like(p.input_ids),"),
    m("pack-critic-cache", SCORE, "token_values", "the critic's packed forward keeps a cache (no packed masks then)",
      "attention_mask=None, use_cache=False)\n        return unpack", "attention_mask=None)\n        return unpack"),
    m("pack-where-late", SCORE, "pack", "each kept position one later: it reads the token it should predict",
      "where[row, at + L - r - 1 : at + L - 1]", "where[row, at + L - r : at + L]"),
    m("pack-width-short", SCORE, "pack", "rows one token narrower than the longest sequence",
      "width = max(width or 0, *lengths)", "width = max(width or 0, *lengths) - 1"),
    # posttrain/train/engine.py: token budgets
    m("budget-unit-split", MICRO, "split", "a budget's micro-batches cut through units (DPO pairs)",
      "[by_unit[g].flatten() for g in groups]", "[idx[g] for g in groups]"),
    m("budget-ignored", MICRO, "token_budget", "units added whatever the budget",
      "if groups and (t if packed else r * w) <= budget:", "if groups:"),
    m("budget-padded-as-packed", MICRO, "token_budget", "padded micro-batches counted by real tokens",
      "(t if packed else r * w) <= budget", "t <= budget"),
    # posttrain/models/scoring.py: the logits path, for models the head does not cover
    m("score-no-temperature", SCORE, "_token_logp", "temperature forgotten", "logits = logits / temperature",
      "logits = logits"),
    m("score-temperature-mul", SCORE, "_token_logp", "logits multiplied by the temperature",
      "logits = logits / temperature", "logits = logits * temperature"),
    m("score-no-logsumexp", SCORE, "_token_logp", "raw logit instead of log-probability",
      ".squeeze(-1) - torch.logsumexp(logits, dim=-1)", ".squeeze(-1)"),
    m("score-no-float", SCORE, "_token_logp", "no float32 upcast", "logits = logits.float()  #", "logits = logits  #"),
    m("score-keep-R", SCORE, "_from_logits", "logits_to_keep = R, last position kept",
      "logits_to_keep=R + 1).logits[:, :-1]", "logits_to_keep=R).logits"),
    m("score-slice-off-by-one", SCORE, "_from_logits", "full-logits path sliced from prompt_len",
      ".logits[:, prompt_len - 1 : -1]  #", ".logits[:, prompt_len:]  #"),
    m("score-targets-shift", SCORE, "_from_logits", "targets shifted by one",
      'targets = kwargs["input_ids"][:, prompt_len:]  #', 'targets = kwargs["input_ids"][:, prompt_len - 1 : -1]  #'),
    m("score-chunk-overlap", SCORE, "_from_logits", "chunks overlap by one sequence",
      "logits[start : start + seqs], targets[start : start + seqs]",
      "logits[start : start + seqs + 1], targets[start : start + seqs + 1]"),
    m("score-no-checkpoint", SCORE, "_from_logits", "never checkpointed",
      "if torch.is_grad_enabled() and chunk.requires_grad:", "if False:",
      equivalent="checkpointing recomputes the same float32 logits in backward: values and gradients are identical "
                 "and only peak memory changes (bench/scoring_memory.py measures that)"),
    m("score-positions-no-skip", SCORE, "position_ids", "positions count left padding",
      "return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)",
      "return torch.arange(attention_mask.shape[1]).expand_as(attention_mask)"),
    m("score-positions-from-1", SCORE, "position_ids", "positions start at 1", "cumsum(-1) - 1).clamp(min=0)",
      "cumsum(-1)).clamp(min=0)"),
    m("score-positions-no-clamp", SCORE, "position_ids", "padding positions −1 instead of 0",
      "cumsum(-1) - 1).clamp(min=0)", "cumsum(-1) - 1)"),
    m("values-off-by-one", SCORE, "token_values", "values read one position late", "out.logits[:, prompt_len - 1 : -1, 0]",
      "out.logits[:, prompt_len:, 0]"),
    m("values-positions", SCORE, "token_values", "critic called without position ids",
      "out = critic(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask))",
      "out = critic(input_ids=input_ids, attention_mask=attention_mask)"),
    # posttrain/rollout/hf.py: the decode loop and its sampler
    m("sample-no-temperature", HF, "next_token", "temperature forgotten", "softmax(logits.float() / temperature, -1)",
      "softmax(logits.float(), -1)"),
    m("sample-cdf-unscaled", HF, "next_token", "uniform not scaled to the nucleus mass", "* cdf[:, -1:]  #", "#"),
    m("sample-nucleus-self", HF, "next_token", "nucleus counts each token's own mass",
      "((probs.cumsum(-1) - probs) < top_p)", "(probs.cumsum(-1) < top_p)"),
    m("sample-order-lost", HF, "next_token", "sorted index returned, not the token",
      "(token if order is None else order.gather(-1, token))", "token"),
    m("decode-position-stuck", HF, "decode", "positions do not advance", "position = position + 1",
      "position = position + 0"),
    m("decode-mask-short", HF, "decode", "attention mask one column short", "mask[:, : P + t + 1]", "mask[:, : P + t]"),
    m("decode-greedy-ignored", HF, "next_token", "greedy samples", "    if greedy:\n        token = logits.argmax(-1)",
      "    if False:\n        token = logits.argmax(-1)"),
    m("sample-logp-unnormalised", HF, "next_token", "reported log-prob not renormalised to the nucleus",
      " - cdf[:, -1:].log()", ""),
    m("sample-logp-untempered", HF, "next_token", "reported log-prob of the untempered softmax",
      "logp = (probs.gather(-1, token)", "logp = (torch.softmax(logits.float(), -1).gather(-1, token)"),
    # posttrain/train/engine.py: truncated importance sampling and the mismatch
    m("tis-uncapped", TRAIN, "tis_weight", "importance weight not truncated", "ratio.clamp(max=cap) if", "ratio if"),
    m("tis-inverted", TRAIN, "tis_weight", "ratio upside down", "(trainer - sampled).detach()",
      "(sampled - trainer).detach()"),
    m("tis-unmasked", TRAIN, "tis_weight", "masked modes keep the tokens over the cap",
      "torch.where(over, torch.zeros_like(ratio), ratio)", "ratio"),
    m("tis-sequence-geometric", TRAIN, "tis_weight", "sequence ratio a geometric mean, not the product",
      "(log_ratio * mask).sum(-1, keepdim=True)", "(log_ratio * mask).mean(-1, keepdim=True)"),
    m("tis-not-applied", TRAIN, "Engine.coefficient", "weight computed, GC left alone", "return gc * weight, m",
      "return gc, m"),
    m("proximal-sampler-ignored", TRAIN, "Engine.for_plugin", "the ratio still taken against the trainer's π_old",
      "return dataclasses.replace(mb, old_logp=mb.rollout_logp)", "return mb"),
    m("mismatch-k1", TRAIN, "mismatch_sums", "k1 (can be negative) instead of k3", "k3 = (d.exp() - 1 - d) * mask",
      "k3 = -d * mask"),
    # posttrain/models/gated_mlp.py: the two-activation backward; posttrain/models/lora.py and the engine: LoRA
    m("gmlp-grad-u", GMLP, "_GatedMLP.backward", "up's gradient scaled by gate instead of act(gate)",
      "grad_u = grad_h * a.detach()", "grad_u = grad_h * g"),
    m("gmlp-grad-x-gate-only", GMLP, "_GatedMLP.backward", "x's gradient through gate only",
      " + (grad_u @ w_up.to(dtype)).to(ctx.x_dtype)", ""),
    m("gmlp-down-input", GMLP, "_GatedMLP.backward", "down's weight gradient from act(gate) instead of the product",
      "_flat(a.detach() * u)", "_flat(a.detach())"),
    m("lora-merge-no-delta", LORA, "merged_weights", "adapted weights synced without the adapter",
      "weight + _delta(layers[owner], adapter, full).to(weight.dtype)", "weight"),
    m("lora-delta-unscaled", LORA, "_delta", "the adapter's B A merged without its α/r",
      "delta = (b.float() @ a.float()) * layer.scaling[adapter]", "delta = b.float() @ a.float()"),
    m("lora-ref-adapter-on", TRAIN, "Engine.reference_logp", "reference scored with the adapter on",
      "with lora.adapter_off(self.policy.module):", "if True:"),
    # posttrain/backends: several processes (tests/test_distributed.py runs them on 2 ranks)
    m("fsdp2-average-kept", FSDP, "FSDP2.backward", "FSDP's average over processes not undone",
      "self.scaled(loss * self.world_size, trained).backward()", "self.scaled(loss, trained).backward()"),
    # posttrain/backends/base.py and loss_scale.py: fp16-mixed's loss scale
    m("loss-scale-not-undone", BASE, "Backend.clip_and_step", "gradients clipped and stepped still times S",
      "            trained.scale.unscale_(trained.module.parameters())\n", "            pass\n"),
    m("loss-scale-overflow-steps", BASE, "Backend.clip_and_step", "a step whose gradient overflowed is taken",
      "        if finite:\n            trained.optimizer.step()", "        if True:\n            trained.optimizer.step()"),
    m("loss-scale-never-backs-off", SCALE, "LossScale.update", "an overflow keeps S",
      "self.scale, self.good_steps = self.scale / 2, 0", "self.scale, self.good_steps = self.scale, 0"),
    # posttrain/core/precision.py: train.precision=auto
    m("auto-bf16-without-bf16", PREC, "cpu_bf16", "a CPU without bf16 arithmetic is taken for native",
      "        return False, f\"this CPU ({cpu_class(f)}) has no bf16 arithmetic\"",
      "        return True, f\"this CPU ({cpu_class(f)}) has no bf16 arithmetic\""),
    m("auto-trusts-capped-flags", PREC, "cpu_bf16", "capped kernels are not probed",
      "    caps = capped()\n", "    caps = []\n"),
    # posttrain/core/threads.py: threads fitted to the free cores
    m("threads-own-load-counted", THREADS, "ThreadFit.update", "this process's own CPU time counted as others'",
      "self.others = max(0.0, busy - own)", "self.others = max(0.0, busy)"),
    m("zero-average-kept", ZERO, "ZeRO.backward", "DeepSpeed's average over processes not undone",
      "trained.module.backward(loss * self.world_size, scale_wrt_gas=False)",
      "trained.module.backward(loss, scale_wrt_gas=False)"),
    m("decode-alone", HF, "decode", "a sharded decode loop stops when this process's rows have",
      "(agree(bool(done.all())) if agree else bool(done.all()))", "bool(done.all())"),
    # posttrain/core/batch.py: trimming a micro-batch's padding columns
    m("trim-left-late", BATCH, "Batch.trimmed", "one real prompt column cut", "left = int(real[:P].float().argmax())",
      "left = int(real[:P].float().argmax()) + 1"),
    m("trim-right-short", BATCH, "Batch.trimmed", "last real response column cut",
      "int(real[P:].nonzero().max()) + 1", "int(real[P:].nonzero().max())"),
    m("trim-per-token-kept", BATCH, "Batch.trimmed", "per-token tensors not cut",
      "return t[:, :keep_r] if t.dim() >= 2 and t.shape[1] == R else t", "return t"),
    # posttrain/stages: the online source's pipeline; posttrain/train/controllers.py: the run's changing state
    *[stage_left_out(name) for name in STAGE_NAMES],
    m("stage-pass-rates-after-filter", STAGES, "STAGES", "pass rates learn from the kept groups only", STAGE_LIST,
      STAGE_LIST.replace("PassRateUpdates, OverlongPenalty, DynamicSampling,",
                         "OverlongPenalty, DynamicSampling, PassRateUpdates,")),
    *[controller_not_restored(name) for name in CONTROLLERS],
    m("beta-not-applied", CONTROL, "Controllers.algorithm", "the scheduled β never reaches the plugin",
      "return algorithm if self.beta is None else self.beta.apply(algorithm)", "return algorithm"),
    # algorithms: the logged objective (tests/test_objective.py)
    m("objective-kl-dropped", GRPO, "GRPO.objective", "the KL term left out of the logged objective",
      "            value = value + k3_penalty(batch.ref_logp, logp, cfg.beta)  # [B, R]",
      "            value = value  # [B, R]"),

]


def select(ids: list[str]) -> list[Mutant]:
    if not ids:
        return MUTANTS
    chosen = [x for x in MUTANTS if any(fnmatch.fnmatch(x.id, pattern) for pattern in ids)]
    if not chosen:
        sys.exit(f"no mutant matches {ids}")
    return chosen


def tests_for(mutant: Mutant, engine: bool) -> list[str]:
    first = FIRST.get(mutant.path, [])
    tests = first + [t for t in FAST if t not in first]
    if engine or mutant.path == AGG:
        tests.append(ENGINE)
    return tests


def run_one(mutant: Mutant, engine: bool, timeout: float) -> tuple[str, str, float]:
    """Applies the mutant, runs the tests, restores the file. Returns (status, killer test or note, seconds)."""
    path = ROOT / mutant.path
    original = path.read_text()
    count = original.count(mutant.old)
    if count != 1:
        return "stale", f"`old` occurs {count} times in {mutant.path}", 0.0
    start = time.monotonic()
    try:
        path.write_text(original.replace(mutant.old, mutant.new))
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-rfE", "-p", "no:cacheprovider", *tests_for(mutant, engine)]
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return "killed", "timeout", time.monotonic() - start
    finally:
        path.write_text(original)
    seconds = time.monotonic() - start
    if proc.returncode == 0:
        return "survived", "", seconds
    failed = [line.split(" ", 1)[1].split(" - ")[0] for line in proc.stdout.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    return "killed", failed[0] if failed else f"pytest exit {proc.returncode}", seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ids", nargs="*", help="mutant ids or patterns (default: all)")
    parser.add_argument("--list", action="store_true", help="print the mutants and exit")
    parser.add_argument("--check", action="store_true", help="only check, in a second, that every mutant's `old` "
                        "occurs exactly once in its file (a mutant that no longer matches tests nothing); exit 1 if not")
    parser.add_argument("--engine", action="store_true", help="run the engine invariance test for every mutant")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per mutant before it counts as killed")
    parser.add_argument("--markdown", type=Path, help="also write the results as a markdown table here")
    args = parser.parse_args()
    mutants = select(args.ids)
    if args.check:
        stale = [(x, n) for x in mutants if (n := (ROOT / x.path).read_text().count(x.old)) != 1]
        for x, n in stale:
            print(f"stale: {x.id}: `old` occurs {n} times in {x.path}")
        print(f"{len(mutants)} mutants: {len(mutants) - len(stale)} match their code, {len(stale)} stale")
        return 1 if stale else 0
    if args.list:
        for x in mutants:
            print(f"{x.id:28} {x.path:32} {x.func:32} {x.what}" + ("  [equivalent]" if x.equivalent else ""))
        return 0
    dirty = subprocess.run(["git", "status", "--porcelain", "--", *sorted({x.path for x in mutants})], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    if dirty:
        sys.exit(f"guarded files have local changes; commit or stash them first:\n{dirty}")
    rows, bad = [], []
    for i, x in enumerate(mutants, 1):
        status, note, seconds = run_one(x, args.engine, args.timeout)
        expected = "survived" if x.equivalent else "killed"
        if status != expected:
            bad.append(x.id)
        label = status if status != "survived" or not x.equivalent else "equivalent"
        print(f"[{i:3}/{len(mutants)}] {label:10} {seconds:5.1f}s  {x.id:28} {note}", flush=True)
        rows.append((x, label, note))
    killed = sum(label == "killed" for _, label, _ in rows)
    equivalent = sum(label == "equivalent" for _, label, _ in rows)
    print(f"\n{len(rows)} mutants: {killed} killed, {equivalent} equivalent, "
          f"{len(rows) - killed - equivalent} other; unexpected: {', '.join(bad) or 'none'}")
    if args.markdown:
        lines = ["| module | function | mutation | killed by |", "| --- | --- | --- | --- |"]
        for x, label, note in rows:
            verdict = f"`{note}`" if label == "killed" else (
                f"survived: equivalent because {x.equivalent}" if label == "equivalent" else f"**{label}** {note}")
            lines.append(f"| {x.path} | `{x.func}` | {x.what} | {verdict} |")
        args.markdown.write_text("\n".join(lines) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
