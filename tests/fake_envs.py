"""Environments for tests/test_environments.py and tests/test_bad_input_envs.py in a module of their own: a pool
worker imports it (and nothing as heavy as torch) before it runs their steps."""

import string
import threading
import time

from posttrain.core.errors import ConfigError
from posttrain.environments import Environment, Reply


class Faulty(Environment):
    """Raises at every step, or hangs for a minute when the turn says "hang"."""

    stop = ("</calc>",)

    def step(self, text, ids, ended):
        if "hang" in text:
            time.sleep(60)
        raise RuntimeError("the tool broke")


class Metered(Environment):
    """Rewards each tool call with a tenth of its text's length and the closing turn with 0.5: per-turn rewards
    whose placement on the tokens a test can check."""

    stop = ("</calc>",)

    def step(self, text, ids, ended):
        if ended:
            return Reply(reward=0.5, done=True)
        return Reply(text="ok", reward=len(text) / 10)


# For tests/test_bad_input_envs.py, named by this file's path (env.name=.../fake_envs.py:Class) as a user names
# theirs. Every character of the embedded tokenizer ends a turn, so each of the model's turns, however random, is read
# by the environment after its first token.
EVERY_CHARACTER = tuple(string.digits + string.ascii_letters + string.punctuation + " \n")


class Answers(Environment):
    """Replies "ok" to every turn: the base of those below, which fail in one place each."""

    stop = EVERY_CHARACTER

    def step(self, text, ids, ended):
        return Reply(text="ok", done=ended)


class FailsToStart(Answers):
    def __init__(self, settings=None):
        raise RuntimeError("no licence for this tool")


class RefusesHere(Answers):
    """Refuses in a line of its own, as an environment whose tool this machine lacks does."""

    def __init__(self, settings=None):
        raise ConfigError("env.name: this machine has no abacus (pip install abacus)")


class SlowToStart(Answers):
    def __init__(self, settings=None):
        time.sleep(60)


class Unpicklable(Answers):
    """Holds a lock, which does not pickle: it could never travel to a worker."""

    def __init__(self, settings=None):
        super().__init__(settings)
        self.lock = threading.Lock()


class StopIsAString(Answers):
    stop = ("</guess>")  # the comma left out: a string, whose characters would each end a turn


class ResetRaises(Answers):
    def reset(self, row):
        raise ValueError("no board for this row")


class ResetHangs(Answers):
    def reset(self, row):
        time.sleep(30)


class NotAReply(Answers):
    def step(self, text, ids, ended):
        return 42


class NaNReward(Answers):
    reward = float("nan")

    def step(self, text, ids, ended):
        return Reply(text="ok", reward=self.reward, done=ended)


class InfReward(NaNReward):
    reward = float("-inf")
