"""A Python tool: the model writes `<python>print(37*48)</python>` and the environment answers with what it printed.

Each call runs in a sandboxed process of its own (`environments/sandbox.py`), within 80% of `env.timeout_s`: by
default in a bubblewrap jail (`env.sandbox=bwrap`: namespaces of its own, no network, a read-only view of the system's
software, one writable directory, an unprivileged user, a seccomp filter), behind the interpreter's own checks (no
imports but math-like modules, no files outside its directory, no processes) and limits on memory, time and output.
Where the jail cannot be set up, the environment is refused in one line at its start, unless `env.sandbox=none`. Whatever the code does, the reply is text: its output, the exception's last line
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

    def __init__(self, settings=None):
        super().__init__(settings)
        self.isolation = getattr(settings, "sandbox", "bwrap")
        sandbox.require(self.isolation)  # on a machine without the jail: one line, before any episode

    def render(self, text: str) -> str:
        return f"<output>{text}</output>"

    def step(self, text: str, ids: list[int], ended: bool) -> Reply:
        call = None if ended else _CALL.search(text)
        if call is None:
            return Reply(done=True)
        timeout_s = 0.8 * self.settings.timeout_s if self.settings is not None else 4.0
        result = sandbox.run(call.group(1), timeout_s=timeout_s, memory_mb=self.memory_mb,
                             max_output=self.max_output, isolation=self.isolation)
        return Reply(text=result.text, info={"calls": 1.0, "call_errors": float(not result.ok)})
