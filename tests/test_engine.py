"""The engine: micro-batch invariance of the gradient, exact repeats with a seed, models loaded only when asked."""

import json

import pytest
import torch

from posttrain import config
from posttrain.backends.ddp import DDP
from posttrain.core.aggregation import MODES, Totals
from posttrain.core.threads import usable_cores
from posttrain.sources import run_splits
from posttrain.train import build, run


def make_cfg(model_dir, tmp_path, *overrides):
    cfg, resolved = config.load("grpo_math", [f"model.path={model_dir}", f"output_dir={tmp_path / 'run'}",
                                              "eval.num_problems=4", "eval.batch_size=4", "train.batch_size=2",
                                              "algorithm.group_size=4", "rollout.max_new_tokens=6",
                                              "data.train_size=200", "data.test_size=20", *overrides])
    return cfg, resolved


def make_engine(cfg, model_dir):
    return build(cfg, model_dir, DDP(), run_splits(cfg))


def grouped_batch(engine, cfg):
    """Two prompts × 4 samples of the engine's policy, with fixed rewards and a reference 0.1-noisy around the
    policy, prepared by the plugin (GRPO's group advantages): the batch the micro-batch tests split."""
    torch.manual_seed(0)
    batch = engine.rollout.generate([[5, 6, 7], [8, 9]], 4, max_new_tokens=6)
    batch.reward = torch.tensor([1.0, 0, 0, 1, 0, 1, 1, 1])
    batch.ref_logp = engine.score(engine.ref, batch) + 0.1 * torch.randn(batch.mask.shape)
    return engine.plugin.prepare(batch, cfg.algorithm)[0]


@pytest.mark.parametrize("mode", MODES)
def test_gradient_invariant_to_micro_batches(tiny_model_dir, tmp_path, mode):
    """Groups of 4 split across micro-batches of 3 (3 backward passes) give the gradient of the whole batch at once
    (1 backward pass)."""
    cfg, _ = make_cfg(tiny_model_dir, tmp_path, f"train.loss_agg={mode}", "algorithm.beta=0.1")
    engine = make_engine(cfg, tiny_model_dir)
    batch = grouped_batch(engine, cfg)
    backward, calls = engine.backend.backward, []
    engine.backend.backward = lambda loss, trained: (calls.append(1), backward(loss, trained))
    grads, passes = [], []
    for micro in (8, 3):
        engine.micro = micro
        calls.clear()
        engine.accumulate(batch, Totals.of(batch.mask))
        passes.append(len(calls))
        grads.append(torch.cat([p.grad.flatten() for p in engine.policy.module.parameters()]))
        engine.policy.optimizer.zero_grad(set_to_none=True)
    assert passes == [1, 3]  # the split really changed
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-4)


def test_reference_loaded_only_when_asked(tiny_model_dir, tmp_path):
    assert make_engine(make_cfg(tiny_model_dir, tmp_path, "algorithm.beta=0")[0], tiny_model_dir).ref is None
    assert make_engine(make_cfg(tiny_model_dir, tmp_path, "algorithm.beta=0.1")[0], tiny_model_dir).ref is not None


def test_metrics_average_every_update(tiny_model_dir, tmp_path):
    """PPO takes ppo_epochs × num_minibatches = 4 updates a step: the step's metrics are their mean, not the last's."""
    cfg, _ = config.load("ppo_math", [f"model.path={tiny_model_dir}", "train.batch_size=4", "rollout.max_new_tokens=6",
                                      "data.train_size=200", "data.test_size=20", "train.lr=1e-2"])
    engine = make_engine(cfg, tiny_model_dir)
    seen = []
    update = engine.update
    engine.update = lambda b, t: seen.append(update(b, t)) or seen[-1]
    torch.manual_seed(0)
    metrics = engine.step()
    assert len(seen) == 4 and len({float(u["ratio"]) for u in seen}) > 1
    for key in ("loss", "ratio", "grad_norm", "value_error", "critic_loss"):
        assert metrics[key] == pytest.approx(sum(float(u[key]) for u in seen) / 4, rel=1e-5)
    assert metrics["beta"] == cfg.algorithm.beta  # logged for every method with a KL penalty, scheduled or not
    assert metrics["staleness/mean"] == metrics["staleness/max"] == 0.0  # sampled by the weights it updates


def test_staleness_counts_the_versions_a_row_is_behind():
    """Rows drawn by the weights being updated are 0 behind; an elite replay drawn 5 updates ago is 5."""
    from posttrain.train.engine import staleness

    ops = []
    got = staleness(torch.tensor([0, 2, 0, 5]), lambda t, op: ops.append(op) or t)
    assert got == {"staleness/mean": 7 / 4, "staleness/max": 5.0} and ops == ["sum", "max"]


def test_seeded_runs_repeat_exactly(tiny_model_dir, tmp_path):
    outs = []
    for name in ("a", "b"):
        cfg, resolved = make_cfg(tiny_model_dir, tmp_path, f"output_dir={tmp_path / name}", "train.steps=2",
                                 f"train.threads={usable_cores()}",  # pinned: fitted, it could differ between the two
                                 "algorithm.mu=2", "train.micro_batch_size=3")
        run(cfg, resolved, quiet=True)
        lines = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        timing = ("time/", "tokens_per_s", "wall_seconds", "threads")
        outs.append(([{k: v for k, v in m.items() if not k.startswith(timing)} for m in lines],
                     (tmp_path / name / "model" / "model.safetensors").read_bytes()))
    assert outs[0] == outs[1]


def test_each_step_hands_the_new_weights_to_the_rollout_engine(tiny_model_dir, tmp_path):
    """After the update a rollout engine holding its own copy of the weights (vLLM) is given every policy parameter
    as the optimizer left them, or it samples from stale weights; one sampling from the trained module itself (the
    HF engine, colocated) is given nothing."""
    cfg, _ = config.load("sft_math", [f"model.path={tiny_model_dir}", "train.batch_size=4", "train.lr=1e-2",
                                      "data.train_size=50", "data.test_size=5"])
    engine = make_engine(cfg, tiny_model_dir)
    before = {n: p.detach().clone() for n, p in engine.rollout.model.named_parameters()}
    handed = []
    engine.rollout.load_weights = lambda weights: handed.append({n: t.detach().clone() for n, t in weights})
    assert engine.rollout.colocated and engine.weight_sync == "none"
    engine.step()
    assert handed == []
    engine.rollout.colocated = False  # as an engine with its own copy
    torch.manual_seed(0)
    engine.step()
    assert len(handed) == 1 and handed[0].keys() == before.keys()
    assert any(not torch.equal(handed[0][n], before[n]) for n in before)  # the updated weights, not the old ones


def test_micro_batches_group_similar_lengths_and_cover_every_row(tiny_model_dir, tmp_path):
    """Micro-batches hold whole units, longest rows first, each row exactly once; scoring through them (sorted and
    trimmed) gives the log-probs of scoring the whole padded batch at once."""
    from posttrain.models.scoring import token_logprobs

    cfg, _ = make_cfg(tiny_model_dir, tmp_path, "algorithm.beta=0.1")
    engine = make_engine(cfg, tiny_model_dir)
    torch.manual_seed(0)
    batch = engine.rollout.generate([[5, 6, 7], [8, 9], [4]], 4, max_new_tokens=8)
    engine.micro = 4
    plan = engine.micro_batches(batch)
    rows = torch.cat([r for r, _ in plan])
    assert sorted(rows.tolist()) == list(range(len(batch)))
    lengths = batch.lengths()[rows]
    assert (lengths[:-1] >= lengths[1:]).all() and lengths[0] > lengths[-1]
    assert any(mb.input_ids.shape[1] < batch.input_ids.shape[1] for _, mb in plan)  # some columns were cut
    with torch.no_grad():
        whole = token_logprobs(engine.ref, batch.input_ids, batch.attention_mask, batch.prompt_len)
    torch.testing.assert_close(engine.score(engine.ref, batch) * batch.mask, whole * batch.mask, atol=1e-5,
                               rtol=1e-5)
