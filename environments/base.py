"""The environment interface and its registry: what a multi-turn rollout asks of a task.

An episode starts from a row: `reset` gets it, and the model sees the row's prompt as a single-turn run would. Then the model and the environment take turns. The model writes until a stop
token or one of the environment's `stop` strings (a tool call's closing tag); `step` reads that turn (its text and
its token ids) and answers with a `Reply`: text for the next message, reward parts, and whether the episode is done.
`posttrain.sources.episodes` runs the turns for a whole batch on any rollout engine that takes stop sequences, and
keeps the trajectory as one token sequence: the model's tokens exactly as sampled, the environment's rendered and
appended, with a mask that tells them apart.

`step` runs in a bounded worker process (posttrain.core.bounded), within `env.timeout_s`: an environment that raises
or hangs gives the model an error message as its reply, never a crash. So an environment must pickle; its state goes
to the worker and comes back with the reply.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from posttrain.core.bounded import BoundedPool
from posttrain.core.registry import Registry


@dataclass
class Reply:
    """The environment's answer to one model turn."""

    text: str = ""  # the next message's content: rendered by the chat template (a `role` message), else by `render`
    reward: float = 0.0  # this turn's reward, added to the episode's (the judge's outcome reward and the turns')
    info: dict[str, float] = field(default_factory=dict)  # counts to log (summed over the episode; mean in metrics)
    done: bool = False  # the episode ends here (the model's turn is its last)
    role: str = "user"  # the message's role under a chat template ("tool" where the template knows it)


class Environment:
    """A task the model acts in, one instance per episode. Subclasses set `stop` and implement `step`.

    Args:
        settings: the `env` config group (its `max_turns`, budgets and time-out are the driver's; an environment reads
            what it needs, e.g. nothing).
    """

    name: str = ""
    stop: tuple[str, ...] = ()
    """Strings that end a model turn besides the stop tokens, kept in the turn (e.g. "</calc>")."""

    def __init__(self, settings=None):
        self.settings = settings

    def reset(self, row: dict) -> None:
        """Starts an episode on `row` (the data row whose prompt the model sees first): what a task keeps of it, e.g.
        a game's starting position. By default nothing."""

    def render(self, text: str) -> str:
        """A reply's text as it is appended without a chat template; by default as is."""
        return text

    def step(self, text: str, ids: list[int], ended: bool) -> Reply:
        """Answers the model's turn: its text (special tokens left out), its token ids, and whether it ended with a
        stop token (the model closing its answer) rather than a `stop` string."""
        raise NotImplementedError


ENVIRONMENTS = Registry("environment", "env.name")  # name -> Environment subclass
POOL = BoundedPool()  # every environment step runs here; its workers start on the first step and persist


register, get = ENVIRONMENTS.register, ENVIRONMENTS.find


def run_step(env_cls: type[Environment], item: tuple) -> tuple[Environment, Reply]:
    """One step in a pool worker: (environment, text, ids, ended) -> (environment, reply). The environment comes
    back with the reply, so what it keeps carries to the episode's next turn. Called as
    `functools.partial(run_step, env_cls)`, so that a worker imports the environment's module when it loads the
    function, before any step's time-out runs."""
    env, text, ids, ended = item
    assert isinstance(env, env_cls)
    return env, env.step(text, ids, ended)
