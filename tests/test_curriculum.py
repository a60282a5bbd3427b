"""Curriculum draws: the competence schedule over a difficulty field, prioritised draws by pass rate, resume, config."""

import copy
import random
from collections import Counter

import pytest

from posttrain import config
from posttrain.core.errors import ConfigError, DataError
from posttrain.data import RowSampler
from posttrain.data.curriculum import Curriculum, competence


def _rows(n=100, seed=0):
    """Rows whose `level` is a permutation of 0..n-1, so a row's place in the list says nothing of its difficulty."""
    levels = list(range(n))
    random.Random(seed).shuffle(levels)
    return [{"q": f"q{i}", "level": lv} for i, lv in enumerate(levels)]


def _levels(rows):
    return [r["level"] for r in rows]


def test_competence_formula():
    """c0 = 0.2, T = 100: c(0) = c0 = 0.2; c(50) = sqrt(50 · 0.96 / 100 + 0.04) = sqrt(0.52) = 0.72111;
    c(100) = sqrt(0.96 + 0.04) = 1; c(150) = min(1, sqrt(1.48)) = 1."""
    assert competence(0, 0.2, 100) == pytest.approx(0.2)
    assert competence(50, 0.2, 100) == pytest.approx(0.7211103)
    assert competence(100, 0.2, 100) == pytest.approx(1.0)
    assert competence(150, 0.2, 100) == 1.0


def test_pool_size_is_not_pushed_up_by_rounding():
    """c0 = 0.4, T = 100, t = 21: c² = 0.21 · 0.84 + 0.16 = 0.3364, c = 0.58, so 58 of 100 rows (in floating point
    c · N = 58.00000000000001, whose plain ceiling is 59)."""
    s = Curriculum(_rows(), 0, mode="field", field="level", start=0.4, ramp_steps=100)
    s.at(21)
    assert s.pool == 58 and max(_levels(s.next(200))) == 57


def test_field_draws_the_easiest_rows_and_the_pool_grows():
    """N = 100, c0 = 0.2, T = 100: step 0 draws from levels 0..19 (each once a pass); at step 50 the pool is
    ⌈0.72111 · 100⌉ = 73 rows, and the 53 rows that join it join the pass: the next 10 + 53 draws are the 10 left
    of the pass and the 53 new rows, all different, together with the first 10 exactly levels 0..72."""
    s = Curriculum(_rows(), 7, mode="field", field="level", start=0.2, ramp_steps=100)
    s.at(0)
    first = _levels(s.next(10))
    assert max(first) < 20 and len(set(first)) == 10
    s.at(50)
    assert s.pool == 73
    rest = _levels(s.next(63))
    assert len(set(rest)) == 63 and set(first) | set(rest) == set(range(73))
    s.at(50)
    assert max(_levels(s.next(200))) < 73  # a new pass, still within the pool


def test_field_at_full_competence_is_uniform_epochs():
    s = Curriculum(_rows(), 7, mode="field", field="level", start=0.2, ramp_steps=100)
    s.at(0)
    assert set(_levels(s.next(20))) == set(range(20))  # one pass over the 20 easiest
    s.at(100)
    for _ in range(3):
        assert sorted(_levels(s.next(100))) == list(range(100))  # every row once per epoch


def test_field_ties_keep_a_seeded_order():
    """Levels 0 (x10) and 1 (x10) with c0 = 0.5: the pool is the ten rows of level 0, whichever seed."""
    rows = [{"q": f"q{i}", "level": i % 2} for i in range(20)]
    for seed in range(5):
        s = Curriculum(rows, seed, mode="field", field="level", start=0.5, ramp_steps=10)
        assert set(_levels(s.next(30))) == {0}


def _script(s, save_at=None):
    """Draw 7 rows a step over 40 steps with `at` before each; the state after `save_at` steps too."""
    out, saved = [], None
    for step in range(40):
        if step == save_at:
            saved = copy.deepcopy(s.state_dict())
        s.at(step)
        out.append(_levels(s.next(7)))
    return out, saved


@pytest.mark.parametrize("save_at", [3, 17, 31])
def test_field_is_seeded_and_resumes_across_pool_growth(save_at):
    make = lambda seed: Curriculum(_rows(), seed, mode="field", field="level", start=0.1, ramp_steps=30)  # noqa: E731
    whole, saved = _script(make(5), save_at)
    assert whole == _script(make(5))[0] and whole != _script(make(6))[0]
    resumed = make(5)
    resumed.load_state_dict(saved)
    for step in range(save_at, 40):
        resumed.at(step)
        assert _levels(resumed.next(7)) == whole[step]


@pytest.mark.parametrize("value, message", [
    (None, "data.difficulty_field: row 3 field 'level' is None, not a number"),
    ("hard", "data.difficulty_field: row 3 field 'level' is 'hard', not a number"),
    ("Level 3 of 5", "data.difficulty_field: row 3 field 'level' is 'Level 3 of 5', not a number"),
    (float("nan"), "data.difficulty_field: row 3 field 'level' is nan, not a number"),
    (True, "data.difficulty_field: row 3 field 'level' is True, not a number"),
    ("missing", "data.difficulty_field: row 3 has no field 'level' (fields: q)"),
])
def test_bad_difficulty_names_the_key_row_and_field(value, message):
    rows = _rows(5)
    if value == "missing":
        del rows[2]["level"]
    else:
        rows[2]["level"] = value
    with pytest.raises(DataError) as err:
        Curriculum(rows, 0, mode="field", field="level")
    assert str(err.value).startswith(message)


def test_a_level_written_as_text_ranks_by_its_number():
    """MATH's `level` field is "Level 1" … "Level 5": the number in it is the difficulty."""
    rows = [{"q": str(i), "level": f"Level {5 - i % 5}"} for i in range(10)]
    sampler = Curriculum(rows, 0, mode="field", field="level", start=0.4, ramp_steps=10)
    assert {r["level"] for r in sampler.next(8)} == {"Level 1", "Level 2"}  # the easiest 4 of 10, twice over


def test_pass_rate_frequencies_follow_the_weights():
    """Even rows solved (s = 1), odd rows never (s = 0), floor 0.05: weights 0.05 and 1, so P(even) =
    50 · 0.05 / (50 · 0.05 + 50 · 1) = 2.5 / 52.5 = 0.0476: 952 of 20000 draws (std 30), each odd row 381."""
    rows = [{"q": f"q{i}", "i": i} for i in range(100)]
    s = Curriculum(rows, 3, mode="pass_rate", pass_rate=lambda r: 1.0 - r["i"] % 2, floor=0.05)
    counts = Counter(r["i"] for r in s.next(20000))
    even = sum(c for i, c in counts.items() if i % 2 == 0)
    assert abs(even - 20000 * 2.5 / 52.5) < 150
    assert all(abs(counts[i] - 20000 / 52.5) < 100 for i in range(1, 100, 2))


def test_pass_rate_treats_unseen_prompts_as_never_solved():
    """Rows 0..9 never tried (None), 10..19 at s = 0, 20..29 at s = 0.5: weights 1, 1, 0.5, i.e. 0.4, 0.4, 0.2."""
    rows = [{"i": i} for i in range(30)]
    rate = lambda r: None if r["i"] < 10 else (0.0 if r["i"] < 20 else 0.5)  # noqa: E731
    groups = Counter(r["i"] // 10 for r in Curriculum(rows, 4, mode="pass_rate", pass_rate=rate).next(20000))
    assert [abs(groups[g] / 20000 - p) < 0.02 for g, p in enumerate((0.4, 0.4, 0.2))] == [True] * 3


def test_pass_rate_is_seeded_and_resumes():
    rows = [{"i": i} for i in range(50)]
    make = lambda seed: Curriculum(rows, seed, mode="pass_rate", pass_rate=lambda r: r["i"] / 50)  # noqa: E731
    a, b = make(1), make(1)
    assert [r["i"] for r in a.next(40)] == [r["i"] for r in b.next(40)] != [r["i"] for r in make(2).next(40)]
    saved = copy.deepcopy(a.state_dict())
    ahead = [r["i"] for r in a.next(40)]
    b = make(1)
    b.load_state_dict(saved)
    assert [r["i"] for r in b.next(40)] == ahead


@pytest.mark.parametrize("kw", [dict(mode="field", field="level", start=1.0),
                                dict(mode="pass_rate", pass_rate=lambda r: 0.0)])
def test_ranks_draw_disjoint_shards(kw):
    rows = _rows()
    drawn = [set(_levels(Curriculum(rows, 3, rank, 2, **kw).next(500))) for rank in (0, 1)]
    assert drawn[0].isdisjoint(drawn[1]) and drawn[0] | drawn[1] == set(range(100))


def test_row_sampler_at_is_a_no_op():
    rows = [{"i": i} for i in range(10)]
    a, b = RowSampler(rows, 3), RowSampler(rows, 3)
    b.at(50)
    assert a.next(25) == b.next(25)


def test_the_keys_reach_the_curriculum_a_run_draws_from():
    """The run's draws (controllers.build_controllers) are a Curriculum with the keys' c0 and floor, and
    T = data.curriculum_steps, or half of train.steps when that is null (T = 40 // 2 = 20); without a curriculum, plain
    epochs. The pass-rate curriculum reads the run's pass rates."""
    from posttrain.train.controllers import build_controllers

    def draws(*overrides):
        cfg, _ = config.load("grpo_math", ["train.steps=40", *overrides])
        return build_controllers(cfg, _rows(), 0, 1, pad_id=0)

    assert type(draws().draws) is RowSampler
    field = draws("data.curriculum=field", "data.difficulty_field=level", "data.curriculum_start=0.3").draws
    assert (field.mode, field.start, field.ramp_steps) == ("field", 0.3, 20)
    assert draws("data.curriculum=field", "data.difficulty_field=level", "data.curriculum_steps=7").draws.ramp_steps == 7
    made = draws("data.curriculum=pass_rate", "data.curriculum_floor=0.1")
    assert (made.draws.mode, made.draws.floor, made.draws.ramp_steps) == ("pass_rate", 0.1, 20)
    assert made.pass_rates is not None and made.draws.pass_rate == made.pass_rates.get


@pytest.mark.parametrize("overrides, message", [
    (["data.curriculum=easy"], "data.curriculum: unknown 'easy'; known: none, field, pass_rate"),
    (["data.curriculum=field"], "data.difficulty_field: required with data.curriculum=field"),
    (["data.curriculum_start=0"], "data.curriculum_start: must be in (0, 1]"),
    (["data.curriculum_start=1.5"], "data.curriculum_start: must be in (0, 1]"),
    (["data.curriculum_floor=0"], "data.curriculum_floor: must be in (0, 1]"),
    (["data.curriculum_floor=2"], "data.curriculum_floor: must be in (0, 1]"),
    (["data.curriculum_steps=0"], "data.curriculum_steps: must be ≥ 1 or null"),
])
def test_bad_curriculum_config_names_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        config.load("grpo_math", overrides)
    assert message in str(err.value)
