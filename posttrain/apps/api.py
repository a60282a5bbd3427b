"""posttrain from Python: `posttrain.Run` and `posttrain.run`, what `posttrain run` itself calls.

    import posttrain

    summary = posttrain.run("grpo_math", {"train.steps": 20})           # as `posttrain run recipe=grpo_math ...`

    with posttrain.Run("grpo_math", {"train.steps": 20}, rewards=[brevity]) as run:
        for metrics in run.steps():                                    # one step at a time, each step's metrics
            print(metrics["step"], metrics["reward"])
        summary = run.finish()                                         # evaluation after, model/, summary.json
        run.metrics_table()                                            # every step's metrics (a pandas DataFrame)

A run is the CLI's run: the same recipe and overrides make the same config.yaml, the same steps and the same bytes
(tests/test_api.py checks it), and its output directory is laid out as docs/outputs.md says. What Python adds, none of
it written to a file: reward functions as callables (`rewards=`, called as TRL calls its reward functions), rows as a
list of dicts or a `datasets.Dataset` (`data=`, `test_data=`), the model and tokenizer while the run is open, and the
metrics as a table. docs/python.md walks through it.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from numbers import Real
from pathlib import Path
from typing import Any

from posttrain.core.errors import ConfigError
from posttrain.core.heap import limit_malloc_arenas

Rewards = Callable | list | tuple | Mapping | None


def prepare_process() -> None:
    """What a posttrain process sets before it imports torch or transformers (the CLI's first step)."""
    limit_malloc_arenas()  # before torch starts a thread
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything posttrain loads is local
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # transformers stays quiet (no progress bars, errors only) through its environment, read when it is first
    # imported: importing it here would cost every command a second, `posttrain recipes` and bad input too.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def dotlist(overrides: Mapping[str, Any] | list[str] | tuple[str, ...] | None) -> list[str]:
    """Overrides as the CLI's `key=value` strings: a list of them as it is, or a dict of dotted keys to Python values
    (each written as YAML, which JSON is: `{"train.steps": 5, "output_dir": "runs/x"}`)."""
    if overrides is None:
        return []
    if isinstance(overrides, Mapping):
        for key in overrides:
            if not isinstance(key, str):
                raise ConfigError(f"overrides: keys are dotted config keys like 'train.steps', got {key!r}")
        return [f"{key}={json.dumps(value)}" for key, value in overrides.items()]
    if isinstance(overrides, str) or not all(isinstance(item, str) for item in overrides):
        raise ConfigError("overrides: give a dict of dotted keys to values, or a list of 'key=value' strings")
    return list(overrides)


def reward_functions(rewards: Rewards) -> dict[str, tuple[Callable, float]]:
    """Python reward functions by name -> (function, weight): a function (weight 1), a list of them, or a dict of
    name -> function or (function, weight). A function's name is its `__name__`."""
    if rewards is None:
        return {}
    if callable(rewards):
        rewards = [rewards]
    items = rewards.items() if isinstance(rewards, Mapping) else \
        [(getattr(fn, "__name__", None), fn) for fn in rewards]
    out = {}
    for name, entry in items:
        fn, weight = entry if isinstance(entry, tuple) else (entry, 1.0)
        if not callable(fn):
            raise ConfigError(f"rewards: {name or entry!r} is not a function")
        if not isinstance(name, str) or not name or name == "<lambda>":
            raise ConfigError("rewards: a lambda has no name to log its reward under; give a dict {name: function}")
        if isinstance(weight, bool) or not isinstance(weight, Real):
            raise ConfigError(f"rewards.{name}: weight must be a number, got {weight!r}")
        if name in out:
            raise ConfigError(f"rewards: two reward functions are named {name!r}; give a dict {{name: function}}")
        out[name] = (fn, float(weight))
    return out


class Run:
    """A training run from Python: the CLI's `posttrain run`, steppable.

    Args:
        recipe: a recipe's name (`posttrain recipes`) or a YAML file's path.
        overrides: a dict of dotted keys to values (`{"train.steps": 5}`), or the CLI's `key=value` strings.
        rewards: reward functions, beside the config's rewards (set `rewards.accuracy=0` to train on yours alone): a
            function, a list of them, or a dict of name -> function or (function, weight). Each is called in this
            process on a batch, `fn(completions, prompts=..., **row_fields)`, as TRL calls reward functions (GSM8K's
            rows give `question` and `answer`), and returns one float, or None where it cannot score, per completion.
            Logged as `reward/<name>`.
        data, test_data: training and held-out rows, each a list of dicts or a `datasets.Dataset` (fields as
            `data.preset` names them, gsm8k's by default); config.yaml then says `data.path: python:data`. Without
            `test_data`, the last eval.num_problems rows of `data` are held out.
        env: an environment for multi-turn episodes, a subclass of `posttrain.environments.Environment` (the class:
            one instance is made per episode), defined anywhere, a notebook included; config.yaml then says
            `env.name: python:<class name>`. Its instances run in this process, with no time bound (docs/environments.md
            has the interface; a class in a file, `env.name=path/to/file.py:Class`, runs in bounded worker processes).
        quiet: no progress bar or status lines.

    The config is checked as the CLI checks it (a `posttrain.UserError` naming the key); the models load at `start`
    (or the first `step`). Leave the run by `finish`, which ends it, or `close` (the `with` block's end), which
    releases its processes and files, finished or not (an unfinished run stays in `<output_dir>.partial`).
    """

    def __init__(self, recipe: str | os.PathLike = "grpo_math",
                 overrides: Mapping[str, Any] | list[str] | None = None, *, rewards: Rewards = None,
                 data: Any = None, test_data: Any = None, env: type | None = None, quiet: bool = False):
        from posttrain import config
        from posttrain.schema import PYTHON_ROWS

        prepare_process()  # the CLI's environment defaults: everything local, transformers quiet (unless set)
        overrides = dotlist(overrides)
        self.given = {key: rows for key, rows in (("data.path", data), ("data.test_path", test_data))
                      if rows is not None}
        for key in self.given:
            if any(item.startswith(f"{key}=") for item in overrides):
                given_as = "data" if key == "data.path" else "test_data"
                raise ConfigError(f"{key}: given twice, as an override and as rows ({given_as}=); give one")
        placed = [f"{key}={PYTHON_ROWS[key]}" for key in self.given]
        if env is not None:  # known as python:<class name>, run in this process (posttrain.environments.given)
            from posttrain import environments

            placed.append(f"env.name={environments.given(env)}")
        if self.given and not any(item.startswith("data.preset=") for item in overrides):
            placed.append("data.preset=gsm8k")  # question / answer rows, unless the overrides name another layout
        self.cfg, self.resolved = config.load(str(recipe), overrides + placed)
        self.rewards = reward_functions(rewards)
        if self.rewards and config.algorithm_of(self.cfg).source != "online":
            raise ConfigError(f"rewards: {config.algorithm_of(self.cfg).name} does not sample, so it scores no reward; "
                              "reward functions are for the online methods (posttrain recipes)")
        self.quiet = quiet
        self.training = None  # posttrain.train.loop.Training, from `start`
        self.metrics: list[dict] = []  # every step's metrics, as metrics.jsonl holds them
        self.summary: dict | None = None  # summary.json's content, once finished
        # the primitives' state: whether they drive the run, the batch last prepared, the gradients not yet applied,
        # and whether the rollout engine has handed its memory back for the update
        self._driven, self._prepared, self._pending, self._released = False, None, [], False
        self.sample_metrics: dict = {}  # the last `sample`'s statistics: rewards, generated tokens, stages

    def start(self) -> Run:
        """Sets the run up, as `posttrain run` does before its first step: the output directory refused if it holds a
        run, the rows read and checked, the embedded model warmed up (cached) or a GGUF file converted (cached), the
        models loaded, the evaluation before. Called by the first `step` when not called before."""
        if self.training is not None:
            return self
        from posttrain.apps import warmup
        from posttrain.models import gguf
        from posttrain.schema import cache_root
        from posttrain.sources import run_splits
        from posttrain.train.loop import Training
        from posttrain.train.rundir import RunDir

        cfg, quiet = self.cfg, self.quiet
        RunDir(cfg.output_dir, cfg.overwrite, cfg.resume)  # a run in output_dir is refused before any work
        splits, summary = run_splits(cfg, self.given), {}
        if cfg.env.name is not None:  # an environment that cannot start (the Python tool without its jail, say) is
            from posttrain import environments  # one line now, not after the warm-up

            environments.check(environments.get(cfg.env.name), cfg.env)
        teacher_path = warmup.teacher(cfg)  # model.teacher_path, checked; None where the method has no teacher
        model_path = cfg.model.path
        if model_path is None:
            model_path, summary["warmup"] = warmup.ensure(cfg, quiet=quiet)
            if teacher_path is None and warmup.needs_teacher(cfg):  # the embedded teacher, built once and cached
                teacher_path, summary["teacher"] = warmup.ensure_teacher(cfg, quiet=quiet)
        elif gguf.is_gguf(model_path):  # read once into a model directory in the cache (posttrain/models/gguf.py)
            model_path = gguf.converted(model_path, "model.path", cache_root(cfg), quiet=quiet)
            summary["gguf"] = {"file": str(Path(cfg.model.path).resolve()), "converted": str(model_path)}
        self.training = Training(cfg, self.resolved, model_path=model_path, splits=splits, summary=summary,
                                 quiet=quiet, teacher_path=teacher_path, rewards=self.rewards)
        return self

    @property
    def done(self) -> bool:
        """Whether every step has run (or the run stopped early)."""
        return self.training is not None and self.training.done

    def step(self) -> dict:
        """Trains one step (logged, evaluated and checkpointed as the config says) and returns its metrics."""
        if self._driven:
            raise ConfigError("step: this run is driven by sample, forward_backward and optim_step; go on with them "
                              "(save writes the model), or start another Run")
        metrics = self.start().training.step()
        self.metrics.append(metrics)
        return metrics

    def steps(self) -> Iterator[dict]:
        """The steps left, one at a time: each trained when the loop asks for it, its metrics yielded."""
        while not self.start().done:
            yield self.step()

    def finish(self) -> dict | None:
        """Ends the run: the steps left, the evaluation after, model/, summary.json, the output directory moved into
        place; then its processes and files released. Returns the summary (None on a training process that is not
        the first, under torchrun). A run driven by the primitives ends with the steps its loop took (metrics.jsonl
        holds none of them: their metrics are what the primitives returned)."""
        if self.summary is not None:
            return self.summary
        if self._driven:  # the loop's steps are the run's: none is added, the rest ends it as a run ends
            if self._pending:
                raise ConfigError("finish: gradients are pending; call optim_step first")
            self.training.step_done, self.training.stopped = self.training.engine.steps_done, True
        for _ in self.steps():
            pass
        try:
            self.summary = self.training.finish()
        finally:
            self.close()
        return self.summary

    def train(self) -> dict | None:
        """The whole run, as `posttrain run` does it: `finish` from wherever it stands."""
        return self.finish()

    def evaluate(self) -> dict:
        """The held-out evaluation of the policy as it is now (greedy accuracy; pass@k and maj@k with eval.k)."""
        return self._open().engine.evaluate()

    @property
    def model(self):
        """The policy as a Hugging Face model (under LoRA, the adapted model), while the run is open."""
        from posttrain.models import lora

        engine = self._open().engine
        return lora.hf_model(engine.backend.generation_model(engine.policy))

    @property
    def tokenizer(self):
        return self._open().engine.tokenizer

    @property
    def output_dir(self) -> Path:
        """Where the run writes: `<output_dir>.partial` while it runs, output_dir once finished."""
        if self.summary is not None:
            return Path(self.summary["output_dir"])
        return self._open().out

    def metrics_table(self):
        """Every step's metrics so far: a pandas DataFrame, one row per step, where pandas is installed; else the
        list of dicts."""
        try:
            import pandas
        except ImportError:
            return list(self.metrics)
        return pandas.DataFrame(self.metrics)

    # -- primitives: a loop of your own -------------------------------------------------------------------------------
    # What Tinker's training and sampling clients offer, on the run's own engine: the loop that `step` runs, in parts.
    # Each `sample` begins a step (the policy version it samples with is the steps before it); `optim_step` ends it.

    def sample(self):
        """The next batch of the run's data source, as `step` draws it: for an online method, train.batch_size prompts
        drawn as the recipe draws them and algorithm.group_size completions of each from the current policy (a
        `posttrain.core.batch.Batch`: `input_ids`, `response_ids`, `mask`, `reward` [B], `group` [B], `version` [B],
        and `rollout_logp` where the rollout engine reports the sampler's log-probs); for an offline one, its rows.
        `texts(batch)` decodes the completions; `sample_metrics` holds the batch's statistics (the rewards' means,
        the tokens generated, what the source's stages did), as a step's metrics do."""
        engine = self._loop()
        batch, self.sample_metrics = engine.sample()
        return batch

    def score(self, batch):
        """`batch` with what the run's method scores besides the policy (Tinker's forward, for the frozen models):
        `ref_logp` (the reference's per-token log-probs, at the sampling temperature), `teacher_logp`, `old_logp`
        (the policy's before this step's update) and the critic's values, each where the method needs it."""
        engine = self._loop()
        with engine.backend.autocast():
            return engine.scored(batch)

    def texts(self, batch) -> list[str]:
        """The completions of `batch` as text (special tokens dropped)."""
        from posttrain.data import completion_texts

        return completion_texts(self._open().engine.tokenizer, batch)

    def forward_backward(self, batch, loss: str | Callable | None = None, **method_config) -> dict[str, float]:
        """Adds the gradient of a loss on `batch` to the policy's (none is applied until `optim_step`). Returns the
        loss and the method's metrics, averaged over processes.

        Args:
            batch: from `sample`.
            loss: None or the run's method's name: the run's own GC (its plugin, as the recipe configures it, the
                batch scored and prepared as `step` does: reference and old log-probs, advantages); another registered
                method's name (`posttrain recipes`, algorithm.name): its GC, with its default config updated by
                `method_config`, where it reads what the run scores and its data source is the run's; or a function
                `loss(batch, logp)` of the policy's per-token log-probs `logp` [b, R] (differentiable), returning a
                per-token loss [b, R] (or that and a dict of metrics), aggregated as train.loss_agg says and
                back-propagated through the policy, micro-batch by micro-batch (a micro-batch is a `Batch` too).
        """
        import torch

        from posttrain import algorithms, config

        engine = self._loop()
        if not self._released:  # the rollout engine's memory, handed back by optim_step
            engine.rollout.release()
            self._released = True
        if callable(loss):
            metrics = engine.accumulate(batch, engine.totals(batch), loss_fn=loss)
        else:
            plugin = engine.plugin if loss in (None, engine.plugin.name) else algorithms.REGISTRY.find(loss, key="loss")
            algorithm = engine.algorithm if plugin is engine.plugin else \
                config.build(plugin.Config, dict(method_config), "loss")
            gives = engine.needs | {"old_logp"}  # the policy itself, scored before the update, the run can always give
            if plugin.source != engine.plugin.source or not plugin.needs(algorithm) <= gives:
                raise ConfigError(f"loss: {plugin.name} needs {', '.join(sorted(plugin.needs(algorithm))) or 'nothing'}"
                                  f" of batches from the {plugin.source} source; this run's {engine.plugin.name} gives "
                                  f"{', '.join(sorted(gives))} of batches from the {engine.plugin.source} source")
            with engine.method(plugin, algorithm):
                if self._prepared is None or self._prepared[0] is not batch or self._prepared[1] is not plugin:
                    self._prepared = (batch, plugin, *engine.prepared(batch))
                _, _, prepared, prep = self._prepared
                metrics = {**prep, **engine.accumulate(prepared, engine.totals(prepared))}
        metrics.pop("micro_batches")
        self._pending.append(metrics)
        return {k: float(engine.backend.reduce(torch.as_tensor(v, device=engine.backend.device).float(), "mean"))
                for k, v in sorted(metrics.items())}

    def optim_step(self) -> dict[str, float]:
        """Applies the gradients of the `forward_backward` calls since the last step: clipped to train.max_grad_norm,
        AdamW at the learning rate train.lr_schedule gives this step (a non-finite loss or norm skips it, as in a run),
        then the rollout engine gets the new weights. Returns the gradient norm, the learning rate used and whether
        the update was skipped."""
        import torch

        engine = self._loop()
        if not self._pending:
            raise ConfigError("optim_step: no gradient to apply; call forward_backward first")
        lr = engine.policy.scheduler.get_last_lr()[0]
        loss = sum(m["loss"] for m in self._pending)
        metrics = engine.apply({"loss": loss})
        self._pending, self._prepared = [], None
        engine.skipped_in_a_row = engine.skipped_in_a_row + 1 if engine.skipped else 0
        engine.skipped_steps += bool(engine.skipped)
        engine.rollout.restore()
        self._released = False
        engine.sync_rollout()
        out = {"lr": lr, "skipped": float(engine.skipped)}
        out.update({k: float(torch.as_tensor(v)) for k, v in metrics.items() if k != "loss"})
        return out

    def save(self, path: str | os.PathLike) -> Path:
        """The policy as it is now, as an ordinary Hugging Face directory at `path` (under LoRA, its adapter), the
        tokenizer with it: what a run's model/ holds."""
        from posttrain.train.checkpoint import save_model

        save_model(self._open().engine, Path(path))
        return Path(path)

    def save_state(self, path: str | os.PathLike) -> Path:
        """Everything the loop needs to go on exactly from here, at `path`: the model, the trained parameters as
        trained, AdamW and the schedule, the steps done, the random generators and the data source's position (the
        run's own checkpoint format, docs/resume.md). `load_state` in a run of the same config puts it back."""
        from posttrain.train import checkpoint as checkpoints

        engine, path = self._open().engine, Path(path)
        if self._pending:
            raise ConfigError("save_state: gradients are pending; call optim_step first")
        state = {"wall_seconds": 0.0, "model_path": str(Path(self.training.model_path).resolve()),
                 "evaluations": {}, "skipped": [engine.skipped_steps, engine.skipped_in_a_row],
                 "config": self.resolved}
        return checkpoints.Checkpoints(path.parent, every=0).write(engine, engine.steps_done, state, at=path)

    def load_state(self, path: str | os.PathLike) -> None:
        """Puts back what `save_state` wrote at `path` (a checkpoints/step_N directory of a run works too), once it is
        known to continue this run exactly: the same start model, config and process count."""
        from posttrain.train import checkpoint as checkpoints

        engine, path = self._loop(), Path(path)
        found, _ = checkpoints.find(str(path), path)
        state = checkpoints.check(found, self.training.model_path, self.resolved, engine.backend.world_size)
        engine.resume_at(state["step"], tuple(state["skipped"]))
        checkpoints.restore(found, engine)

    def _loop(self):
        """The engine, for the primitives; marks the run as driven by them (its steps are the loop's own)."""
        training = self._open()
        self._driven = True
        return training.engine

    def _open(self):
        if self.training is None:
            if self.summary is not None:
                raise ConfigError("the run has finished; its model is in model/ of its output directory")
            self.start()
        return self.training

    def close(self) -> None:
        """Releases the run's rollout workers, producer and files; idempotent."""
        if self.training is not None:
            training, self.training = self.training, None
            training.close()

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        from posttrain.config import algorithm_of

        state = "finished" if self.summary is not None else "open" if self.training is not None else "not started"
        return (f"posttrain.Run({algorithm_of(self.cfg).name}, output_dir={self.cfg.output_dir!r}, {state}, "
                f"{len(self.metrics)} steps here)")


def run(recipe: str | os.PathLike = "grpo_math", overrides: Mapping[str, Any] | list[str] | None = None,
        **kwargs) -> dict | None:
    """A whole run, as `posttrain run recipe=RECIPE key=value ...`: returns what summary.json holds. Keywords as
    `Run`'s."""
    return Run(recipe, overrides, **kwargs).train()


def report(summary: dict) -> list[str]:
    """What `posttrain run` prints at the end of a run: the held-out accuracy before and after, and where the
    results are."""
    lines = []
    if "eval_before" in summary and "eval_after" in summary:
        before, after = summary["eval_before"], summary["eval_after"]
        lines.append(f"held-out accuracy: {before['accuracy']:.3f} -> {after['accuracy']:.3f}"
                     f" ({before['num_problems']} problems, greedy)")
        if "k" in after and after["k"] == before.get("k"):
            k = after["k"]
            lines.append(f"held-out pass@{k}: {before[f'pass@{k}']:.3f} -> {after[f'pass@{k}']:.3f}, maj@{k}: "
                         f"{before[f'maj@{k}']:.3f} -> {after[f'maj@{k}']:.3f} ({after['n']} samples per problem)")
    lines.append(f"done in {summary['wall_seconds']:.1f}s; results in {summary['output_dir']}")
    return lines


def print_report(summary: dict, file=None) -> None:
    for line in report(summary):
        print(line, file=file or sys.stdout)
