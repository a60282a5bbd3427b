"""Multi-turn episodes (env.*): the calculator tool against hostile expressions; the Python tool's sandbox against
hostile code; the trajectory as one token sequence
whose environment tokens are masked out and whose model tokens are kept exactly as sampled; the no-drift check
catching a template that changes a token; every online method's gradient zero on the environment's tokens and the
single-turn one on the model's; GAE stepping over the environment's tokens; stop sequences in the HF decode loop;
a GRPO run in the calculator environment; bad settings refused in one line."""

from __future__ import annotations

import pytest
import torch
from cli_helpers import assert_one_line_error, posttrain_here
from fake_envs import Faulty, Metered
from helpers import objective_grad, surrogate_grad, written_out_mean

from posttrain import environments
from posttrain.core.batch import Batch, left_pad
from posttrain.core.errors import ConfigError
from posttrain.environments import Reply
from posttrain.environments.calculator import Calculator, evaluate
from posttrain.environments.python import Python
from posttrain.rollout.base import RolloutEngine
from posttrain.schema import DataConfig, EnvConfig
from posttrain.sources.episodes import Episodes

# -- the calculator --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("expression, value", [("37*48", 1776), (" 12 + 7 * (3 - 5) ", -2), ("-7 // 2", -4),
                                               ("100 % 7", 2), ("+5", 5), ("999999999999*999999999999",
                                                                          999999999998000000000001)])
def test_the_calculator_evaluates_integer_arithmetic(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize("expression, why", [
    ("2**100000000", "not integer arithmetic"),  # a power: a huge number in C, no bound checked on the way
    ("9" * 30 + "*" + "9" * 30, "more than 40 digits"),
    ("__import__('os').system('rm -rf /')", "not integer arithmetic"),
    ("().__class__.__bases__[0].__subclasses__()", "not integer arithmetic"),
    ("open('/etc/passwd').read()", "not integer arithmetic"),
    ("(lambda: 1)()", "not integer arithmetic"),
    ("x + 1", "not integer arithmetic"),
    ("1.5 * 2", "not integer arithmetic"),
    ("True + 1", "not integer arithmetic"),
    ("7 // 0", "division by zero"),
    ("7 % (3 - 3)", "division by zero"),
    ("1 +", "cannot parse"),
    ("(" * 150 + "1" + ")" * 150, "longer than 200 characters"),
    ("1" + "+1" * 120, "longer than 200 characters"),
])
def test_hostile_expressions_are_refused_with_a_reason(expression, why):
    with pytest.raises(ValueError, match=why):
        evaluate(expression)


def test_the_calculator_answers_a_call_and_ends_otherwise():
    calc = Calculator()
    reply = calc.step("so <calc>37*48</calc>", [], ended=False)
    assert (reply.text, reply.done, reply.info) == ("1776", False, {"calls": 1.0})
    reply = calc.step("<calc>1/0</calc>", [], ended=False)
    assert reply.text.startswith("error: ") and not reply.done and reply.info["call_errors"] == 1.0
    assert calc.step("the answer is 1776", [], ended=True).done
    assert calc.step("<calc>2*3</calc> then", [], ended=True).done  # a call not at the turn's end is no call
    assert calc.render("1776") == "=1776"


# -- the Python tool ----------------------------------------------------------------------------------------------
LIMIT = EnvConfig(name="python", timeout_s=1.5)  # the sandbox stops code at 80% of it: 1.2 s
OS = "import random\nos = random._os\n"  # `import os` is refused; a module that imported it hands it over


@pytest.mark.parametrize("code, says", [
    ("while True:\n    pass", "error: stopped after 1.2 s"),  # an infinite loop
    ("import os, sys, resource, posix", "ImportError: the sandbox has only the modules"),  # cached, refused too
    ("import time", "(not time)"),
    # os reached through a module that imported it: the audit hook refuses what it does
    (f"{OS}while True:\n    os.fork()", "PermissionError: not allowed in the sandbox: os.fork"),  # a fork bomb
    (f"{OS}os.system('echo hi > /tmp/x')", "not allowed in the sandbox: os.system"),
    ("import subprocess", "ImportError: the sandbox has only the modules"),
    ("import socket\nsocket.create_connection(('example.com', 80))", "(not socket)"),
    ("import ctypes", "(not ctypes)"),
    ("print(open('/etc/passwd').read())", "its own directory only, not /etc/passwd"),
    ("print(open('../../etc/hostname').read())", "its own directory only, not ../../etc/hostname"),
    (f"{OS}print(os.listdir('/'))", "its own directory only, not /"),
    (f"{OS}os.kill(os.getppid(), 9)", "not allowed in the sandbox: os.kill"),
    (f"{OS}os.remove('/tmp/anything')", "not allowed in the sandbox: os.remove"),
    ("print('x' * 10**8)", "error: output cut at 1000 characters"),  # huge output at once
    ("while True:\n    print('y' * 100)", "error: output cut at 1000 characters"),  # and as a flood
    ("a = [0] * 10**9", "MemoryError"),
    ("open('big', 'w').write('x' * (5 << 20))", "File too large"),
    (f"{OS}os.close(1)\nos.close(2)\nwhile True:\n    pass", "error: stopped after 1.2 s"),
    ("def f():\n    return f()\nf()", "RecursionError"),
])
def test_hostile_code_is_an_observation_never_a_hang(code, says):
    import time

    t0 = time.perf_counter()
    reply = Python(LIMIT).step(f"<python>{code}</python>", [], ended=False)
    assert says in reply.text and len(reply.text) < 1100, reply.text
    assert not reply.done and reply.info == {"calls": 1.0, "call_errors": 1.0}
    assert time.perf_counter() - t0 < LIMIT.timeout_s + 1.0


def test_the_python_tool_runs_code_in_a_directory_of_its_own():
    tool = Python(LIMIT)
    reply = tool.step("Let me compute. <python>from fractions import Fraction\nprint(37 * 48, Fraction(3, 4) * 2)"
                      "</python>", [], ended=False)
    assert (reply.text, reply.done, reply.info) == ("1776 3/2", False, {"calls": 1.0, "call_errors": 0.0})
    assert tool.step("<python>open('a.txt', 'w').write('kept')\nprint(open('a.txt').read())</python>", [],
                     ended=False).text == "kept"
    assert tool.step("<python>1 / 0</python>", [], ended=False).text == "ZeroDivisionError: division by zero"
    assert tool.step("<python>raise SystemExit(3)</python>", [], ended=False).text == "error: exit status 3"
    assert tool.step("#### 1776", [], ended=True).done and tool.step("no call", [], ended=False).done
    assert tool.render("1776") == "<output>1776</output>"


def test_a_hostile_call_through_the_environment_pool_leaves_the_pool_working():
    """As the episodes run it: a step in the bounded pool, an infinite loop inside the sandbox, and the next step."""
    import functools

    pool = environments.POOL
    step = functools.partial(environments.run_step, Python)
    calls = [(Python(LIMIT), f"<python>{code}</python>", [], False) for code in ("while True: pass", "print(6 * 7)")]
    outcomes = pool.map(step, calls, LIMIT.timeout_s + 2.0)
    assert all(o.ok for o in outcomes), outcomes
    assert [o.value[1].text for o in outcomes] == ["error: stopped after 1.2 s", "42"]


# -- episodes on a scripted engine -----------------------------------------------------------------------------------


class Scripted(RolloutEngine):
    """An engine that answers each `generate` call with the next scripted turns, one per row, as token ids; each
    turn cut at `max_new_tokens`. Its log-probs are −0.5 − 0.01·(the token's place in the turn)."""

    name, stops = "scripted", True

    def __init__(self, tokenizer, script: list[list[str | list[int]]], versions: list[int] | None = None):
        self.tokenizer, self.script, self.calls = tokenizer, list(script), []
        self.versions = versions  # the policy version each call reports, as rollout workers do; None: none

    def generate(self, prompts, n, *, max_new_tokens, temperature=1.0, top_p=1.0, greedy=False, stop=None):
        assert n == 1 and stop is not None
        turns = self.script.pop(0)
        assert len(turns) == len(prompts)
        self.calls.append((prompts, max_new_tokens, stop))
        ids = [(t if isinstance(t, list) else self.tokenizer(t, add_special_tokens=False)["input_ids"])[:max_new_tokens]
               for t in turns]
        R = max(map(len, ids))
        prompt, prompt_mask = left_pad(prompts, 0)
        response = torch.tensor([i + [0] * (R - len(i)) for i in ids])
        mask = torch.tensor([[1.0] * len(i) + [0.0] * (R - len(i)) for i in ids])
        logp = -0.5 - 0.01 * torch.arange(R).float().expand(len(ids), R) * mask
        version = torch.full((len(ids),), self.versions.pop(0)) if self.versions else None
        return Batch(input_ids=torch.cat([prompt, response], 1), attention_mask=torch.cat([prompt_mask, mask.long()], 1),
                     mask=mask, prompt_len=prompt.shape[1], rollout_logp=logp * mask, version=version)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def episodes(tokenizer, script, *, data=None, env_cls=Calculator, turns=False, **settings):
    engine = Scripted(tokenizer, script)
    env = EnvConfig(**{"name": "calculator", "check_template": True, **settings})
    eos = tokenizer.eos_token_id
    return engine, Episodes(engine, env_cls, env, tokenizer, data or DataConfig(), pad_id=tokenizer.pad_token_id,
                            stop_ids=[eos], turns=turns)


ROWS = [{"question": "12*34", "answer": "408"}, {"question": "5+6", "answer": "11"}]


def ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_an_episode_is_one_sequence_with_the_environment_masked_out(tokenizer):
    eos = tokenizer.eos_token_id
    first = ids(tokenizer, "<calc>12*34</calc>")
    script = [[first, ids(tokenizer, "11") + [eos]],  # row 0 calls the tool, row 1 answers at once
              [ids(tokenizer, "\n#### 408") + [eos]]]
    engine, ep = episodes(tokenizer, script)
    prompts = [ids(tokenizer, "Q: 12*34\n"), ids(tokenizer, "Q: 5+6\n")]
    batch, metrics = ep.generate(ROWS, prompts, 1, max_new_tokens=40)
    reply = ids(tokenizer, "=408")
    # the second call continues row 0 from its whole trajectory: prompt, its turn, the tool's reply
    assert engine.calls[1][0] == [prompts[0] + first + reply]
    assert engine.calls[0][2] == [ids(tokenizer, "</calc>")]  # the stop string, as ids
    want = first + reply + ids(tokenizer, "\n#### 408") + [eos]
    R = batch.input_ids.shape[1] - batch.prompt_len
    assert batch.response_ids[0].tolist() == want + [tokenizer.pad_token_id] * (R - len(want))
    model = [1.0] * len(first) + [0.0] * len(reply) + [1.0] * (len(want) - len(first) - len(reply))
    assert batch.mask[0].tolist() == model + [0.0] * (R - len(want))
    assert torch.equal(batch.model_tokens, batch.mask)
    assert batch.attention_mask[0, batch.prompt_len:].tolist() == [1] * len(want) + [0] * (R - len(want))
    # the sampler's log-probs of each turn where its tokens are, 0 on the environment's
    lp = batch.rollout_logp[0].tolist()
    assert lp[: len(first)] == pytest.approx([-0.5 - 0.01 * t for t in range(len(first))])
    assert lp[len(first): len(first) + len(reply)] == [0.0] * len(reply)
    assert batch.group.tolist() == [0, 1] and batch.truncated.tolist() == [False, False]
    assert metrics["env/turns"] == 1.5 and metrics["env/env_tokens"] == len(reply) / 2 and metrics["env/calls"] == 0.5


def test_an_episodes_version_is_the_oldest_that_sampled_a_turn(tokenizer):
    """Through rollout workers each turn is a request, which a newer policy may answer: the episode is as stale as
    its oldest turn; an engine that reports no version leaves it to the source."""
    eos = tokenizer.eos_token_id
    script = [[ids(tokenizer, "<calc>12*34</calc>"), ids(tokenizer, "11") + [eos]],
              [ids(tokenizer, "\n#### 408") + [eos]]]
    engine, ep = episodes(tokenizer, [list(t) for t in script])
    engine.versions = [3, 5]
    batch, _ = ep.generate(ROWS, [ids(tokenizer, "Q: 12*34\n"), ids(tokenizer, "Q: 5+6\n")], 1, max_new_tokens=40)
    assert batch.version.tolist() == [3, 3]
    engine, ep = episodes(tokenizer, [list(t) for t in script])
    assert ep.generate(ROWS, [ids(tokenizer, "a"), ids(tokenizer, "b")], 1, max_new_tokens=40)[0].version is None


def test_the_model_tokens_are_kept_as_sampled_never_retokenised(tokenizer):
    """A turn whose ids are not what its text tokenises to (an <unk> inside the call, which decoding drops, as a BPE
    model may sample a split its tokenizer would not make) stays those ids in the trajectory; the tool reads the
    text; and the no-drift check reports the position where the text's tokens part from the sampled ones."""
    eos, unk = tokenizer.eos_token_id, tokenizer.unk_token_id
    odd = ids(tokenizer, "<calc>2") + [unk] + ids(tokenizer, "*3</calc>")
    script = [[odd], [[tokenizer.convert_tokens_to_ids("6"), eos]]]
    _, ep = episodes(tokenizer, script, check_template=False)
    batch, _ = ep.generate(ROWS[:1], [ids(tokenizer, "Q\n")], 1, max_new_tokens=40)
    assert batch.response_ids[0, : len(odd)].tolist() == odd
    assert tokenizer.decode(batch.response_ids[0, len(odd): len(odd) + 2]) == "=6"
    _, ep = episodes(tokenizer, [list(t) for t in script])
    with pytest.raises(ConfigError, match=r"turn 1: .* at response token 7 \(rendered \['\*'"):
        ep.generate(ROWS[:1], [ids(tokenizer, "Q\n")], 1, max_new_tokens=40)


def test_budgets_truncate_and_the_last_turn_ends_the_episode(tokenizer):
    call = ids(tokenizer, "<calc>1+1</calc>")
    # max_turns=2: row 0 calls twice and is cut off unanswered; row 1 overruns its turn budget
    script = [[call, ids(tokenizer, "1234567890" * 2)], [call]]
    engine, ep = episodes(tokenizer, script, max_turns=2, max_turn_tokens=len(call))
    batch, metrics = ep.generate(ROWS, [ids(tokenizer, "a"), ids(tokenizer, "b")], 1, max_new_tokens=60)
    assert batch.truncated.tolist() == [True, True]
    assert int(batch.attention_mask[1, batch.prompt_len:].sum()) == len(call)  # cut at the turn budget
    assert len(engine.calls) == 2 and metrics["env/turns"] == 1.5
    # the whole response's budget: the reply that would fill it ends the episode, truncated, without it
    _, ep = episodes(tokenizer, [[call]], max_turns=3)
    batch, _ = ep.generate(ROWS[:1], [ids(tokenizer, "a")], 1, max_new_tokens=len(call) + 2)
    assert batch.truncated.tolist() == [True] and batch.response_ids.shape[1] == len(call)


def test_each_turns_reward_sits_on_its_last_token_and_the_outcome_on_the_last_turns(tokenizer):
    """rewards.process=turns: a turn's reward from the environment's reply at the turn's last token, 1.0 in turn_end
    there; the online source then adds the outcome at the last turn's, so that a row's steps sum to its reward."""
    from posttrain.stages.step_rewards import TURN_END, TURN_REWARD, outcome_on_last_turn

    eos = tokenizer.eos_token_id
    calls = [ids(tokenizer, "<calc>1</calc>"), ids(tokenizer, "<calc>22</calc>")]
    script = [[calls[0], ids(tokenizer, "7") + [eos]], [calls[1]], [ids(tokenizer, "#### 3") + [eos]]]
    _, ep = episodes(tokenizer, script, env_cls=Metered, turns=True, check_template=False)
    batch, metrics = ep.generate(ROWS, [ids(tokenizer, "a"), ids(tokenizer, "b")], 1, max_new_tokens=60)
    reply = len(ids(tokenizer, "ok"))
    first, second = len(calls[0]) - 1, len(calls[0]) + reply + len(calls[1]) - 1
    third = second + reply + len(ids(tokenizer, "#### 3")) + 1  # its stop token is the last
    assert batch.extra[TURN_END][0].nonzero().flatten().tolist() == [first, second, third]
    assert batch.extra[TURN_END][1].nonzero().flatten().tolist() == [1]
    assert batch.extra[TURN_REWARD][0, [first, second, third]].tolist() == pytest.approx([1.4, 1.5, 0.5])
    assert batch.extra[TURN_REWARD][1, 1].item() == 0.5 and batch.extra[TURN_REWARD].count_nonzero() == 4
    assert (batch.mask[batch.extra[TURN_END].bool()] == 1).all()  # every end is a model token
    assert batch.extra["env_reward"].tolist() == pytest.approx([3.4, 0.5]) and metrics["env/turns"] == 2.0
    outcome = torch.tensor([1.0, -2.0], dtype=torch.float64)
    stepped = outcome_on_last_turn(batch.extra[TURN_REWARD], batch.extra[TURN_END], outcome)
    assert stepped.sum(1).tolist() == pytest.approx((batch.extra["env_reward"] + outcome).tolist())
    assert stepped[0, third].item() == pytest.approx(1.5) and stepped[1, 1].item() == pytest.approx(-1.5)
    _, plain = episodes(tokenizer, [list(t) for t in script], env_cls=Metered, check_template=False)
    assert TURN_REWARD not in plain.generate(ROWS, [ids(tokenizer, "a"), ids(tokenizer, "b")], 1,
                                             max_new_tokens=60)[0].extra  # only when a method trains on turns


GUESS = """
from posttrain.environments import Environment, Reply


class Guess(Environment):
    \"\"\"The model guesses a number in <guess>N</guess>; the reply says higher or lower; 1.0 for the right one.\"\"\"

    stop = ("</guess>",)

    def reset(self, row):
        self.target = int(row["answer"])

    def step(self, text, ids, ended):
        if ended or "<guess>" not in text:  # the model closed its answer
            return Reply(done=True)
        guess = text.rsplit("<guess>", 1)[1].removesuffix("</guess>").strip()
        if not guess.lstrip("-").isdigit():
            return Reply(text="not a number")
        if int(guess) == self.target:
            return Reply(text="right", reward=1.0, done=True)
        return Reply(text="higher" if int(guess) < self.target else "lower")
"""


def test_an_environment_from_a_file_runs_its_steps_in_the_pool(tokenizer, tmp_path):
    """docs/environments.md's example, as `env.name=my_env.py:Guess`: its class travels to the pool's workers as a
    reference to the file, which each imports, and what an instance keeps (its target) carries between turns."""
    (tmp_path / "my_env.py").write_text(GUESS)
    name = f"{tmp_path / 'my_env.py'}:Guess"
    cls = environments.get(name)
    assert cls.__module__.startswith("posttrain_custom_env_") and issubclass(cls, environments.Environment)
    eos = tokenizer.eos_token_id
    script = [[ids(tokenizer, "<guess>5</guess>")], [ids(tokenizer, "<guess>9</guess>")],
              [ids(tokenizer, "<guess>7</guess>")]]
    engine = Scripted(tokenizer, script)
    ep = Episodes(engine, cls, EnvConfig(name=name, max_turns=4), tokenizer, DataConfig(),
                  pad_id=tokenizer.pad_token_id, stop_ids=[eos])
    batch, metrics = ep.generate([{"question": "?", "answer": "7"}], [ids(tokenizer, "Q\n")], 1, max_new_tokens=60)
    text = tokenizer.decode(batch.response_ids[0][batch.attention_mask[0, batch.prompt_len:].bool()])
    assert text == "<guess>5</guess>higher<guess>9</guess>lower<guess>7</guess>"
    assert metrics["env/reward"] == 1.0 and metrics["env/errors"] == 0.0 and metrics["env/turns"] == 3.0
    assert batch.extra["env_reward"].tolist() == [1.0] and batch.truncated.tolist() == [False]


@pytest.mark.parametrize("entry, fragment", [
    ("{dir}/none.py:Guess", "env.name: no such file"),
    ("{dir}/broken.py:Guess", "env.name: importing '{dir}/broken.py' failed (SyntaxError"),
    ("{dir}/my_env.py:Nope", "defines no subclass of posttrain.environments.Environment named 'Nope'"),
    ("{dir}/my_env.py:Reply", "named 'Reply'"),
    ("{dir}/my_env.py:not-a-class", "expected a registered name or path/to/file.py:Class"),
])
def test_a_bad_environment_file_is_a_one_line_error(tmp_path, entry, fragment):
    (tmp_path / "my_env.py").write_text(GUESS)
    (tmp_path / "broken.py").write_text("def broken(:\n")
    entry, fragment = entry.format(dir=tmp_path), fragment.format(dir=tmp_path)
    assert_one_line_error(posttrain_here("run", "recipe=grpo_math", f"env.name={entry}",
                                         f"output_dir={tmp_path / 'out'}"), fragment)
    assert not (tmp_path / "out").exists()


def test_an_environment_that_raises_or_hangs_is_an_observation(tokenizer):
    eos = tokenizer.eos_token_id
    engine = Scripted(tokenizer, [[ids(tokenizer, "<calc>1</calc>"), ids(tokenizer, "hang</calc>")],
                                  [[eos], [eos]]])
    ep = Episodes(engine, Faulty, EnvConfig(name="calculator", timeout_s=1.0), tokenizer, DataConfig(),
                  pad_id=tokenizer.pad_token_id, stop_ids=[eos])
    batch, metrics = ep.generate(ROWS, [ids(tokenizer, "a"), ids(tokenizer, "b")], 1, max_new_tokens=80)
    texts = tokenizer.batch_decode(batch.response_ids, skip_special_tokens=True)
    assert "error: the environment failed (RuntimeError: the tool broke)" in texts[0]
    assert "error: the environment failed (timed out after 1 s)" in texts[1]
    # each episode's second, last turn (EOS) is read by the environment too, and fails again
    assert metrics["env/errors"] == 4.0 and batch.truncated.tolist() == [False, False]


CHAT = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}")


def chat_tokenizer(tokenizer, template):
    import copy

    chat = copy.deepcopy(tokenizer)
    chat.chat_template = template
    return chat


def test_under_a_chat_template_the_reply_is_the_templates_rendering(tokenizer):
    chat = chat_tokenizer(tokenizer, CHAT)
    eos = chat.eos_token_id
    turn = ids(chat, "<calc>12*34</calc>")
    data = DataConfig(chat_template=True)
    _, ep = episodes(chat, [[turn], [ids(chat, "#### 408") + [eos]]], data=data)
    prompt = ids(chat, chat.apply_chat_template([{"role": "user", "content": ROWS[0]["question"]}], tokenize=False,
                                                add_generation_prompt=True))
    batch, _ = ep.generate(ROWS[:1], [prompt], 1, max_new_tokens=80)
    text = chat.decode(batch.response_ids[0], skip_special_tokens=True)
    assert text == "<calc>12*34</calc>\n<user>408\n<assistant>#### 408"
    assert batch.mask[0, len(turn):len(turn) + len("\n<user>408\n<assistant>")].sum() == 0


def test_the_no_drift_check_catches_a_template_that_changes_a_token(tokenizer):
    """A template that trims each message's content renders the model's turn " <calc>2*3</calc>" without its first
    space: the check stops at that token. The faithful template passes the same episode."""
    turn = ids(tokenizer, " <calc>2*3</calc>")
    eos = tokenizer.eos_token_id
    data = DataConfig(chat_template=True)
    prompt = ids(tokenizer, "<user>5+6\n<assistant>")
    good = chat_tokenizer(tokenizer, CHAT)
    _, ep = episodes(good, [[turn], [[eos]]], data=data)
    ep.generate(ROWS[1:], [prompt], 1, max_new_tokens=80)
    trims = chat_tokenizer(tokenizer, CHAT.replace("m['content'] }}", "m['content'] | trim }}"))
    _, ep = episodes(trims, [[turn], [[eos]]], data=data)
    with pytest.raises(ConfigError, match=r"chat template renders the conversation differently .*character 21: ' <calc>"):
        ep.generate(ROWS[1:], [prompt], 1, max_new_tokens=80)
    # plainly rendered, a tokenisation that differs from the sampled ids is caught at its position
    _, ep = episodes(tokenizer, [[turn[:1] + turn[1:]], [[eos]]])
    ep.tokenizer = Retokenised(tokenizer)
    with pytest.raises(ConfigError, match=r"env.check_template: turn 1: .* at response token 0"):
        ep.generate(ROWS[1:], [ids(tokenizer, "Q")], 1, max_new_tokens=80)


class Retokenised:
    """A tokenizer whose encoding of a text begins differently (a merge across a turn's edge, as BPE makes)."""

    def __init__(self, tokenizer):
        self.inner = tokenizer

    def __call__(self, text, **kw):
        out = self.inner(text, **kw)
        if text.startswith("Q <calc>"):
            out["input_ids"] = out["input_ids"][:1] + [self.inner.convert_tokens_to_ids("!")] + out["input_ids"][2:]
        return out

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_evaluation_judges_the_whole_episode(tokenizer):
    """`posttrain eval` and a run's evaluations with env.name: each problem answered turn by turn, and the episode's
    text judged (here the answer written after the tool's reply)."""
    from posttrain.judge import Judge
    from posttrain.train.evaluation import evaluate

    eos = tokenizer.eos_token_id
    script = [[ids(tokenizer, "<calc>12*34</calc>"), ids(tokenizer, "#### 12") + [eos]],
              [ids(tokenizer, "\n#### 408") + [eos]]]
    _, ep = episodes(tokenizer, script)

    class Exact(Judge):
        def __init__(self):
            pass

        def correct(self, rows, texts):
            return [t.endswith("#### " + r["answer"]) for r, t in zip(rows, texts)]

        def answers(self, rows):
            return [r["answer"] for r in rows]

    result = evaluate(ep.engine, Exact(), tokenizer, ROWS, DataConfig(), max_new_tokens=40, batch_size=2,
                      records=True, episodes=ep)
    assert result["records"][0]["greedy"]["completion"] == "<calc>12*34</calc>=408\n#### 408"
    assert [r["greedy"]["correct"] for r in result["records"]] == [True, False] and result["accuracy"] == 0.5


# -- the gradient: zero on the environment's tokens, the single-turn one on the model's ------------------------------


def holed_batch(seed=0):
    """Two groups of three episodes, ragged, with environment tokens between model turns (mask 0 inside a row)."""
    g = torch.Generator().manual_seed(seed)
    B, R = 6, 8
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0, 0, 0], [1, 0, 0, 1, 0, 0, 1, 1],
                         [1, 1, 1, 0, 0, 0, 1, 0], [1, 1, 1, 1, 1, 1, 1, 1], [1, 0, 1, 0, 1, 0, 1, 0]], dtype=torch.float)
    attention = torch.ones(B, 3 + R, dtype=torch.long)
    logp = -torch.rand(B, R, generator=g) * 3
    batch = Batch(input_ids=torch.zeros(B, 3 + R, dtype=torch.long), attention_mask=attention, mask=mask, prompt_len=3,
                  group=torch.tensor([0, 0, 0, 1, 1, 1]), reward=torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0]),
                  truncated=torch.zeros(B, dtype=torch.bool), old_logp=logp + 0.1 * torch.randn(B, R, generator=g),
                  ref_logp=logp + 0.2 * torch.randn(B, R, generator=g), model_tokens=mask.clone())
    return batch, logp


@pytest.mark.parametrize("name", ["grpo", "gspo", "rloo", "reinforce_pp", "online_rft", "ppo"])
def test_environment_tokens_get_exactly_zero_gradient(name):
    """The surrogate's gradient with respect to each token's log-prob: exactly 0 on the environment's tokens; on the
    model's, what the same batch with the environment's tokens' log-probs changed gives (they enter nothing)."""
    from posttrain.algorithms import get

    plugin = get(name)
    cfg = plugin.Config()
    batch, logp = holed_batch()
    batch.extra["values"] = torch.randn(batch.mask.shape, generator=torch.Generator().manual_seed(1))  # PPO's critic
    prepared, _ = plugin.prepare(batch, cfg)
    mode = "seq_mean_token_mean"  # train.loss_agg's default: 1/|o| counts the model's tokens
    grad = surrogate_grad(plugin, prepared, logp, cfg, mode)
    env = batch.mask == 0
    assert (grad[env] == 0).all() and (grad[~env] != 0).any()
    moved = logp.masked_fill(env, -9.0)
    torch.testing.assert_close(surrogate_grad(plugin, prepared, moved, cfg, mode)[~env], grad[~env])


def test_grpo_on_episodes_is_the_written_out_objective_over_the_model_tokens():
    """GRPO's Eq. 3 + 4 written out with sums over the model's tokens only (1/|o| counting them): autograd of it
    equals the plugin's surrogate gradient, on every aggregation."""
    from posttrain.algorithms import get

    plugin = get("grpo")
    batch, logp = holed_batch(1)
    cfg = plugin.Config(beta=0.04)
    prepared, _ = plugin.prepare(batch, cfg)
    for mode in ("seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm"):
        adv = prepared.adv.reshape(-1, 1) if prepared.adv.dim() == 1 else prepared.adv

        def J(lp, adv=adv, mode=mode):
            ratio = torch.exp(lp - batch.old_logp)
            surrogate = torch.min(ratio * adv, torch.clamp(ratio, 1 - cfg.clip_eps, 1 + cfg.clip_eps) * adv)
            kl = torch.exp(batch.ref_logp - lp) - (batch.ref_logp - lp) - 1
            return written_out_mean(surrogate - cfg.beta * kl, batch.mask, mode, norm=8.0)

        torch.testing.assert_close(surrogate_grad(plugin, prepared, logp, cfg, mode, norm=8.0), objective_grad(J, logp))


def test_gae_steps_over_the_environment_tokens():
    """GAE on a row with holes equals GAE on the model's tokens alone, put back in place; 0 on the holes."""
    from posttrain.algorithms.common import gae, kl_reward

    batch, _ = holed_batch(2)
    values = torch.randn(batch.mask.shape, generator=torch.Generator().manual_seed(3))
    token_reward = kl_reward(batch.reward, batch.old_logp, batch.ref_logp, batch.mask, beta=0.05)
    assert (token_reward[batch.mask == 0] == 0).all()
    adv, returns = gae(token_reward, values, batch.mask, gamma=0.99, lam=0.9)
    for i in range(len(batch)):
        keep = batch.mask[i].bool()
        assert token_reward[i, keep][-1] != 0  # the outcome reward sits on the last model token
        a, r = gae(token_reward[i, keep][None], values[i, keep][None], torch.ones(1, int(keep.sum())), 0.99, 0.9)
        torch.testing.assert_close(adv[i, keep], a[0])
        torch.testing.assert_close(returns[i, keep], r[0])
        assert (adv[i, ~keep] == 0).all() and (returns[i, ~keep] == 0).all()


# -- the HF engine stops at a stop sequence ---------------------------------------------------------------------------


def test_the_hf_decode_loop_stops_after_a_stop_sequence(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from posttrain.rollout.hf import HFEngine

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    engine = HFEngine(model, pad_id=0, stop_ids=[2], compact_every=2)
    prompts = [[5, 6, 7], [8, 9]]
    free = engine.generate(prompts, 1, max_new_tokens=12, greedy=True)
    row = free.response_ids[0].tolist()
    stop = [row[3:5]]  # the tokens it writes 4th and 5th: the row ends there
    cut = engine.generate(prompts, 1, max_new_tokens=12, greedy=True, stop=stop)
    assert cut.response_ids[0, : int(cut.mask[0].sum())].tolist()[-2:] == row[3:5]
    assert int(cut.mask[0].sum()) <= 5 and cut.truncated[0].item() is False
    n = int(cut.mask[0].sum())
    assert cut.response_ids[0, :n].tolist() == row[:n]  # the same tokens up to where it stopped
    torch.testing.assert_close(cut.rollout_logp[0, :n], free.rollout_logp[0, :n])


# -- end to end, and refusals ----------------------------------------------------------------------------------------


def test_a_grpo_run_in_the_calculator_environment(warm_model_dir, tmp_path):
    import json

    from posttrain import config
    from posttrain.train import run

    common = [f"model.path={warm_model_dir}", "train.steps=2", "train.batch_size=2", "algorithm.group_size=4",
              "rollout.max_new_tokens=16", "eval.num_problems=4", "data.difficulty=1", "data.train_size=20",
              "data.test_size=4", "train.threads=1"]
    for out, env in (("out", ["env.name=calculator", "env.check_template=true", "env.max_turns=2"]), ("plain", [])):
        run(*config.load("grpo_math", [*common, *env, f"output_dir={tmp_path / out}"]), quiet=True)
    metrics = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and all(m["env/turns"] >= 1.0 and "env/env_tokens" in m for m in metrics)
    assert "env:\n  name: calculator" in (tmp_path / "out" / "config.yaml").read_text()
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["eval_after"]["num_problems"] == 4  # evaluated in the environment too
    # this model never calls the tool: each episode is one turn, drawn as the single-turn run draws it
    assert all(m["env/env_tokens"] == 0 for m in metrics)
    weights = [(tmp_path / out / "model" / "model.safetensors").read_bytes() for out in ("out", "plain")]
    assert weights[0] == weights[1]


def test_grpo_ps_trains_on_turns_as_steps(tmp_path):
    """rewards.process=turns: GRPO+PS's steps are an episode's model turns (as many steps a sample as turns: the call
    and the answer), rewarded by the environment's replies and the outcome, which they sum to."""
    import json

    from posttrain import Run  # `posttrain run`'s own: the warm-up, then the run

    args = ["warmup.steps=60", "train.steps=2", "train.batch_size=2", "algorithm.group_size=4", "eval.num_problems=0",
            "data.train_size=50", "data.test_size=10", "train.threads=1", "algorithm.name=grpo_ps",
            "rewards.process=turns", f"output_dir={tmp_path / 'out'}"]  # test_async's warm-up: cached once
    run = Run("grpo_tools", args, quiet=True)
    assert type(run.cfg.algorithm).__name__ == "GRPOPSConfig"
    run.train()
    metrics = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and any(m["env/turns"] > 1 for m in metrics)  # the tool was called
    for m in metrics:
        assert m["steps_per_sample"] == pytest.approx(m["env/turns"])
        assert m["step_reward"] * m["steps_per_sample"] == pytest.approx(m["reward"], abs=1e-6)


@pytest.mark.parametrize("args, fragment", [
    (["env.name=abacus"], "env.name"),
    (["recipe=sft_math", "env.name=calculator"], "env.name: episodes are sampled by the online methods"),
    (["env.name=calculator", "env.max_turns=0"], "env.max_turns: must be ≥ 1"),
    (["env.name=calculator", "env.timeout_s=0"], "env.timeout_s: must be > 0"),
    (["recipe=grpo_ps_math", "rewards.process=turns"], "rewards.process: turns are an episode's; set env.name"),
    (["recipe=grpo_ps_math", "env.name=calculator"], "rewards.process: steps reads the steps of one completion"),
    (["recipe=grpo_ps_math", "env.name=calculator", "rewards.process=none"], "set rewards.process=turns"),
    (["recipe=grpo_ps_math", "env.name=calculator", "rewards.process=turns", "rollout.elite_pool=4"],
     "rollout.elite_pool: a replayed elite would keep none of its turns' rewards"),
])
def test_bad_env_settings_are_one_line_errors(tmp_path, args, fragment):
    recipe = [a for a in args if a.startswith("recipe=")] or ["recipe=grpo_math"]
    rest = [a for a in args if not a.startswith("recipe=")]
    proc = posttrain_here("run", *recipe, *rest, f"output_dir={tmp_path / 'out'}")
    assert_one_line_error(proc, fragment)
    assert not (tmp_path / "out").exists()


def test_the_registry_knows_the_built_in_environments():
    assert environments.get("calculator") is Calculator and environments.get("python") is Python
    assert Reply() == Reply(text="", reward=0.0, info={}, done=False, role="user")  # a reply that says nothing
