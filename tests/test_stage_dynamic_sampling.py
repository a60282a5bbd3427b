"""The dynamic sampling stage (stages/dynamic_sampling.py, rollout.dynamic_sampling): which groups a step keeps, how
many rounds it samples, what fills the batch when the rounds run out, that the concatenated batch holds each kept
sample's tokens intact, and that it judges groups by the judge's outcome, not a shaped reward."""

import json

import pytest
import torch
from cli_helpers import posttrain
from conftest import EASY
from fake_online import PAD, deps, fake_ids

from posttrain.core.batch import Batch, collate, concat
from posttrain.schema import RewardsConfig, RolloutConfig
from posttrain.sources.online import Online


@pytest.fixture(autouse=True)
def no_tokenizer(monkeypatch):
    fake_ids(monkeypatch)


def source(kinds, batch_size=3, n=2, rounds=4, agree=None, **more):
    sampling = RolloutConfig(dynamic_sampling=True, max_sampling_rounds=rounds, **more.pop("sampling", {}))
    return Online(deps(kinds, batch_size=batch_size, n=n, sampling=sampling, agree=agree, **more))


def prompt_of(batch, i):
    return batch.input_ids[i, : batch.prompt_len][batch.attention_mask[i, : batch.prompt_len].bool()].tolist()


def response_of(batch, i):
    return batch.response_ids[i][batch.mask[i].bool()].tolist()


def test_keeps_the_first_batch_size_groups_that_differ():
    """Round 1: mixed(1) solved(2) mixed(3), two groups that differ; round 2: failed(4) mixed(5) mixed(6) brings a
    third, so it stops. Kept, in order: prompts 1, 3, 5; dropped: 2, 4 (equal) and 6 (beyond batch_size)."""
    batch, stats = source(["mixed", "solved", "mixed", "failed", "mixed", "mixed", "mixed"]).next()
    assert stats["sampling_rounds"] == 2 and stats["dropped_groups"] == 3 and stats["filled_groups"] == 0
    assert batch.group.tolist() == [0, 0, 1, 1, 2, 2]
    assert [prompt_of(batch, i) for i in range(6)] == [[1, 1], [1, 1], [3], [3], [5, 5, 5], [5, 5, 5]]
    assert [response_of(batch, i) for i in range(6)] == [[1], [1, 2], [3], [3, 2], [5], [5, 2]]
    assert batch.reward.tolist() == [1.0, 0.0] * 3
    assert batch.rollout_logp.sum() == -0.5 * batch.mask.sum()  # per-token tensors moved with their tokens
    assert batch.version.tolist() == [0] * 6  # and per-row ones
    # the reward figures are over all 12 completions sampled (6 of them reward 1), the failures counted per round
    assert stats["reward"] == pytest.approx(0.5) and stats["reward/errors"] == 2.0
    assert stats["generated_tokens"] == 2 * 9


def test_when_the_rounds_run_out_equal_groups_fill_the_batch():
    """Two rounds of 3 prompts with one that differs: it comes first, then the first two equal groups."""
    batch, stats = source(["solved", "mixed", "failed", "solved", "solved", "failed"], rounds=2).next()
    assert stats["sampling_rounds"] == 2 and stats["filled_groups"] == 2 and stats["dropped_groups"] == 3
    assert [prompt_of(batch, i)[0] for i in range(0, 6, 2)] == [2, 1, 3]
    assert len(batch) == 6 and batch.group.tolist() == [0, 0, 1, 1, 2, 2]


def test_a_round_is_sampled_until_every_process_has_enough():
    """Where weights are sharded every process samples as many rounds: `agree` is false while another process lacks
    groups, so this one samples a second round though its first had enough, and keeps its first round's groups."""
    calls = []

    def agree(flag):
        calls.append(flag)
        return flag and len(calls) > 1

    batch, stats = source(["mixed"] * 6, agree=agree).next()
    assert calls == [True, True] and stats["sampling_rounds"] == 2 and stats["dropped_groups"] == 3
    assert [prompt_of(batch, i)[0] for i in range(0, 6, 2)] == [1, 2, 3]


def test_groups_are_kept_by_their_outcome_rewards_not_the_length_penalty():
    """A solved prompt's two samples (1 and 2 tokens) differ once the overlong punishment (a stage before this one)
    is added (0.8 against 0.6), but not in accuracy: dynamic sampling drops the group, as DAPO filters on accuracy;
    the mixed one is kept, with the punished rewards it is trained on."""
    s = source(["solved", "mixed"], batch_size=1, rounds=2, sampling={"max_new_tokens": 2},
               rewards=RewardsConfig(overlong_buffer=2, overlong_penalty=0.4))
    batch, stats = s.next()
    assert stats["sampling_rounds"] == 2 and stats["filled_groups"] == 0 and prompt_of(batch, 0) == [2, 2, 2]
    assert batch.reward.tolist() == pytest.approx([0.8, -0.4])  # the trained rewards keep the punishment


def test_concat_pads_prompts_left_and_responses_right():
    a = collate([[5, 6, 7]], [[8]], PAD)
    b = collate([[9]], [[1, 2, 3]], PAD)
    a.rollout_logp, b.rollout_logp = torch.tensor([[-1.0]]), torch.tensor([[-2.0, -3.0, -4.0]])
    a.reward, b.reward = torch.tensor([1.0]), torch.tensor([0.0])
    c = concat([a, b], PAD)
    assert c.prompt_len == 3 and c.input_ids.tolist() == [[5, 6, 7, 8, 0, 0], [0, 0, 9, 1, 2, 3]]
    assert c.attention_mask.tolist() == [[1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1]]
    assert c.mask.tolist() == [[1, 0, 0], [1, 1, 1]] and c.rollout_logp.tolist() == [[-1, 0, 0], [-2, -3, -4]]
    assert c.reward.tolist() == [1.0, 0.0]
    with pytest.raises(ValueError, match="reward is set in some batches only"):
        concat([a, Batch(input_ids=b.input_ids, attention_mask=b.attention_mask, mask=b.mask, prompt_len=1)], PAD)


def test_dynamic_sampling_needs_groups():
    """REINFORCE++ with one sample per prompt, or an offline method, has no groups to filter."""
    from posttrain import config
    from posttrain.core.errors import ConfigError

    for recipe, overrides in (("grpo_math", ["algorithm.name=reinforce_pp", "algorithm.group_size=1"]),
                              ("sft_math", [])):
        with pytest.raises(ConfigError, match="rollout.dynamic_sampling: keeps the groups of samples whose rewards"):
            config.load(recipe, ["rollout.dynamic_sampling=true", *overrides])


def test_a_grpo_run_with_dynamic_sampling(tiny_model_dir, tmp_path):
    """On the command line: every step logs its rounds, and GRPO's zero_std_frac is the filled groups' share."""
    out = tmp_path / "dapo"
    proc = posttrain("run", "recipe=grpo_math", f"model.path={tiny_model_dir}", f"output_dir={out}", "train.steps=2",
                     "train.batch_size=2", "algorithm.group_size=3", "rollout.max_new_tokens=4", "eval.num_problems=0",
                     "rollout.dynamic_sampling=true", "rollout.max_sampling_rounds=2", *EASY, "-q")
    assert proc.returncode == 0, proc.stderr[-2000:]
    for line in (out / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        assert 1 <= m["sampling_rounds"] <= 2
        assert m["zero_std_frac"] == pytest.approx(m["filled_groups"] / 2)
