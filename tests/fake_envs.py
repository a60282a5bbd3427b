"""Environments for tests/test_environments.py in a module of their own: a pool worker imports it (and nothing as
heavy as torch) before it runs their steps."""

import time

from posttrain.environments import Environment


class Faulty(Environment):
    """Raises at every step, or hangs for a minute when the turn says "hang"."""

    stop = ("</calc>",)

    def step(self, text, ids, ended):
        if "hang" in text:
            time.sleep(60)
        raise RuntimeError("the tool broke")
