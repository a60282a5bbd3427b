"""The environment interface and its registry: what a multi-turn rollout asks of a task.

An episode starts from a row: `reset` gets it, and the model sees the row's prompt as a single-turn run would. Then
the model and the environment take turns. The model writes until a stop token or one of the environment's `stop`
strings (a tool call's closing tag); `step` reads that turn (its text and its token ids) and answers with a `Reply`:
text for the next message, reward parts, and whether the episode is done.
`posttrain.sources.episodes` runs the turns for a whole batch on any rollout engine that takes stop sequences, and
keeps the trajectory as one token sequence: the model's tokens exactly as sampled, the environment's rendered and
appended, with a mask that tells them apart.

Every call into an environment runs in a bounded worker process (posttrain.core.bounded), within `env.timeout_s`:
its creation and `reset` as an episode starts (`run_start`), each `step` and the rendering of its reply (`run_step`).
One that raises, hangs, or answers with something other than a `Reply` with a finite reward gives the model an error
message as its reply, never a crash (posttrain.sources.episodes). So an environment must pickle; its state goes to
the worker and comes back with the reply. `check` creates one before a run starts, so that a class that cannot be
created, or whose instances do not pickle, is refused in one line instead.
"""

from __future__ import annotations

import functools
import math
import pickle
from collections.abc import Mapping
from dataclasses import dataclass, field

from posttrain.core.bounded import BoundedPool, InProcess
from posttrain.core.errors import ConfigError, UserError
from posttrain.core.files import import_file, load_entry, names_a_file
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
GIVEN: dict[str, type[Environment]] = {}  # classes given from Python (posttrain.Run's env=), by their env.name
GIVEN_PREFIX = "python:"


def given(env_cls) -> str:
    """Makes the Environment subclass `env_cls`, given from Python, known as `python:<its class name>`, the env.name
    that names it (config.yaml records it so); its instances then run in this process (`pool_for`), not in the pool's
    workers, which could not import a class defined in a notebook or a script.

    Raises:
        ConfigError: `env_cls` is not a subclass of Environment.
    """
    if not (isinstance(env_cls, type) and issubclass(env_cls, Environment)):
        raise ConfigError(f"env: give a subclass of posttrain.environments.Environment (the class, not an instance), "
                          f"got {env_cls!r}")
    name = GIVEN_PREFIX + env_cls.__name__
    GIVEN[name] = env_cls
    return name


def pool_for(env_cls) -> BoundedPool | InProcess:
    """Where `env_cls`'s calls run: the bounded workers (`POOL`); this process for a class given from Python."""
    return InProcess() if any(env_cls is cls for cls in GIVEN.values()) else POOL


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
        ConfigError: naming env.name, for an unknown name, a file named without its class, a missing file, one that
            fails to import, no Environment of that name in it, or `stop` strings that are not a tuple of strings.
    """
    if str(name).startswith(GIVEN_PREFIX):
        if name not in GIVEN:
            raise ConfigError(f"env.name: {name} names an environment class given from Python (posttrain.Run's env=), "
                              "and none of that name was given")
        cls = GIVEN[name]
    elif not names_a_file(name):
        cls = ENVIRONMENTS.find(name)
    else:  # the file's loader says what is wrong with the entry, a missing `:Class` included
        file, cls_name, cls = load_entry(name, "env.name", PREFIX, "a registered name or path/to/file.py:Class")
        if not (isinstance(cls, type) and issubclass(cls, Environment)):
            raise ConfigError(f"env.name: '{file}' defines no subclass of posttrain.environments.Environment named "
                              f"{cls_name!r}")
        cls.__posttrain_file__ = FileClass(file, cls_name)
    # `stop = ("</guess>")` is a string: each of its characters would end a turn
    if not (isinstance(cls.stop, (tuple, list)) and all(isinstance(s, str) and s for s in cls.stop)):
        raise ConfigError(f"env.name: {cls.__name__}'s stop must be a tuple of strings, each ending a turn, such as "
                          f"(\"</guess>\",) (got {type(cls.stop).__name__} {cls.stop!r})")
    return cls


def _source(env_cls: type[Environment]) -> type[Environment] | FileClass:
    """`env_cls` as it travels to a pool worker: the class itself (pickled by its module's name) or, for a class
    from a file, its `FileClass`."""
    source = env_cls.__dict__.get("__posttrain_file__")
    return source if isinstance(source, FileClass) else env_cls


def _class(source: type[Environment] | FileClass) -> type[Environment]:
    return source.load() if isinstance(source, FileClass) else source


def describe(env_cls: type[Environment]) -> str:
    """How a one-line error names `env_cls`: its class and file, or its registered name."""
    source = _source(env_cls)
    if isinstance(source, FileClass):
        return f"{source.name} from '{source.path}'"
    return env_cls.name or env_cls.__name__


def start_function(env_cls: type[Environment]) -> functools.partial:
    """`run_start` for the environments of `env_cls`, as the pool takes it (see `step_function`)."""
    return functools.partial(run_start, _source(env_cls))


def run_start(env_cls: type[Environment] | FileClass, item: tuple) -> Environment:
    """An episode's start in a pool worker: (settings, row) -> the environment, created with `settings` and reset on
    `row`."""
    settings, row = item
    env = _class(env_cls)(settings)
    env.reset(row)
    return env


def check(env_cls: type[Environment], settings, pool: BoundedPool | None = None) -> None:
    """Creates one environment of `env_cls` in a pool worker with the run's `settings`, within `settings.timeout_s`,
    and pickles it both ways, as each step will: once, before a run samples.

    Raises:
        ConfigError: naming env.name and the class (and its file), where creating it raised or hung, or an instance
            does not pickle; or the class's own one-line refusal (a UserError from `__init__`), as it is.
    """
    outcome = (pool or pool_for(env_cls)).map(functools.partial(_create, _source(env_cls)), [settings],
                                              settings.timeout_s)[0]
    if not outcome.ok:
        why = f"{outcome.error}, env.timeout_s" if outcome.timed_out else outcome.error
        raise ConfigError(f"env.name: {describe(env_cls)}: creating an instance failed ({why})")
    kind, said = outcome.value
    if kind == "refused":
        raise ConfigError(said)
    if kind == "created":
        try:
            pickle.dumps(pickle.loads(said))  # it came back; it must go out again too
            return
        except Exception as err:
            said = f"{type(err).__name__}: {err}"
    raise ConfigError(f"env.name: {describe(env_cls)}: an instance does not pickle ({said}), and an environment "
                      "travels to a worker process and back with each step")


def _create(env_cls: type[Environment] | FileClass, settings) -> tuple[str, bytes | str]:
    """`check`'s call in a pool worker: ("created", the environment pickled), ("unpicklable", why) (which the
    worker's own pickling of it would report as its creation failing), or ("refused", the message of the UserError
    its `__init__` raised: a one-line refusal of its own, such as a tool this machine lacks)."""
    try:
        env = _class(env_cls)(settings)
    except UserError as err:
        return "refused", str(err)
    try:
        return "created", pickle.dumps(env)
    except Exception as err:
        return "unpicklable", f"{type(err).__name__}: {err}"


def step_function(env_cls: type[Environment], render: bool = False) -> functools.partial:
    """`run_step` for the environments of `env_cls`, as the pool takes it: with the class itself (pickled by its
    module's name) or, for a class from a file, its `FileClass`; `render`: render each reply's text too (where no
    chat template renders it)."""
    return functools.partial(run_step, _source(env_cls), render=render)


def run_step(env_cls: type[Environment] | FileClass, item: tuple, render: bool = False) -> tuple:
    """One step in a pool worker: (environment, text, ids, ended) -> (environment, reply, rendered, fault). The
    environment comes back with the reply, so what it keeps carries to the episode's next turn; `rendered` is
    `render(reply.text)` with `render` (else None); `fault` says why the reply breaks `step`'s contract (then `reply`
    is None), else None. Called through `step_function`, so that a worker imports the environment's module (or file)
    when it loads the function, before any step's time-out runs."""
    env, text, ids, ended = item
    assert isinstance(env, _class(env_cls))
    reply = env.step(text, ids, ended)
    fault = _fault(reply)
    if fault is not None:
        return env, None, None, fault
    reply = Reply(text=reply.text, reward=float(reply.reward), info={k: float(v) for k, v in reply.info.items()},
                  done=bool(reply.done), role=reply.role)
    return env, reply, env.render(reply.text) if render else None, None


def _fault(reply) -> str | None:
    """Why `reply` is not what `step` returns (a `Reply` of text, a finite reward, finite counts), or None."""
    if not isinstance(reply, Reply):
        return f"step returned {type(reply).__name__}, not Reply"
    if not isinstance(reply.text, str) or not isinstance(reply.role, str):
        return f"step returned a Reply whose text or role is not a string ({reply.text!r:.40}, {reply.role!r:.40})"
    if not isinstance(reply.info, Mapping):
        return f"step returned a Reply whose info is {type(reply.info).__name__}, not a dict"
    for what, value in (("a reward of", reply.reward), *((f"info[{k!r}] =", v) for k, v in reply.info.items())):
        try:
            number = float(value)
        except (TypeError, ValueError, OverflowError):
            return f"step returned {what} {value!r:.40}, not a number"
        if not math.isfinite(number):  # a NaN reward would train to a NaN loss
            return f"step returned {what} {number}"
    return None
