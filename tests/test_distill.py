"""On-policy distillation: the GC is the gradient of the reverse KL to the teacher (checked exactly on one token over
a whole vocabulary), the clipped form against autograd on the objective written out, and the teacher role as the
run holds it: loaded frozen, scored at the sampling temperature, refused when its tokens are not the policy's."""

import json

import pytest
import torch
from cli_helpers import assert_one_line_error, posttrain
from helpers import micro_batched_grad, objective_grad, ragged_batch, surrogate_grad, written_out_mean

from posttrain import config
from posttrain.algorithms import get
from posttrain.algorithms.distill import DistillConfig
from posttrain.core.batch import Batch
from posttrain.core.errors import ConfigError
from posttrain.train.plan import plan

DISTILL = get("distill")


def test_coefficient_hand_worked():
    """μ = 1: GC = log π_T − log πθ per token; reverse_kl the mean of log πθ − log π_T, teacher_logp the mean of
    log π_T, over the response tokens (the padding's junk left out)."""
    logp = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -0.5, -0.5]])
    teacher = torch.tensor([[-0.5, -3.0, 7.0], [-0.5, -1.5, -0.2]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    batch = Batch(input_ids=torch.zeros(2, 5, dtype=torch.long), attention_mask=torch.ones(2, 5), mask=mask,
                  prompt_len=2, teacher_logp=teacher)
    gc, metrics = DISTILL.coefficient(batch, logp, DistillConfig())
    torch.testing.assert_close(gc * mask, torch.tensor([[0.5, -1.0, 0.0], [0.0, -1.0, 0.3]]))
    torch.testing.assert_close(metrics["reverse_kl"], torch.tensor((-0.5 + 1.0 + 0.0 + 1.0 - 0.3) / 5))
    torch.testing.assert_close(metrics["teacher_logp"], torch.tensor((-0.5 - 3.0 - 0.5 - 1.5 - 0.2) / 5))
    assert metrics["clip_frac"] == 0 and metrics["ratio"] == 1


def test_gc_is_the_gradient_of_the_reverse_kl():
    """One token over a vocabulary of 6: weighting each token's surrogate by its probability (the expectation over
    the student's samples, exactly) gives the gradient of KL(πθ ‖ π_T) = Σ_a πθ(a)(log πθ(a) − log π_T(a)) in the
    logits, by autograd on the KL written out. The student and teacher swapped give another gradient."""
    g = torch.Generator().manual_seed(0)
    logits, teacher = torch.randn(6, generator=g), torch.log_softmax(torch.randn(6, generator=g), -1)

    def kl(z):
        p = torch.softmax(z, -1)
        return (p * (torch.log_softmax(z, -1) - teacher)).sum()

    z = logits.clone().requires_grad_(True)
    (want,) = torch.autograd.grad(kl(z), z)
    z = logits.clone().requires_grad_(True)
    logp = torch.log_softmax(z, -1)[:, None]  # [6, 1]: each token of the vocabulary as a sampled sequence of one
    batch = Batch(input_ids=torch.zeros(6, 3, dtype=torch.long), attention_mask=torch.ones(6, 3),
                  mask=torch.ones(6, 1), prompt_len=2, teacher_logp=teacher[:, None])
    gc, _ = DISTILL.coefficient(batch, logp.detach(), DistillConfig())
    prob = logp.detach().exp()  # [6, 1] each token's probability under the student
    loss = -(prob * gc * logp).sum()  # E_{a~πθ}[−GC·log πθ(a)]: the engine's loss, in expectation
    (got,) = torch.autograd.grad(loss, z)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert want.abs().sum() > 1e-3
    z = logits.clone().requires_grad_(True)
    swapped = Batch(**{**vars(batch), "teacher_logp": logp.detach()})  # as if the student were the teacher
    gc_swapped, _ = DISTILL.coefficient(swapped, teacher[:, None], DistillConfig())
    (other,) = torch.autograd.grad(-(prob * gc_swapped * torch.log_softmax(z, -1)[:, None]).sum(), z)
    assert not torch.allclose(other, want, atol=1e-3)


def distill_objective(batch, cfg, mode, norm):
    """J = aggregate over tokens of min(ρA, clip(ρ, 1 − ε, 1 + ε_high)A), A = log π_T − log π_old held fixed, written
    out token by token (the objective is minimised as −J)."""
    high = cfg.clip_eps if cfg.clip_eps_high is None else cfg.clip_eps_high
    B, R = batch.mask.shape

    def J(logp):
        old = batch.old_logp if batch.old_logp is not None else logp.detach()
        terms = torch.zeros(B, R)
        for i in range(B):
            for t in range(R):
                a = float(batch.teacher_logp[i, t] - old[i, t])
                rho = torch.exp(logp[i, t] - old[i, t])
                terms[i, t] = torch.min(rho * a, torch.clamp(rho, 1 - cfg.clip_eps, 1 + high) * a)
        return written_out_mean(terms, batch.mask, mode, norm)

    return J


@pytest.mark.parametrize("mode", ["seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm"])
@pytest.mark.parametrize("spread", [0.0, 0.4], ids=["mu1", "ratio-off-1"])
def test_gradient_matches_objective(mode, spread):
    """The surrogate's gradient, whole and in micro-batches of 2 rows, against autograd on J written out; off ρ = 1
    the clip acts on some tokens."""
    cfg = DistillConfig(mu=2 if spread else 1)
    batch, logp = ragged_batch(spread=spread)
    if not spread:
        batch.old_logp = None
    batch.teacher_logp = logp + 0.5 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(3))
    want = objective_grad(distill_objective(batch, cfg, mode, 4.0), logp)
    torch.testing.assert_close(surrogate_grad(DISTILL, batch, logp, cfg, mode, 4.0), want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(micro_batched_grad(DISTILL, batch, logp, cfg, mode, 4.0, 2), want, atol=1e-6,
                               rtol=1e-5)
    _, metrics = DISTILL.coefficient(batch, logp, cfg)
    assert (0 < metrics["clip_frac"] < 1) if spread else metrics["clip_frac"] == 0


def test_plugin_contract_and_refusals():
    assert DISTILL.source == "online" and DISTILL.needs(DistillConfig()) == {"teacher_logp"}
    assert DISTILL.needs(DistillConfig(mu=2)) == {"teacher_logp", "old_logp"} and DISTILL.clips_ratio
    assert DISTILL.samples_per_prompt(DistillConfig(samples_per_prompt=4)) == 4
    for kwargs, match in [({"samples_per_prompt": 0}, "samples_per_prompt"), ({"mu": 0}, "mu: must be ≥ 1"),
                          ({"clip_eps": 0.3, "clip_eps_high": 0.1}, "clip_eps_high")]:
        with pytest.raises(ConfigError, match=match):
            DistillConfig(**kwargs)


def test_recipe_plans_a_frozen_teacher_scored_before_the_update():
    """recipe=distill_math: GRPO's 32 prompts × 8 samples, a teacher role (the embedded one unless a path is given)
    on the trainer, frozen, its log-probs scored over the batch; no reference."""
    cfg, resolved = config.load("distill_math")
    p = plan(cfg)
    teacher = p.role("teacher")
    assert teacher is not None and (teacher.where, teacher.origin, teacher.trained) == ("trainer", "embedded", False)
    assert p.role("reference") is None and p.scored == ("teacher_logp",) and p.shape.rows == 256
    cfg, _ = config.load("distill_math", ["model.teacher_path=/some/teacher"])
    assert plan(cfg).role("teacher").origin == "/some/teacher"
    assert plan(config.load("grpo_math", ["model.teacher_path=/some/teacher"])[0]).role("teacher") is None


def test_the_engine_scores_the_teacher_at_the_sampling_temperature(tiny_model_dir, warm_model_dir, tmp_path):
    """A run's engine holds the teacher frozen and gives each batch its log-probs under it at the batch's sampling
    temperature (0.7 here), as the reference's; the teacher is not the policy (another model's log-probs)."""
    from posttrain import backends
    from posttrain.models.loading import load
    from posttrain.models.scoring import token_logprobs
    from posttrain.sources import run_splits
    from posttrain.train.build import build

    cfg, _ = config.load("distill_math", [f"model.path={tiny_model_dir}", f"model.teacher_path={warm_model_dir}",
                                          f"output_dir={tmp_path / 'run'}", "rollout.temperature=0.7",
                                          "train.precision=fp32", "train.batch_size=2",
                                          "algorithm.samples_per_prompt=2", "rollout.max_new_tokens=6"])
    backend = backends.get("ddp")(precision="fp32")
    engine = build(cfg, tiny_model_dir, backend, run_splits(cfg), teacher_path=warm_model_dir)
    try:
        assert engine.teacher is not None and not any(p.requires_grad for p in engine.teacher.parameters())
        batch, _ = engine.source.next()
        assert batch.temperature == 0.7
        engine.scored(batch)
        teacher, _ = load(warm_model_dir)
        want = token_logprobs(teacher, batch.input_ids, batch.attention_mask, batch.prompt_len, temperature=0.7)
        torch.testing.assert_close(batch.teacher_logp * batch.mask, want * batch.mask, atol=1e-5, rtol=1e-5)
        policy = token_logprobs(engine.policy.module, batch.input_ids, batch.attention_mask, batch.prompt_len,
                                temperature=0.7)
        assert not torch.allclose(batch.teacher_logp * batch.mask, policy * batch.mask, atol=1e-3)
    finally:
        engine.close()


def test_a_run_with_a_teacher_and_the_refusals(warm_model_dir, tiny_model_dir, tmp_path):
    """A short run from a given teacher records the role and its weights, and the reverse KL it trains on; a policy
    given without a teacher, a teacher that is not a model, and one whose tokenizer differs are each one line naming
    model.teacher_path, exit 2."""
    from families import bpe_tokenizer, build_family

    out = tmp_path / "run"
    common = ["train.steps=2", "train.batch_size=2", "algorithm.samples_per_prompt=2", "eval.num_problems=4",
              "rollout.max_new_tokens=6", "train.precision=fp32"]
    proc = posttrain("run", "recipe=distill_math", f"model.path={tiny_model_dir}",
                     f"model.teacher_path={warm_model_dir}", f"output_dir={out}", *common)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    roles = {r["role"]: r for r in summary["plan"]["roles"]}
    assert roles["teacher"]["origin"] == str(warm_model_dir) and summary["memory"]["roles_bytes"]["teacher_weights"] > 0
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(m["reverse_kl"] > 0 for m in metrics)  # a random student far from its teacher
    other = build_family("llama", tmp_path / "bpe", bpe_tokenizer())
    for teacher, match in [(None, ["model.teacher_path: distillation learns from a teacher's log-probs"]),
                           (tmp_path, ["model.teacher_path: ", "is not a model directory"]),
                           (other, ["model.teacher_path: the model at", "has a different tokenizer from the policy"])]:
        args = [f"model.teacher_path={teacher}"] if teacher is not None else []
        proc = posttrain("run", "recipe=distill_math", f"model.path={tiny_model_dir}",
                         f"output_dir={tmp_path / 'refused'}", *common, *args)
        assert_one_line_error(proc, *match)


def test_the_workers_score_the_teacher_as_the_trainer_would(warm_model_dir, tiny_model_dir, tmp_path):
    """rollout.reference_on=workers covers the teacher too: with two workers a step ahead, the trainer neither holds
    nor scores it, the workers hold it (the plan says where), and each step's reverse KL and loss are those of the
    same run with the teacher on the trainer, to float rounding."""
    common = ["recipe=distill_math", f"model.path={tiny_model_dir}", f"model.teacher_path={warm_model_dir}",
              "train.steps=3", "train.batch_size=2", "algorithm.samples_per_prompt=3", "eval.num_problems=0",
              "rollout.max_new_tokens=6", "train.precision=fp32", "train.micro_batch_size=3", "train.threads=1",
              "rollout.placement=separate", "rollout.workers=2", "rollout.worker_threads=1",
              "rollout.max_staleness=1"]
    runs = {}
    for where in ("trainer", "workers"):
        out = tmp_path / where
        proc = posttrain("run", *common, f"output_dir={out}", f"rollout.reference_on={where}")
        assert proc.returncode == 0, proc.stderr[-2000:]
        s = json.loads((out / "summary.json").read_text())
        roles = {r["role"]: r for r in s["plan"]["roles"]}
        assert s["reference_on"] == where and roles["teacher"]["where"] == where
        assert s["rollout_workers"]["workers"] == 2
        assert ("teacher_weights" in s["memory"]["roles_bytes"]) == (where == "trainer")
        assert s["plan"]["scored"] == (["teacher_logp"] if where == "trainer" else [])
        runs[where] = [m[k] for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
                       for k in ("reverse_kl", "loss")]
    assert min(runs["trainer"][::2]) > 1e-3
    assert runs["workers"] == pytest.approx(runs["trainer"], rel=1e-4, abs=1e-7)
