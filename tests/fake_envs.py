"""Environments for tests/test_environments.py in a module of their own: a pool worker imports it (and nothing as
heavy as torch) before it runs their steps."""

import time

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
