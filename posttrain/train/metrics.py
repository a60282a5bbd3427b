"""Every metric a run writes to metrics.jsonl but a method's own, declared once: name -> (unit, meaning).

The loggers are spread over the loop, the engine, the online source, the judge, the stages, the episodes and the
rollout workers' producer; one table here, grouped by where each key is logged, keeps them in one place that a reader
and `posttrain docs metrics` (posttrain/apps/reference.py, which writes docs/metrics.md) can find. A method's own
metrics are declared in its module docstring's "Metrics:" section (algorithms/*.py); their units are in
`METHOD_UNITS` below. tests/test_reference_docs.py runs small real runs and fails on any key they write that is
declared in neither place. A name with `<...>` declares a family: `<name>` stands for one path segment.

Plain data: this module imports nothing, so that anything may read it.
"""

# section -> (where it is logged and when, {name: (unit, meaning)})
METRICS: dict[str, tuple[str, dict[str, tuple[str, str]]]] = {
    "Every step": ("The training loop (posttrain/train/loop.py) and the engine (posttrain/train/engine.py), for every "
                   "method.", {
        "step": ("count", "the step this line is about, from 1; a resumed run continues the count"),
        "loss": ("surrogate", "−aggregate(stopgrad(GC)·log πθ), the loss whose gradient the update takes (averaged over "
                 "the step's μ × minibatches updates); its value has no meaning of its own (docs/unified_view.md)"),
        "objective": ("method's", "what the method minimises (−J for the RL methods, DPO's loss, the NLL of SFT and "
                      "RFT), aggregated as the loss is; each method's docstring says which (below)"),
        "grad_norm": ("L2 norm", "the policy's global gradient norm before clipping (`train.max_grad_norm`)"),
        "critic_grad_norm": ("L2 norm", "the critic's, likewise (PPO)"),
        "loss_scale": ("factor", "`train.precision=fp16-mixed`: the policy's dynamic loss scale after the step (an "
                       "overflowing step halves it)"),
        "critic_loss_scale": ("factor", "the critic's, likewise"),
        "skipped_updates": ("count", "optimizer updates of this step skipped because the loss or gradient norm was not "
                            "finite (weights, AdamW state and schedule unchanged)"),
        "skipped_steps": ("count", "steps so far with at least one skipped update; `train.max_skipped_steps` of them "
                          "in a row stop the run"),
        "updates": ("count", "optimizer updates this step: epochs (μ) × minibatches"),
        "micro_batches": ("count", "micro-batches the step's updates ran on this process, the empty ones that pair "
                          "other processes' collectives included"),
        "trained_tokens": ("tokens", "response tokens of the step's batch on this process (what the loss is over)"),
        "lr": ("learning rate", "the policy's learning rate at the step's first update"),
        "beta": ("weight", "the step's KL weight β, scheduled (`train.beta_schedule`) or not; methods with a KL penalty "
                 "only"),
        "tokens_per_s": ("tokens/s", "(trained + generated tokens) / the step's seconds, on this process"),
        "threads": ("threads", "compute threads the step ran with (`train.threads`; 0 fits them to the load after "
                    "each step)"),
        "wall_seconds": ("s", "seconds of the run so far, the time before a resume included"),
        "eval_accuracy": ("fraction", "greedy accuracy on the held-out problems, at the steps `eval.every` names "
                          "(and the last)"),
        "time/score": ("s", "scoring the batch: log-probs of the policy, old policy and reference, and values, as "
                       "the method needs"),
        "time/update": ("s", "forward, backward and optimizer steps (μ × minibatches updates)"),
        "time/weight_sync": ("s", "restoring the rollout engine's memory and pushing the new weights to it"),
        "time/step": ("s", "the whole step, sampling included"),
    }),
    "Sampling": ("The online source (posttrain/sources/online.py) and the engine, for the methods that sample every "
                 "step (Online RFT, PPO, GRPO and its family).", {
        "time/rollout": ("s", "sampling the step's completions (every round of dynamic sampling added)"),
        "time/reward": ("s", "judging them: rule rewards, custom functions, a reward model, step rewards"),
        "generated_tokens": ("tokens", "response tokens sampled this step on this process (an environment's tokens "
                             "not counted)"),
        "response_len": ("tokens", "mean response tokens per trained sample"),
        "truncated_frac": ("fraction", "trained samples that reached `rollout.max_new_tokens` without ending"),
        "mismatch/kl": ("nats/token", "train-inference mismatch: mean over response tokens of k3 = e^Δ − 1 − Δ, "
                        "Δ = log π_trainer − log π_rollout (docs/unified_view.md)"),
        "mismatch/max": ("nats", "the largest |Δ| of the step"),
        "mismatch/tis_capped": ("fraction", "with `rollout.tis_cap`: tokens whose ratio was over the cap (truncated "
                                "or masked)"),
        "staleness/mean": ("policy versions", "mean over the trained rows of how many updates behind the weights "
                           "being trained each row's sampler was (0 when synchronous)"),
        "staleness/max": ("policy versions", "the most, over the step's rows"),
        "group_size/min": ("samples", "`rollout.adaptive_group_size`: the smallest G among the step's prompts"),
        "group_size/max": ("samples", "the largest"),
    }),
    "Rewards": ("The judge (posttrain/judge.py), for the methods that score samples; `rewards.normalize` changes "
                "what is trained on, never these raw figures.", {
        "reward": ("reward", "mean over the step's samples of the weighted sum Σ_k w_k r_k (with the overlong "
                   "penalty, when on)"),
        "reward/<name>": ("reward", "mean of one objective, unweighted: a rule (`reward/accuracy`, `reward/format`), "
                          "a custom function (`reward/my_rewards.brevity`) or the reward model (`reward/model`)"),
        "reward/<name>/std": ("reward", "mean over samples of that objective's std within their prompt's group: how "
                              "much it tells a group's samples apart (0: it teaches nothing)"),
        "reward/normalized": ("z-score", "with `rewards.normalize`: mean of the normalised total trained on"),
        "reward/verify_errors": ("count", "samples a reward could not score (math-verify raised); each scored 0"),
        "reward/errors": ("count", "reward calls that raised; each sample scored 0"),
        "reward/timeouts": ("count", "reward calls that outlasted `rewards.timeout_s` (or a math check its bound); "
                            "each scored 0"),
        "reward/nonfinite": ("count", "reward calls that returned nan or inf; each scored 0"),
    }),
    "Stages of the online pipeline": ("posttrain/stages/, each when its key is on.", {
        "sampling_rounds": ("rounds", "`rollout.dynamic_sampling`: rounds sampled to fill the step"),
        "filled_groups": ("groups", "equal-reward groups that filled the batch after `rollout.max_sampling_rounds`"),
        "dropped_groups": ("groups", "equal-reward groups left out"),
        "elite/replayed": ("rows", "`rollout.elite_pool`: rows replaced by a prompt's elite this step"),
        "elite/pool_size": ("prompts", "prompts in the pool after the step's update"),
        "elite/is_weight": ("weight", "mean importance weight min(π_old/μ, `rollout.elite_is_cap`) over the step's "
                            "replayed tokens (0 if none; logged by the engine)"),
        "reward/overlong": ("reward", "`rewards.overlong_buffer`: mean overlong penalty (≤ 0), included in `reward`"),
        "pass_rate": ("fraction", "`rollout.adaptive_group_size` or `data.curriculum=pass_rate`: share of the step's "
                      "samples judged correct"),
        "temperature": ("temperature", "`rollout.adaptive_temperature`: the τ the step's samples were drawn at"),
        "entropy": ("nats/token", "mean −log π_τ of the step's freshly sampled tokens, which moves the next τ"),
    }),
    "Episodes": ("Multi-turn episodes (posttrain/sources/episodes.py), with `env.name`.", {
        "env/turns": ("turns", "mean model turns per episode"),
        "env/env_tokens": ("tokens", "mean environment tokens per episode (masked out of the loss)"),
        "env/errors": ("count", "failed environment calls (a start that failed once, each step that raised, hung past "
                       "`env.timeout_s` or replied badly once); the model saw why as the reply"),
        "env/reward": ("reward", "mean reward the environment gave per episode (added to the judge's)"),
        "env/<name>": ("per episode", "mean of what the environment reports in its replies' `info`, e.g. "
                       "`env/calls` and `env/call_errors` (the calculator's and the python tool's)"),
    }),
    "Rollout workers": ("The producer (posttrain/train/producer.py), with `rollout.placement=separate` "
                        "(docs/async.md).", {
        "time/wait_batch": ("s", "the trainer's wait for its batch: its idle time"),
        "time/worker_idle": ("s", "seconds the workers sat idle between requests, summed, while the batch was made"),
        "time/reference": ("s", "`rollout.reference_on=workers`: the workers' scoring of the batch under the "
                           "reference and the distillation teacher"),
        "rollout/worker_restarts": ("count", "workers restarted so far (dead, or silent past "
                                    "`rollout.worker_timeout_s`)"),
        "clock/step_start": ("s", "when the trainer's step began, on the producer's clock (seconds since the run's "
                             "parts were built)"),
        "clock/step_end": ("s", "when it ended"),
        "clock/batch_start": ("s", "when the producer began making the step's batch, on the same clock"),
        "clock/batch_end": ("s", "when it finished"),
    }),
    "Preference pairs": ("The pairs source (posttrain/sources/pairs.py), for DPO; the pairs are made once, so "
                         "every step logs the same figures.", {
        "dpo_pairs": ("pairs", "preference pairs trained on: the file's rows, or pairs made from the starting "
                      "model's samples"),
        "dpo_skipped_prompts": ("prompts", "made from samples: prompts left out, having no correct and incorrect "
                                "sample to pair"),
    }),
}

# The unit of each metric the methods' docstrings declare (algorithms/*.py, "Metrics:"), by name: a name means the
# same kind of quantity in every method that logs it. tests/test_reference_docs.py checks that none is missing.
METHOD_UNITS: dict[str, str] = {
    "objective": "method's",
    "kl": "nats",
    "clip_frac": "fraction",
    "ratio": "ratio",
    "gate": "weight",
    "reverse_kl": "nats",
    "teacher_logp": "nats",
    "tie_frac": "fraction",
    "reward_gap": "reward",
    "reward_std": "reward",
    "zero_std_frac": "fraction",
    "step_reward": "reward",
    "steps_per_sample": "steps",
    "correct_frac": "fraction",
    "reward_margin": "β·nats",
    "pair_accuracy": "fraction",
    "chosen_logratio": "nats",
    "rejected_logratio": "nats",
    "dpo_loss": "nats",
    "seq_reward": "reward",
    "value": "reward",
    "returns": "reward",
    "value_clip_frac": "fraction",
    "value_error": "reward",
    "explained_variance": "fraction",
    "critic_loss": "reward²",
    "rft_samples": "samples",
    "rft_kept": "samples",
    "rft_prompts_with_correct": "prompts",
}
