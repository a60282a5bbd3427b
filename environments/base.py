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

import functools
from dataclasses import dataclass, field

from posttrain.core.bounded import BoundedPool
from posttrain.core.errors import ConfigError
from posttrain.core.files import import_file, load_entry
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


register = ENVIRONMENTS.register
PREFIX = "posttrain_custom_env"  # the module name of an environment's file: PREFIX_<hash of its path>


@dataclass(frozen=True)
class FileClass:
    """An environment class in a local file, as it travels to a pool worker: the file's path and the class's name.
    Unpickled, it imports the file (so the environments that follow it, instances of the class, unpickle too)."""

    path: str
    name: str

    def load(self) -> type[Environment]:
        return getattr(import_file(self.path, PREFIX), self.name)

    def __reduce__(self):
        return _arrive, (self.path, self.name)


def _arrive(path: str, name: str) -> FileClass:
    ref = FileClass(path, name)
    ref.load()
    return ref


def get(name: str) -> type[Environment]:
    """The environment `env.name` names: a registered name, or `path/to/file.py:Class`, a subclass of Environment in
    a local Python file (imported now, and in each pool worker before its first step).

    Raises:
        ConfigError: naming env.name, for an unknown name, a missing file, one that fails to import, or no
            Environment of that name in it.
    """
    if ":" not in str(name):
        return ENVIRONMENTS.find(name)
    file, cls_name, cls = load_entry(name, "env.name", PREFIX, "a registered name or path/to/file.py:Class "
                                     f"(got {name!r})")
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ConfigError(f"env.name: '{file}' defines no subclass of posttrain.environments.Environment named "
                          f"{cls_name!r}")
    cls.__posttrain_file__ = FileClass(file, cls_name)
    return cls


def step_function(env_cls: type[Environment]) -> functools.partial:
    """`run_step` for the environments of `env_cls`, as the pool takes it: with the class itself (pickled by its
    module's name) or, for a class from a file, its `FileClass`."""
    source = env_cls.__dict__.get("__posttrain_file__")
    return functools.partial(run_step, source if isinstance(source, FileClass) else env_cls)


def run_step(env_cls: type[Environment] | FileClass, item: tuple) -> tuple[Environment, Reply]:
    """One step in a pool worker: (environment, text, ids, ended) -> (environment, reply). The environment comes
    back with the reply, so what it keeps carries to the episode's next turn. Called through `step_function`, so
    that a worker imports the environment's module (or file) when it loads the function, before any step's
    time-out runs."""
    env, text, ids, ended = item
    assert isinstance(env, env_cls.load() if isinstance(env_cls, FileClass) else env_cls)
    return env, env.step(text, ids, ended)
