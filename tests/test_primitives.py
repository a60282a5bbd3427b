"""The primitives for a loop of your own (posttrain/apps/api.py: sample, score, forward_backward, optim_step, save,
save_state, load_state): GRPO written as a loop of them ends with the bytes `posttrain run recipe=grpo_math` ends
with; GRPO's objective written by hand has the plugin's gradient; any per-token loss gets autograd's gradient
through the micro-batches; a saved state goes on exactly."""

from __future__ import annotations

import json

import pytest
import torch
from cli_helpers import posttrain
from conftest import EASY

import posttrain as pt
from posttrain.core.errors import ConfigError, UserError

SMALL = {"train.threads": 1, "train.steps": 3, "train.batch_size": 2, "algorithm.group_size": 4,
         "rollout.max_new_tokens": 6, "eval.num_problems": 4, "eval.every": 0,
         **{k: int(v) for k, v in (item.split("=") for item in EASY)}}


def grpo_loop(run: pt.Run, steps: int) -> list[dict]:
    """GRPO as a loop of the primitives: sample G completions of each prompt (judged), back-propagate GRPO's GC on
    them, step the optimizer; what `posttrain run recipe=grpo_math` does each step, and the loop a reader writes."""
    log = []
    for _ in range(steps):
        batch = run.sample()  # B prompts × G completions, with rewards and group ids
        metrics = run.forward_backward(batch, "grpo")  # the reference scored, advantages, the clipped surrogate and KL
        metrics.update(run.optim_step())  # clip, AdamW, the schedule; the rollout engine gets the new weights
        log.append({"reward": float(batch.reward.mean()), **metrics})
    return log


def test_grpo_as_a_loop_of_primitives_ends_with_the_bytes_of_posttrain_run(tiny_model_dir, tmp_path):
    overrides = {**SMALL, "model.path": str(tiny_model_dir)}
    cli = posttrain("run", "recipe=grpo_math", *[f"{k}={v}" for k, v in overrides.items()],
                    f"output_dir={tmp_path / 'cli'}", "-q")
    assert cli.returncode == 0, cli.stderr[-2000:]
    with pt.Run("grpo_math", {**overrides, "output_dir": str(tmp_path / "loop")}, quiet=True) as run:
        log = grpo_loop(run, 3)
        run.save(tmp_path / "saved")
        with pytest.raises(ConfigError, match="^step: this run is driven by sample"):
            run.step()
        summary = run.finish()  # ends as a run ends, with the loop's steps
    assert summary["steps"] == 3 and summary["eval_after"] == \
        json.loads((tmp_path / "cli" / "summary.json").read_text())["eval_after"]
    for model in (tmp_path / "saved", tmp_path / "loop" / "model"):
        assert (model / "model.safetensors").read_bytes() == \
            (tmp_path / "cli" / "model" / "model.safetensors").read_bytes()
    metrics = [json.loads(line) for line in (tmp_path / "cli" / "metrics.jsonl").read_text().splitlines()]
    for ours, theirs in zip(log, metrics, strict=True):
        for key in ("reward", "loss", "kl", "grad_norm", "lr"):
            assert ours[key] == theirs[key], key


def grpo_by_hand(beta: float, eps: float):
    """GRPO's objective at μ = 1 written out (Shao et al. 2024, Eq. 3), as a per-token loss of the policy's
    log-probs: −(ρ·Â − β·k3), ρ = π/π_old (1 in value, its gradient ∇ log π), Â the group-normalised reward,
    k3 = π_ref/π − log(π_ref/π) − 1."""

    def loss(mb, logp):
        ratio = torch.exp(logp - logp.detach())
        log_ref = mb.ref_logp - logp
        k3 = torch.exp(log_ref) - log_ref - 1
        return -(ratio * mb.extra["adv"][:, None] - beta * k3)

    def advantages(batch):
        reward, group = batch.reward.double(), batch.group
        adv = torch.empty_like(reward)
        for g in group.unique():
            rows = group == g
            adv[rows] = (reward[rows] - reward[rows].mean()) / (reward[rows].std() + eps)
        return adv.float()

    return loss, advantages


def gradients(run) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in run.model.parameters() if p.requires_grad]


def test_grpo_written_by_hand_has_the_gradient_of_the_grpo_plugin(warm_model_dir, tmp_path):
    """On the second step (the policy moved from the reference, so the KL term counts) of a model that is sometimes
    right (so the advantages are not all 0)."""
    overrides = {**SMALL, "model.path": str(warm_model_dir), "train.precision": "fp32", "eval.num_problems": 0,
                 "train.micro_batch_size": 3, "algorithm.beta": 0.5, "rollout.max_new_tokens": 24,
                 "train.batch_size": 4}
    grads = []
    for name in ("plugin", "hand"):
        with pt.Run("grpo_math", {**overrides, "output_dir": str(tmp_path / name)}, quiet=True) as run:
            grpo_loop(run, 1)
            batch = run.sample()  # the same batch in both runs: the same seed, one thread
            assert batch.reward.std() > 0
            if name == "plugin":
                run.forward_backward(batch, "grpo")
            else:
                a = run.cfg.algorithm
                loss, advantages = grpo_by_hand(a.beta, a.eps)
                batch = run.score(batch)  # the reference's log-probs
                batch.extra["adv"] = advantages(batch)
                run.forward_backward(batch, loss)
            grads.append(gradients(run))
    assert sum(float(g.abs().sum()) for g in grads[0]) > 0
    for plugin, hand in zip(*grads, strict=True):
        torch.testing.assert_close(hand, plugin, rtol=1e-5, atol=1e-7)


def test_a_custom_per_token_loss_gets_autograds_gradient_through_micro_batches(warm_model_dir, tmp_path):
    """Any function of the per-token log-probs: forward_backward's gradient, accumulated over micro-batches of 2
    rows, is autograd's gradient of the same function written over the whole batch (train.loss_agg token_mean:
    the sum over every response token, divided by their count)."""
    from posttrain.models.scoring import token_logprobs

    overrides = {**SMALL, "model.path": str(warm_model_dir), "train.precision": "fp32", "eval.num_problems": 0,
                 "train.micro_batch_size": 2, "train.loss_agg": "token_mean", "rollout.max_new_tokens": 24}

    def loss(mb, logp):  # a loss no plugin has: squared distance of each token's probability from 1/2
        return (logp.exp() - 0.5) ** 2 * (1 + mb.reward[:, None].to(logp.device))

    with pt.Run("grpo_math", {**overrides, "output_dir": str(tmp_path / "run")}, quiet=True) as run:
        batch = run.sample()
        model = run.model
        params = [p for p in model.parameters() if p.requires_grad]
        logp = token_logprobs(model, batch.input_ids, batch.attention_mask, batch.prompt_len)  # [B, R]
        expected = torch.autograd.grad((loss(batch, logp) * batch.mask).sum() / batch.mask.sum(), params)
        out = run.forward_backward(batch, loss)
        assert run.training.engine.micro_batches(batch).__len__() == 4  # 8 rows in micro-batches of 2
        for got, want in zip(gradients(run), expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-8)
        whole = (loss(batch, logp.detach()) * batch.mask).sum() / batch.mask.sum()
        assert out["loss"] == pytest.approx(float(whole), rel=1e-5)
        step = run.optim_step()
        assert step["grad_norm"] > 0 and step["skipped"] == 0.0


def test_a_saved_state_goes_on_exactly(tiny_model_dir, tmp_path):
    """Three steps straight, and two steps, save_state, a new run, load_state and one more, end with the same bytes."""
    overrides = {**SMALL, "model.path": str(tiny_model_dir), "eval.num_problems": 0}
    with pt.Run("grpo_math", {**overrides, "output_dir": str(tmp_path / "straight")}, quiet=True) as run:
        grpo_loop(run, 3)
        run.save(tmp_path / "straight_model")
    with pt.Run("grpo_math", {**overrides, "output_dir": str(tmp_path / "first")}, quiet=True) as run:
        grpo_loop(run, 2)
        state = run.save_state(tmp_path / "state")
    with pt.Run("grpo_math", {**overrides, "output_dir": str(tmp_path / "second")}, quiet=True) as run:
        run.load_state(state)
        assert run.training.engine.steps_done == 2
        grpo_loop(run, 1)
        run.save(tmp_path / "resumed_model")
    assert (tmp_path / "resumed_model" / "model.safetensors").read_bytes() == \
        (tmp_path / "straight_model" / "model.safetensors").read_bytes()


def test_misuse_of_the_primitives_is_one_error_naming_it(tiny_model_dir, tmp_path):
    overrides = {**SMALL, "model.path": str(tiny_model_dir), "eval.num_problems": 0, "output_dir": str(tmp_path / "r")}
    with pt.Run("grpo_math", overrides, quiet=True) as run:
        with pytest.raises(ConfigError, match="^optim_step: no gradient to apply"):
            run.optim_step()
        batch = run.sample()
        with pytest.raises(ConfigError, match="^loss: ppo needs"):
            run.forward_backward(batch, "ppo")  # a critic's values, which this run does not load
        with pytest.raises(ConfigError, match="^loss: unknown"):
            run.forward_backward(batch, "gpro")
        with pytest.raises(UserError, match=r"^loss: the function gave \(\)"):
            run.forward_backward(batch, lambda mb, logp: logp.sum())
        grpo = run.forward_backward(batch, "grpo")
        rloo = run.forward_backward(batch, "rloo")  # another method's GC on the same samples, π_old scored for it
        assert "loss" in rloo and run.training.engine.plugin.name == "grpo"  # the run's own method again after
        assert "loss" in grpo and run._prepared[1].name == "rloo"  # prepared again, by RLOO's plugin, not reused
