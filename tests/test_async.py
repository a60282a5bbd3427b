"""Rollout workers apart from the trainer (rollout.placement=separate): at max_staleness 0 a run is the synchronous
algorithm, byte for byte the colocated run, even when a worker dies or hangs and is restarted; at k ≥ 1 every row is
at most k versions stale; a checkpoint keeps the batches made ahead; bad settings are refused in one line.

Each test first checks that the workers really ran (summary.json names their processes), so that a silent fallback
to colocated sampling fails it."""

import collections
import contextlib
import importlib.util
import json
import os
import signal
import threading
import time

import pytest
import torch
from cli_helpers import assert_one_line_error, posttrain, posttrain_here
from conftest import EASY

from posttrain.rollout.workers import FAULT, Layout
from posttrain.rollout.workers.spec import bounded

RUN = ["recipe=grpo_math", "train.threads=1", "train.steps=4", "train.batch_size=2", "algorithm.group_size=4",
       "rollout.max_new_tokens=8", "eval.num_problems=4", *EASY, "-q"]
SEPARATE = ["rollout.placement=separate", "rollout.worker_threads=1"]


def run(model, out, *extra, env=None):
    old = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        return posttrain("run", *RUN, f"model.path={model}", f"output_dir={out}", *extra)
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def weights(out):
    return (out / "model" / "model.safetensors").read_bytes()


def summary(out):
    return json.loads((out / "summary.json").read_text())


def metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_separate(out, restarts=0):
    s = summary(out)
    assert s["placement"] == "separate" and s["rollout_workers"]["workers"] == 1
    assert all(pid != os.getpid() for pid in s["rollout_workers"]["pids"])
    assert s["rollout_workers"]["restarts"] == restarts
    assert all("time/wait_batch" in m for m in metrics(out))


# Without a fault (also shown by the killed-and-resumed run below) and stuck in sampling (the same time-out as stuck
# taking weights): under -m slow.
@pytest.mark.parametrize("fault", [pytest.param(None, marks=pytest.mark.slow, id="None"), "die:2",
                                   pytest.param("hang:3", marks=pytest.mark.slow), "hang_weights:2"])
def test_staleness_0_is_the_colocated_run_byte_for_byte(warm_model_dir, colocated, tmp_path, fault):
    """Without a fault, and with a worker killed (die), stuck in sampling (hang) or stuck taking weights
    (hang_weights) and restarted: the restarted worker gets the last weights and the request again, with the same
    generator state, so the final weights are still the colocated run's."""
    out = tmp_path / "separate"
    separate = run(warm_model_dir, out, *SEPARATE, "rollout.worker_timeout_s=4",
                   env={FAULT: fault} if fault else None)
    assert separate.returncode == 0, separate.stderr[-2000:]
    assert_separate(out, restarts=int(fault is not None))
    if fault:
        assert "posttrain: rollout worker 0 (pid" in separate.stderr and "restarted as pid" in separate.stderr
        assert metrics(out)[-1]["rollout/worker_restarts"] == 1.0
    if fault == "hang_weights:2":  # the second push (version 1), stopped by its watchdog at the bound (gloo's own
        # time-out is twice it)
        assert "pushing weights version 1 did not finish within 4 s" in separate.stderr
    assert [m["staleness/max"] for m in metrics(out)] == [0.0] * 4
    assert weights(out) == colocated


def test_lora_workers_take_the_adapter_alone_and_sample_as_colocated(warm_model_dir, tmp_path):
    lora = ["model.lora.r=4", "train.lr=1e-2"]
    colocated = run(warm_model_dir, tmp_path / "colocated", *lora)
    assert colocated.returncode == 0, colocated.stderr[-2000:]
    out = tmp_path / "separate"
    separate = run(warm_model_dir, out, *lora, *SEPARATE)
    assert separate.returncode == 0, separate.stderr[-2000:]
    assert_separate(out)
    assert summary(out)["weight_sync"] == "adapter"
    adapter = "adapter_model.safetensors"
    assert (out / "model" / adapter).read_bytes() == (tmp_path / "colocated" / "model" / adapter).read_bytes()


@pytest.mark.parametrize("recipe", ["rft_math", pytest.param("dpo_math", marks=pytest.mark.slow)])  # one path
def test_sample_once_sets_are_drawn_by_the_workers_as_colocated(warm_model_dir, tmp_path, recipe):
    """RFT's kept samples and DPO's pairs come from the starting model, sampled once through the workers (and the
    held-out evaluation too): with one worker drawing from the trainer's generator, the run ends as the colocated
    one. Their sample caches are keyed by the rollout settings, placement included, so the second run samples anew."""
    args = ["recipe=" + recipe, "train.threads=1", "train.steps=3", "train.batch_size=4", "algorithm.num_prompts=8",
            "rollout.max_new_tokens=8", "eval.num_problems=4", *EASY, "-q", f"model.path={warm_model_dir}"]
    colocated = posttrain("run", *args, f"output_dir={tmp_path / 'colocated'}")
    assert colocated.returncode == 0, colocated.stderr[-2000:]
    out = tmp_path / "separate"
    separate = posttrain("run", *args, *SEPARATE, f"output_dir={out}")
    assert separate.returncode == 0, separate.stderr[-2000:]
    s = summary(out)
    assert s["placement"] == "separate" and s["rollout_workers"]["workers"] == 1
    assert s["rollout_workers"]["requests"] >= 2  # the sample-once set and the evaluations
    assert weights(out) == weights(tmp_path / "colocated")


def test_a_worker_past_its_restarts_stops_the_run_naming_it(warm_model_dir, tmp_path):
    proc = run(warm_model_dir, tmp_path / "out", *SEPARATE, "rollout.max_worker_restarts=0", env={FAULT: "die:1"})
    assert proc.returncode != 0
    assert "rollout worker 0 (pid" in proc.stderr and "rollout.max_worker_restarts" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_killed_and_resumed_at_staleness_0_equals_uninterrupted(warm_model_dir, colocated, tmp_path):
    """Killed after step 3 was logged, before its checkpoint; resumed from step 2's: the colocated run's bytes (a
    checkpoint changes nothing a run computes)."""
    args = [*SEPARATE, "train.save_every=2"]
    out = tmp_path / "killed"
    killed = run(warm_model_dir, out, *args, env={"POSTTRAIN_CRASH_AT": "step:3"})
    assert killed.returncode == -signal.SIGKILL
    resumed = run(warm_model_dir, out, *args)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert_separate(out)
    assert summary(out)["resumed_from"]["step"] == 2
    assert weights(out) == colocated


def trained_prompts(out, name="samples.jsonl") -> list[list[str]]:
    """Each step's trained prompts, in order, from samples.jsonl (or another process's file)."""
    steps = {}
    for line in (out / name).read_text().splitlines():
        record = json.loads(line)
        steps.setdefault(record["step"], []).append(record["prompt"])
    return [steps[s] for s in sorted(steps)]


@pytest.fixture(scope="module")
def ahead(warm_model_dir, tmp_path_factory):
    """An uninterrupted run at k = 1: its directory, and the prompts every step trains on, as samples.jsonl lists
    them."""
    out = tmp_path_factory.mktemp("ahead") / "out"
    proc = run(warm_model_dir, out, *SEPARATE, "rollout.max_staleness=1", "train.save_every=2", "train.steps=5",
               "train.log_samples=true")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out, trained_prompts(out)


def test_staleness_1_runs_a_version_ahead_and_never_more(ahead):
    out, _ = ahead
    assert_separate(out)
    s = summary(out)  # the worker samples with the attention the backend gave the trainer's sampler (on CPU, eager
    # under bf16), as the worker itself reports it
    assert s["rollout_workers"]["attention"] == ["sdpa" if s["precision"] == "fp32" else "eager"]
    stale = [m["staleness/max"] for m in metrics(out)]
    assert stale[0] == 0.0 and all(s <= 1.0 for s in stale) and max(stale) == 1.0
    versions = [json.loads(line)["version"] for line in (out / "samples.jsonl").read_text().splitlines()]
    assert versions[:8] == [0] * 8 and set(versions[-8:]) <= {3, 4}  # step 5: version 3 (4 if its push came first)
    # stale samples are corrected by default: GRPO's clipped ratio is taken against the sampler's log-probs, so it is
    # off 1 on the steps that trained on an older version's samples (against the trainer's own it is 1 at μ = 1)
    correction = s["plan"]["rollout"]  # resolved by the plan; config.yaml keeps what was asked (nothing)
    assert (correction["proximal"], correction["tis_cap"]) == ("sampler", None)
    assert "proximal: null" in (out / "config.yaml").read_text()
    assert all(m["ratio"] != 1.0 for m in metrics(out) if m["staleness/max"] >= 1)


# A batch sampled ahead (request 5) is the case of step:3 too, a checkpoint write killed midway that of
# tests/test_resume.py, and a kill during a weight push resumes from the same checkpoint as step:3: those three
# under -m slow.
@pytest.mark.parametrize("crash", [pytest.param("request:5", marks=pytest.mark.slow),
                                   pytest.param("push:3", marks=pytest.mark.slow), "step:3",
                                   pytest.param("checkpoint:4", marks=pytest.mark.slow)])
def test_killed_at_staleness_1_trains_every_prompt_exactly_once(warm_model_dir, ahead, tmp_path, crash):
    """kill -9 of the training process while a batch is sampled ahead (request 5: step 4's batch, during step 3),
    in the middle of a weight push (version 3), between a step and its checkpoint, and inside a checkpoint write;
    resumed with the same command, the run trains every prompt it draws exactly once: each step the prompts of the
    run never interrupted, in the same order (batches kept in the checkpoint are trained, not drawn again)."""
    args = [*SEPARATE, "rollout.max_staleness=1", "train.save_every=2", "train.steps=5", "train.log_samples=true"]
    out = tmp_path / "killed"
    killed = run(warm_model_dir, out, *args, env={"POSTTRAIN_CRASH_AT": crash})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    if crash == "step:3":  # step 3's batch was sampled while step 2 trained: step 2's checkpoint holds step 3's batch
        state = torch.load(tmp_path / "killed.partial" / "checkpoints" / "step_2" / "process_0.pt", weights_only=False)
        ready = state["pipeline"]["ready"]
        assert state["pipeline"]["made"] == 3 and [step for step, _, _ in ready] == [3]
        assert set(ready[0][1].version.tolist()) <= {1, 2}  # by the weights of step 1 (or 2, had they come first)
    resumed = run(warm_model_dir, out, *args)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert_separate(out)
    assert summary(out)["resumed_from"]["step"] == 2
    prompts, whole = trained_prompts(out), ahead[1]
    assert len(prompts) == 5 and all(len(p) == 8 for p in prompts)
    assert prompts == whole
    assert collections.Counter(p for step in prompts for p in step) == \
        collections.Counter(p for step in whole for p in step)


# -- the reference scored by the workers (rollout.reference_on=workers) --------------------------------------------------
# Two workers, each scoring its half of a batch's rows in micro-batches of 3; fp32, so that the figures can be compared
# with the trainer's own scoring to float rounding.
REFERENCE = [*SEPARATE, "rollout.max_staleness=1", "rollout.workers=2", "train.precision=fp32",
             "train.micro_batch_size=3"]


def per_step(out, *keys):
    """Each step's `keys`, one after another: [step 1's, step 2's, ...]."""
    return [m[k] for m in metrics(out) for k in keys]


PACKED = ["train.packing=true", "train.micro_batch_tokens=64"]  # every scoring pass packed, under a token budget


@pytest.fixture(scope="module")
def trainer_reference(warm_model_dir, tmp_path_factory):
    """The same run with the reference scored by the trainer: the figures the workers' scoring must give."""
    out = tmp_path_factory.mktemp("trainer_reference") / "out"
    proc = run(warm_model_dir, out, *REFERENCE)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert summary(out)["reference_on"] == "trainer"
    return out


def test_packed_budgeted_scoring_on_the_workers_is_the_trainers(warm_model_dir, tmp_path):
    """train.packing and train.micro_batch_tokens hold for the workers' scoring too (one micro-batching, the
    trainer's): a packed, budgeted run with the reference on the workers gives the trainer-scored run's KL and loss."""
    runs = {}
    for where in ("trainer", "workers"):
        out = tmp_path / where
        proc = run(warm_model_dir, out, *REFERENCE, *PACKED, f"rollout.reference_on={where}")
        assert proc.returncode == 0, proc.stderr[-2000:]
        s = summary(out)
        assert s["reference_on"] == where and s["packed"] and s["plan"]["passes"]["update"]["tokens"] == 64
        runs[where] = per_step(out, "kl", "loss")
    assert summary(tmp_path / "workers")["plan"]["passes"]["worker_scoring"] == {"rows": 3, "tokens": 64,
                                                                                  "packing": True}
    assert max(runs["trainer"][::2]) > 1e-5
    assert runs["workers"] == pytest.approx(runs["trainer"], rel=1e-4, abs=1e-7)


@pytest.mark.parametrize("fault", [None, "die_scoring:2"])
def test_the_workers_score_the_reference_as_the_trainer_would(warm_model_dir, trainer_reference, tmp_path, fault):
    """The trainer holds no reference and scores nothing; each step's KL to the reference and loss are the
    trainer-scored run's to float rounding (workers scoring with the policy they sample with would give a KL of 0 once
    it moved), also when both workers are killed in their second scoring request and restarted."""
    out = tmp_path / "out"
    proc = run(warm_model_dir, out, *REFERENCE, "rollout.reference_on=workers", env={FAULT: fault} if fault else None)
    assert proc.returncode == 0, proc.stderr[-2000:]
    s = summary(out)
    assert s["placement"] == "separate" and s["rollout_workers"]["workers"] == 2
    assert all(pid != os.getpid() for pid in s["rollout_workers"]["pids"])
    assert s["rollout_workers"]["restarts"] == (2 if fault else 0)
    assert s["reference_on"] == "workers" and "reference_weights" not in s["memory"]["roles_bytes"]
    assert all(m["time/reference"] > 0 for m in metrics(out))
    want = per_step(trainer_reference, "kl", "loss")
    assert max(want[::2]) > 1e-5  # the policy left the reference: there is a KL to compare
    assert per_step(out, "kl", "loss") == pytest.approx(want, rel=1e-4, abs=1e-7)


@pytest.mark.parametrize("cut", [dict(rows=2), dict(rows=2, tokens=13), dict(rows=2, tokens=13, packing=True)],
                         ids=["rows", "token-budget", "packed-token-budget"])
def test_a_workers_reference_scoring_puts_each_micro_batch_back_in_its_rows(tiny_model_dir, cut, monkeypatch):
    """Rows of different lengths, scored longest first in micro-batches of 2 rows, or of at most 13 tokens (rows ×
    the longest, or packed end to end), each trimmed: every row's log-probs are the whole batch's forward's, in its
    own row."""
    from posttrain.core.batch import Batch
    from posttrain.models import scoring
    from posttrain.models.loading import load
    from posttrain.models.scoring import token_logprobs
    from posttrain.rollout.workers import reference_logprobs

    model, _ = load(tiny_model_dir)
    torch.manual_seed(0)
    ids = torch.randint(3, 40, (5, 9))  # P = 4, R = 5
    prompts, responses = torch.tensor([4, 2, 3, 4, 1]), torch.tensor([1, 5, 3, 2, 4])
    columns = torch.arange(9)
    attention = ((columns >= 4 - prompts[:, None]) & (columns < 4 + responses[:, None])).long()  # [5, 9]
    batch = Batch(ids, attention, attention[:, 4:].float(), 4)
    forwards = []  # the rows and width of each forward the worker runs

    def counted(model, ids, attention, prompt_len, **kwargs):
        forwards.append((len(ids), ids.shape[1], kwargs.get("packed", False)))
        return token_logprobs(model, ids, attention, prompt_len, **kwargs)

    monkeypatch.setattr(scoring, "token_logprobs", counted)
    got = reference_logprobs(model, batch, **cut)
    want = token_logprobs(model, ids, attention, 4)
    assert torch.allclose(got * batch.mask, want * batch.mask, atol=1e-5)
    # cut as the trainer cuts (one implementation), longest first: rows of 7, 6, 6, 5 and 5 tokens
    assert sorted(attention.sum(-1).tolist()) == [5, 5, 6, 6, 7]
    if "tokens" not in cut:  # 2 rows each
        assert [rows for rows, _, _ in forwards] == [2, 2, 1]
    elif not cut.get("packing"):  # rows × the longest row ≤ 13: 7 | 6 6 | 5 5
        assert [rows for rows, _, _ in forwards] == [1, 2, 2] and not any(p for _, _, p in forwards)
    else:  # real tokens ≤ 13, packed end to end: 7 + 6 | 6 + 5 | 5
        assert [rows for rows, _, _ in forwards] == [2, 2, 1] and all(p for _, _, p in forwards)


def test_ddp_processes_have_the_shared_workers_score_the_reference(warm_model_dir, tmp_path):
    """Under ddp both processes' batches go to the first's worker for scoring, in one collective call: each step's
    KL and loss (the mean over both processes) are the trainer-scored run's to float rounding."""
    args = [*SEPARATE, "rollout.max_staleness=1", "train.precision=fp32", "train.steps=3"]
    trainer = two_ranks(warm_model_dir, tmp_path / "trainer", "ddp", *args)
    assert trainer.returncode == 0, trainer.stderr[-3000:]
    out = tmp_path / "workers"
    workers = two_ranks(warm_model_dir, out, "ddp", *args, "rollout.reference_on=workers")
    assert workers.returncode == 0, workers.stderr[-3000:]
    assert_shared(out, "ddp")
    assert summary(out)["reference_on"] == "workers"
    want = per_step(tmp_path / "trainer", "kl", "loss")
    assert max(want[::2]) > 1e-5
    assert per_step(out, "kl", "loss") == pytest.approx(want, rel=1e-4, abs=1e-7)


def test_a_bad_reference_for_the_workers_is_a_one_line_error(tiny_model_dir, tmp_path):
    proc = posttrain_here("run", "recipe=grpo_math", f"model.path={tiny_model_dir}", *SEPARATE,
                          "rollout.reference_on=workers", f"model.ref_path={tmp_path / 'nowhere'}",
                          f"output_dir={tmp_path / 'out'}")
    assert_one_line_error(proc, "model.ref_path:")


@pytest.mark.parametrize("k", [0, 1])
def test_workers_are_told_to_sample_with_the_trainers_attention(tiny_model_dir, k):
    """At every max_staleness, not only at 0 where the bytes must match: the model's own (SDPA) decodes bf16 up to 1.7x
    slower on one thread of some CPUs (bench/decode_attention.py). Eager here stands for what the backend chose."""
    from posttrain import config, rollout
    from posttrain.models.loading import load
    from posttrain.train.build import worker_spec
    from posttrain.train.plan import plan

    cfg, _ = config.load("grpo_math", [f"model.path={tiny_model_dir}", *SEPARATE, f"rollout.max_staleness={k}"])
    policy, tokenizer = load(tiny_model_dir)
    assert policy.config._attn_implementation == "sdpa"  # the model's own: what a worker would load by itself
    policy.set_attn_implementation("eager")
    setup = rollout.Setup(policy=policy, model_path=tiny_model_dir, pad_id=tokenizer.pad_token_id, stop_ids=[0],
                          sampling=cfg.rollout, precision="bf16-mixed", seed=0, max_seqs=8)
    assert worker_spec(cfg, plan(cfg), setup, "float32").attention == "eager"
    # and to score the reference as the trainer cuts its passes (the plan's), budget and packing included
    cfg, _ = config.load("grpo_math", [f"model.path={tiny_model_dir}", *SEPARATE, "rollout.reference_on=workers",
                                       "train.micro_batch_tokens=64", "train.packing=true", "train.micro_batch_size=3"])
    spec = worker_spec(cfg, plan(cfg), setup, "float32", reference=tiny_model_dir)
    assert (spec.micro, spec.micro_tokens, spec.packing) == (3, 64, True)


def test_a_collective_past_its_bound_is_left_to_its_thread():
    """A push's collectives run on a thread of their own (a NCCL broadcast cannot time out by itself): the caller
    gets a TimeoutError at the bound, not a wait as long as the collective's, and what the collective raised."""
    gate = threading.Event()
    began = time.monotonic()
    with pytest.raises(TimeoutError, match="pushing weights version 3 did not finish within 0.3 s"):
        bounded(gate.wait, 0.3, "pushing weights version 3")
    assert time.monotonic() - began < 2
    gate.set()

    def broken():
        raise RuntimeError("Connection reset by peer")

    with pytest.raises(RuntimeError, match="Connection reset"):
        bounded(broken, 5, "a push")


class FakeGroup:
    """A weights group whose broadcast fills each bucket with `value`, fails at bucket `fail` or never returns from
    bucket `hang` (counting from 1)."""

    def __init__(self, value, fail=None, hang=None):
        self.value, self.fail, self.hang, self.calls = value, fail, hang, 0

    def broadcast(self, buf, root, timeout):
        self.calls += 1
        if self.calls == self.fail:
            raise RuntimeError("Connection reset by peer")
        if self.calls == self.hang:
            threading.Event().wait()
        buf.fill_(self.value)
        return self

    def wait(self):
        return True


def test_a_push_that_fails_or_hangs_half_way_never_reaches_the_engine():
    """The worker's side: a version counts only once every bucket of it arrived. One that fails or times out half
    way is discarded, and so is the complete one it was overwriting, so the engine keeps the weights it has."""
    import datetime

    from posttrain.rollout.workers.process import Staging

    class Engine:
        loads = []

        def load_weights(self, weights):
            self.loads.append({name: t.clone() for name, t in weights})

    engine, timeout = Engine(), datetime.timedelta(seconds=5)
    layout = Layout.of([("a", torch.zeros(4)), ("b", torch.zeros(4))], bucket_bytes=16).buckets
    assert len(layout) == 2
    staging = Staging(engine)
    staging.receive(FakeGroup(1.0), 1, layout, timeout, 5)
    assert staging.apply(1, 1) == 1 and float(engine.loads[-1]["b"].sum()) == 4.0
    staging.receive(FakeGroup(2.0), 2, layout, timeout, 5)  # complete, not swapped in yet
    with pytest.raises(RuntimeError, match="Connection reset"):
        staging.receive(FakeGroup(3.0, fail=2), 3, layout, timeout, 5)
    assert staging.apply(1, 1) == 1 and len(engine.loads) == 1  # neither 2 (overwritten) nor half of 3
    with pytest.raises(TimeoutError, match="taking weights version 4 did not finish within 0.3 s"):
        staging.receive(FakeGroup(4.0, hang=2), 4, layout, timeout, 0.3)
    assert staging.apply(1, 1) == 1 and len(engine.loads) == 1
    with pytest.raises(TimeoutError, match="weights version 2 did not arrive"):
        staging.apply(2, 0.2)
    staging.receive(FakeGroup(5.0), 5, layout, timeout, 5)
    assert staging.apply(2, 1) == 5 and float(engine.loads[-1]["a"].sum()) == 20.0


def test_weights_travel_in_bounded_buckets():
    tensors = [("a", torch.zeros(100)), ("b", torch.zeros(100)), ("c", torch.zeros(300)), ("d", torch.zeros(10,
                                                                                                     dtype=torch.bfloat16))]
    buckets = Layout.of(tensors, bucket_bytes=1000).buckets  # 250 float32 a bucket
    assert [(d, n, [e[0] for e in entries]) for d, n, entries in buckets] == [
        ("float32", 200, ["a", "b"]), ("float32", 300, ["c"]), ("bfloat16", 10, ["d"])]
    assert buckets[0][2][1] == ("b", (100,), 100, 100)


@pytest.mark.parametrize("args, fragment", [
    (["recipe=grpo_math", "rollout.max_staleness=1"], "rollout.max_staleness: applies to rollout.placement=separate"),
    (["recipe=grpo_math", "rollout.placement=apart"], "rollout.placement: unknown 'apart'"),
    (["recipe=rft_math", "rollout.placement=separate", "rollout.max_staleness=1"],
     "rollout.max_staleness: workers run ahead for the online methods"),
    (["recipe=grpo_math", "rollout.placement=separate", "rollout.workers=0"], "rollout.workers: must be ≥ 1"),
    (["recipe=grpo_math", "rollout.placement=separate", "rollout.worker_timeout_s=0"],
     "rollout.worker_timeout_s: must be > 0"),
    (["recipe=grpo_math", "rollout.reference_on=workers"], "rollout.reference_on: applies to rollout.placement=separate"),
    (["recipe=grpo_math", "rollout.placement=separate", "rollout.reference_on=gpu"],
     "rollout.reference_on: unknown 'gpu'"),
    (["recipe=dpo_math", "rollout.placement=separate", "rollout.reference_on=workers"],
     "rollout.reference_on: workers score the batches they sample for the online methods"),
    (["recipe=grpo_math", "rollout.launcher=ray"], "rollout.launcher: applies to rollout.placement=separate"),
    (["recipe=grpo_math", "rollout.placement=separate", "rollout.launcher=slurm"], "rollout.launcher: unknown 'slurm'"),
    (["recipe=grpo_math", "rollout.placement=separate", "ray.address=10.0.0.1:6379"],
     "ray.address: applies to rollout.launcher=ray (got launcher=local)"),
    (["recipe=grpo_math", "rollout.placement=separate", "rollout.launcher=ray", "ray.strategy=pack"],
     "ray.strategy: unknown 'pack'"),
    (["recipe=grpo_math", "rollout.placement=separate", "rollout.gpus=2"], "rollout.gpus: one GPU a worker for now"),
    (["recipe=grpo_math", "rollout.placement=separate", "rollout.gpus=1", "rollout.engine=vllm"],
     "rollout.gpus: workers on GPUs run the hf engine for now"),
    pytest.param(["recipe=grpo_math", "rollout.placement=separate", "rollout.gpus=1"],
                 "rollout.gpus: this machine has no CUDA device", marks=pytest.mark.skipif(
                     torch.cuda.is_available(), reason="this machine has a GPU")),
])
def test_bad_settings_are_one_line_errors(tmp_path, args, fragment):
    assert_one_line_error(posttrain_here("run", *args, f"output_dir={tmp_path / 'out'}"), fragment)


# -- several training processes sharing the workers (torchrun, 2 processes over gloo) --------------------------------
def two_ranks(model, out, backend, *extra, env=None, timeout=300):
    from test_distributed import torchrun

    return torchrun("-m", "posttrain", "run", *RUN, f"model.path={model}", f"output_dir={out}",
                    f"train.backend={backend}", "eval.num_problems=5", *extra, env=env, timeout=timeout)


def assert_shared(out, backend):
    s = summary(out)
    assert s["world_size"] == 2 and s["backend"] == backend
    assert_separate(out)


def test_two_ddp_processes_share_one_worker_byte_for_byte(warm_model_dir, tmp_path):
    """Under ddp, both training processes sample through the first's worker: at max_staleness 0 each process's part
    is drawn from its own generator, so the run ends with the bytes of the colocated ddp run (where each process
    samples for itself). 5 held-out problems: the processes' shards differ in size, the calls still pair up."""
    colocated = two_ranks(warm_model_dir, tmp_path / "colocated", "ddp")
    assert colocated.returncode == 0, colocated.stderr[-3000:]
    out = tmp_path / "separate"
    separate = two_ranks(warm_model_dir, out, "ddp", *SEPARATE)
    assert separate.returncode == 0, separate.stderr[-3000:]
    assert_shared(out, "ddp")
    assert weights(out) == weights(tmp_path / "colocated")
    assert weights(out) != (warm_model_dir / "model.safetensors").read_bytes()  # it learned: the bytes say something
    assert summary(out)["eval_after"]["num_problems"] == 5
    assert summary(out)["rollout_workers"]["requests"] >= 6  # a call a step, for both processes, and 2 evaluations


@pytest.mark.parametrize("backend", ["fsdp2", pytest.param("zero3", marks=[
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None and not os.environ.get(
        "POSTTRAIN_REQUIRE_DEEPSPEED"), reason="DeepSpeed is not installed")])])
def test_sharded_weights_reach_the_worker_whole(warm_model_dir, tmp_path, backend):
    """Under fsdp2 and zero3 each process holds half of every weight: the push gathers them one at a time, and the
    worker then samples with the trainer's weights: at max_staleness 0 in fp32, the sampler's log-probs are the
    trainer's to float rounding at every step (a version behind they differ by 3e-4 here; a shard, a stale or a
    missing push shows)."""
    out = tmp_path / "out"
    proc = two_ranks(warm_model_dir, out, backend, *SEPARATE, "train.precision=fp32")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_shared(out, backend)
    steps = metrics(out)
    assert [m["staleness/max"] for m in steps] == [0.0] * 4
    assert all(abs(m["mismatch/kl"]) < 1e-6 for m in steps), [m["mismatch/kl"] for m in steps]
    assert all(m["time/weight_sync"] > 0 for m in steps)


@pytest.mark.slow  # the shared worker is shown by the tests above, exactly-once by the one-process kills
def test_two_processes_killed_at_staleness_1_train_every_prompt_exactly_once(warm_model_dir, tmp_path):
    """Two ddp processes at k = 1, the first killed (kill -9) while a batch is sampled ahead, then the same command:
    each process trains every prompt it draws exactly once, the prompts of the run never interrupted, in order."""
    args = [*SEPARATE, "rollout.max_staleness=1", "train.save_every=2", "train.steps=5", "train.log_samples=true"]
    whole = two_ranks(warm_model_dir, tmp_path / "whole", "ddp", *args)
    assert whole.returncode == 0, whole.stderr[-3000:]
    out = tmp_path / "killed"
    killed = two_ranks(warm_model_dir, out, "ddp", *args, env={"POSTTRAIN_CRASH_AT": "request:5"})
    assert killed.returncode != 0
    resumed = two_ranks(warm_model_dir, out, "ddp", *args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_shared(out, "ddp")
    assert summary(out)["resumed_from"]["step"] == 2
    for name in ("samples.jsonl", "samples.rank1.jsonl"):
        prompts, uninterrupted = trained_prompts(out, name), trained_prompts(tmp_path / "whole", name)
        assert len(prompts) == 5 and all(len(p) == 8 for p in prompts)
        assert prompts == uninterrupted


def test_a_checkpoint_holds_every_batch_the_producer_may_make():
    """The producer's snapshot waits until it has made every batch it may (k past the trainer's request), so two
    training processes that share the workers snapshot the same batches whatever their timing: here the snapshot is
    taken right after step 2's batch (made ahead) was handed over, before the producer could start batch 3."""
    import time
    from types import SimpleNamespace

    from posttrain.train.producer import Producer

    class Source:
        made = 0

        def next(self):
            self.made += 1
            return SimpleNamespace(step=self.made), {}

    pool = SimpleNamespace(take_idle=lambda: 0.0, restarts=0, state_dict=lambda: {"rng": None})
    producer = Producer(Source(), SimpleNamespace(at=lambda step: None), pool, k=1, steps=5,
                        autocast=contextlib.nullcontext)
    try:
        assert producer.next(1)[0].step == 1
        while producer.made < 2:  # batch 2, made ahead during step 1
            time.sleep(0.01)
        assert producer.next(2)[0].step == 2
        with producer.paused() as state:
            assert state["made"] == 3 and [step for step, _, _ in state["ready"]] == [3]
    finally:
        producer.stop()
        producer.join()


def test_episodes_through_a_worker_are_the_colocated_episodes(tmp_path):
    """Multi-turn episodes sample turn by turn through a rollout worker (each turn a request that stops at the tool
    call's end): at max_staleness 0 the run ends with the colocated run's bytes, tool calls and replies included."""
    args = ["recipe=grpo_tools", "warmup.steps=60", "train.steps=2", "train.batch_size=2", "algorithm.group_size=4",
            "eval.num_problems=4", "eval.batch_size=4", "data.train_size=50", "data.test_size=10", "train.threads=1",
            "env.check_template=true", "-q"]
    for name, extra in (("colocated", []), ("separate", SEPARATE)):
        proc = posttrain("run", *args, *extra, f"output_dir={tmp_path / name}")
        assert proc.returncode == 0, proc.stderr[-2000:]
    assert_separate(tmp_path / "separate")
    steps = metrics(tmp_path / "separate")
    assert any(m["env/turns"] > 1 for m in steps) and all(m["env/errors"] == 0 for m in steps)  # the tool answered
    same = ("reward", "env/turns", "env/env_tokens", "env/calls", "loss")
    assert [[m[k] for k in same] for m in steps] == [[m[k] for k in same] for m in metrics(tmp_path / "colocated")]
    assert weights(tmp_path / "separate") == weights(tmp_path / "colocated")


def test_episodes_through_workers_shared_by_several_processes_are_refused():
    """Each training process would take its episodes' turns through the shared workers in collective calls, which
    its episodes would have to take in step: refused, naming the key, for now."""
    from types import SimpleNamespace

    from posttrain import config
    from posttrain.core.errors import ConfigError
    from posttrain.train.build import share_workers

    cfg, _ = config.load("grpo_tools", SEPARATE)
    with pytest.raises(ConfigError, match="env.name: multi-turn episodes sample through rollout workers from one"):
        share_workers(cfg, SimpleNamespace(sharded=False), SimpleNamespace(reward_model=None, process_model=None))


def test_a_sharded_reward_model_beside_shared_workers_is_refused_in_one_line(tiny_model_dir, tmp_path):
    """Under fsdp2 a reward model's weights are sharded, so its forward (in the producer thread) would run beside the
    update's collectives: refused, naming the key, on both processes, before any step."""
    from test_distributed import torchrun
    from transformers import AutoConfig, AutoTokenizer, LlamaForSequenceClassification

    rm = tmp_path / "rm"
    LlamaForSequenceClassification(AutoConfig.from_pretrained(tiny_model_dir, num_labels=1)).save_pretrained(rm)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(rm)
    proc = torchrun("-m", "posttrain", "run", "recipe=grpo_math", f"model.path={tiny_model_dir}",
                    f"output_dir={tmp_path / 'out'}", f"reward_model.path={rm}", "train.backend=fsdp2", *SEPARATE,
                    "train.steps=1", "eval.num_problems=0", *EASY)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("posttrain: error:")]
    # each process refuses; torchrun may stop the second before it prints, once the first has exited
    assert 1 <= len(errors) <= 2 and all("reward_model.path: a reward model is sharded under train.backend=fsdp2"
                                         in e for e in errors), proc.stderr[-2000:]
    frames = [line for line in proc.stderr.splitlines() if line.lstrip().startswith("File ")]
    assert all("<frozen" in f or "/torch/" in f for f in frames)  # torchrun's own report of the exit status 2
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_two_processes_agree_in_the_producer_thread(warm_model_dir, tmp_path):
    """Dynamic sampling's rounds and the adaptive temperature's reduction run in the producer thread, over its own
    group: every process draws the same number of rounds (their sampling calls must pair up) and sets the same
    temperature, with no collective of the update's in between."""
    out = tmp_path / "out"
    proc = two_ranks(warm_model_dir, out, "ddp", *SEPARATE, "rollout.max_staleness=1", "rollout.dynamic_sampling=true",
                     "rollout.adaptive_temperature=true", "train.steps=3", timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_shared(out, "ddp")
    steps = metrics(out)
    assert len(steps) == 3 and all("sampling_rounds" in m and "temperature" in m for m in steps)
    assert len({m["temperature"] for m in steps}) > 1  # it moved, agreed on both processes
