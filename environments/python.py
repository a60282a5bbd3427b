"""A Python tool: the model writes `<python>print(37*48)</python>` and the environment answers with what it printed.

Each call runs in a sandboxed process of its own (`environments/sandbox.py`: no imports but math-like modules, no
files outside a fresh directory, no processes, no network, capped memory, time and output), within 80% of
`env.timeout_s`. Whatever the code does, the reply is text: its output, the exception's last line
(`ZeroDivisionError: division by zero`), or why it was stopped (`error: stopped after 4 s`). Without a chat template
the reply follows the call as `<output>...</output>`. A turn that ends with the model's stop token, or without a call,
ends the episode; so does a call left unanswered when `env.max_turns` runs out.
"""

from __future__ import annotations

import re

from posttrain.environments import sandbox
from posttrain.environments.base import Environment, Reply, register

OPEN, CLOSE = "<python>", "</python>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE) + r"\s*$", re.S)


@register("python")
class Python(Environment):
    """Answers a turn that ends in `<python>CODE</python>` with what CODE printed; any other turn ends the episode."""

    stop = (CLOSE,)
    memory_mb = 256
    max_output = 1000

    def render(self, text: str) -> str:
        return f"<output>{text}</output>"

    def step(self, text: str, ids: list[int], ended: bool) -> Reply:
        call = None if ended else _CALL.search(text)
        if call is None:
            return Reply(done=True)
        timeout_s = 0.8 * self.settings.timeout_s if self.settings is not None else 4.0
        result = sandbox.run(call.group(1), timeout_s=timeout_s, memory_mb=self.memory_mb,
                             max_output=self.max_output)
        return Reply(text=result.text, info={"calls": 1.0, "call_errors": float(not result.ok)})
