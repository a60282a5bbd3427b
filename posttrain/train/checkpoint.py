"""Checkpoints: every `train.save_every` steps, everything a run needs to continue bit for bit; the final model.

`checkpoints/step_N/` is an ordinary Hugging Face model directory (under LoRA, the adapter) with the training state
beside the weights:

- `training_state/policy/` (and `critic/`): the trained parameters exactly as trained (fp32 master weights, whatever
  the saved model's dtype), and the AdamW and learning-rate schedule states, as the backend writes them: one file
  under `ddp`; each process's shards under `fsdp2` (torch.distributed.checkpoint) and `zero2`/`zero3` (DeepSpeed's
  checkpoint), never gathered, so that a model too large for one device saves and resumes as it trains;
- `process_<rank>.pt`: each process's random generators (python, numpy, torch, CUDA) and its controllers
  (posttrain.train.controllers: its row draws, pass rates, elite pool, temperature, β, early stopping), and under
  `rollout.placement=separate` the batches sampled ahead but not yet trained on, and the workers' generator streams;
- `trainer_state.json`: the step, the evaluations and wall time so far, the start model and the config;
- `manifest.json`, written last: every other file's size, and the sha256 of those up to `HASHED_BYTES` (the run and
  process states, the configs and tokenizer; the large weight and optimizer files are checked by size alone, as
  hashing them would read every checkpoint twice).

A checkpoint is written into `checkpoints/.step_N.tmp/` and renamed to `step_N` only once every file is in it, so a
kill at any moment leaves the previous checkpoints and at most a temporary directory, never a torn `step_N`
(a rename is atomic; a kill does not lose what was written to the page cache, so nothing is fsynced).
`train.keep_checkpoints` bounds how many are kept, newest first.

What happens to a checkpoint after it is written (a copy cut short, a full disk, a file removed or emptied by hand) is
found on resume: a checkpoint is resumed from only once its files match its manifest (`damage`). A damaged newest
checkpoint is skipped for the newest that verifies, with a line saying so; with none, or a damaged one named by
`resume=`, the run is refused in one line naming the file. A checkpoint of an older posttrain, without a manifest, is
checked for its run state and process files, and an error loading the rest is one line naming the file too.

What is built at the start (the reference model, RFT's samples, DPO's pairs) is not saved: a resumed run builds it
again from the same start model and seed, then puts the saved state back (`restore`). A run resumes with the
backend and process count that wrote the checkpoint; every process must see the checkpoint directory.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from posttrain.core.errors import ConfigError, UserError
from posttrain.core.faults import crash_point  # noqa: F401 - the loop calls it from here
from posttrain.core.files import file_sha256
from posttrain.models.lora import BASE_COPY
from posttrain.rollout.workers import one_line

TRAINING_STATE, RUN_STATE, MANIFEST = "training_state", "trainer_state.json", "manifest.json"
HASHED_BYTES = 64 * 2**20  # files up to this size are hashed into the manifest, larger ones recorded by size
# What the loop reads of a run state (`check`, `run`): one without them is damaged.
RUN_STATE_KEYS = ("step", "world_size", "model_path", "config", "wall_seconds", "evaluations", "skipped")
STEP_DIR = re.compile(r"step_(\d+)")
# Keys a resumed run may change: how long it runs and how often it saves. Not eval.*: eval.num_problems sets the
# held-out rows (and so the training rows) without data.test_path, and sampled evaluation draws from the generators.
MAY_CHANGE = ("description", "output_dir", "overwrite", "resume", "report_to", "train.steps", "train.save_every",
              "train.keep_checkpoints", "warmup.cache_dir",
              "ray.address")


class Checkpoints:
    """Writes `engine`'s checkpoints under `root`/checkpoints every `every` steps (0: never), keeping the newest
    `keep` (0: all), and the final model to `root`/model (and merged_model/ when a LoRA run asks for it).

    Every process calls it; the backend decides who writes the model (all take part when weights are sharded).
    """

    def __init__(self, root: Path, every: int, keep: int = 0):
        self.root, self.every, self.keep = root, every, keep
        self.protected: Path | None = None  # a checkpoint pruning keeps (early stopping's best)

    def due(self, step: int) -> bool:
        """Whether `train.save_every` writes a checkpoint after `step`."""
        return bool(self.every) and step % self.every == 0

    def path(self, step: int) -> Path:
        return self.root / "checkpoints" / f"step_{step}"

    def write(self, engine, step: int, run_state: dict, at: Path | None = None) -> Path:
        """checkpoints/step_`step` (or the directory `at`), whole or not at all; `run_state` is what the loop needs
        back (JSON)."""
        backend, final = engine.backend, at or self.path(step)
        tmp = final.with_name(f".{final.name}.tmp")
        if backend.is_main:
            shutil.rmtree(tmp, ignore_errors=True)  # a write a kill interrupted
            tmp.mkdir(parents=True)
        backend.barrier()
        save_model(engine, tmp)
        crash_point("checkpoint", step)  # fault injection for the kill tests: a torn temporary directory
        engine.save_training_state(tmp / TRAINING_STATE)  # every process takes part
        with engine.pipeline_state() as pipeline:  # batches made ahead, with the controllers as they left them
            torch.save({"rng": rng_state(), "controllers": engine.controllers.state_dict(), "pipeline": pipeline},
                       tmp / f"process_{backend.rank}.pt")
        backend.barrier()
        if backend.is_main:
            (tmp / RUN_STATE).write_text(json.dumps({"step": step, "world_size": backend.world_size,
                                                     "backend": backend.name, **run_state}, indent=1))
            write_manifest(tmp)  # last: what a resumed run checks every other file against
            shutil.rmtree(final, ignore_errors=True)  # a step_N a resumed run is about to write again
            tmp.rename(final)
            if at is None:
                self.prune()
        backend.barrier()
        return final

    def prune(self) -> None:
        """Removes all but the newest `keep` complete checkpoints, and the protected one."""
        if self.keep:
            for old in complete(self.root / "checkpoints")[: -self.keep]:
                if self.protected is not None and old.name == self.protected.name:
                    continue
                gone = old.with_name(f".{old.name}.old")  # renamed first, so a kill never leaves half a step_N
                old.rename(gone)
                shutil.rmtree(gone)

    def final(self, engine) -> Path:
        save_model(engine, self.root / "model")
        lora = engine.cfg.model.lora
        if lora.r and lora.merge:
            engine.backend.save(engine.policy, engine.tokenizer, self.root / "merged_model", merged=True)
        if lora.r and engine.cfg.model.path is None and engine.backend.is_main:
            # The adapter's base is the embedded model, warmed up in the cache: a copy of it (a few MB) keeps the
            # run directory evaluable when moved or when the cache is cleared (`posttrain.models.lora.adapter_base`).
            shutil.copytree(engine.model_path, self.root / BASE_COPY, dirs_exist_ok=True)
        return self.root / "model"


def save_model(engine, path: Path) -> None:
    """The policy as an ordinary Hugging Face directory (safetensors + tokenizer)."""
    engine.backend.save(engine.policy, engine.tokenizer, path)


def complete(parent: Path) -> list[Path]:
    """The complete checkpoints (`step_N` with its trainer_state.json) under `parent`, oldest first."""
    found = [(int(m[1]), p) for p in parent.glob("step_*") if (m := STEP_DIR.fullmatch(p.name))
             and (p / RUN_STATE).is_file()]
    return [p for _, p in sorted(found)]


def find(resume: bool | str, staging: Path, overwrite: bool = False) -> tuple[Path | None, list[str]]:
    """The checkpoint `resume` names: with true, the newest one of the unfinished run in `staging` that verifies
    (`damage`); with auto, the same when there is a complete one (and overwrite is off), else None, a fresh start;
    with false, None. Also returns a notice for each newer checkpoint skipped as damaged.

    Raises:
        ConfigError: naming `resume`, when there is none (true), when every one is damaged (naming the newest's
            damaged file), or the one named is incomplete, damaged or not resumable.
    """
    if resume is False:
        return None, []
    if resume == "auto":
        found = complete(staging / "checkpoints")
        if overwrite or not found:
            return None, []
        resume = True
    skipped = []
    if resume is True:
        found = complete(staging / "checkpoints")
        if not found:
            raise ConfigError(f"resume: no complete checkpoint in '{staging / 'checkpoints'}' to continue from "
                              "(a run writes them every train.save_every steps)")
        for path in reversed(found):
            if (why := damage(path)) is None:
                break
            skipped.append((path, why))
        else:
            path, why = skipped[0]
            raise ConfigError(f"resume: '{path}' is damaged ({why}), and so is every older checkpoint there; "
                              "overwrite=true starts afresh")
        notices = [f"{p} is damaged ({why}); skipped for {path}" for p, why in skipped]
    else:
        path, notices = Path(resume), []
        if not (path / RUN_STATE).is_file():
            raise ConfigError(f"resume: '{path}' is not a complete checkpoint (no {RUN_STATE}); give a "
                              "checkpoints/step_N directory")
        if (why := damage(path)) is not None:
            raise ConfigError(f"resume: '{path}' is damaged ({why}); give another checkpoints/step_N")
    if not (path / TRAINING_STATE).is_dir():
        raise ConfigError(f"resume: '{path}' has no {TRAINING_STATE}/ directory, so nothing to continue from: the "
                          "model only, or a checkpoint of an older posttrain (one training_state.pt), which this one "
                          "does not read")
    return path, notices


def write_manifest(path: Path) -> None:
    """`path`/manifest.json: the size of every file under `path`, and the sha256 of those up to HASHED_BYTES."""
    files = {}
    for f in sorted(path.rglob("*")):
        if f.is_file() and f.name != MANIFEST:
            size = f.stat().st_size
            files[f.relative_to(path).as_posix()] = {"bytes": size, **({"sha256": file_sha256(f)}
                                                                      if size <= HASHED_BYTES else {})}
    (path / MANIFEST).write_text(json.dumps({"files": files}, indent=1))


def damage(path: Path) -> str | None:
    """What is wrong with the checkpoint at `path`, naming the file ("process_0.pt is missing"), or None when it
    verifies: every file of its manifest there, with its size and hash. One written by an older posttrain, without a
    manifest: its run state readable, with what the loop reads, and every process's state there, not empty (the rest
    is checked as it loads, `restore`)."""
    if (path / MANIFEST).is_file():
        try:
            files = json.loads((path / MANIFEST).read_text())["files"]
            if not all(isinstance(e, dict) and isinstance(e.get("bytes"), int) and isinstance(n, str)
                       and not Path(n).is_absolute() and ".." not in Path(n).parts for n, e in files.items()):
                raise TypeError("an entry is not a file's name in the checkpoint and its size")
        except (ValueError, KeyError, TypeError, AttributeError):  # edited by hand, or cut short
            return f"{MANIFEST} cannot be read"
        for name, entry in files.items():
            f = path / name
            if not f.is_file():
                return f"{name} is missing"
            if (size := f.stat().st_size) != entry["bytes"]:
                return f"{name} has {size:,} bytes of the {entry['bytes']:,} written"
            if "sha256" in entry and file_sha256(f) != entry["sha256"]:
                return f"{name} is not what was written (its sha256 differs)"
        return None
    try:
        run_state = json.loads((path / RUN_STATE).read_text())
    except (OSError, ValueError) as err:
        return f"{RUN_STATE} cannot be read ({type(err).__name__})"
    if not isinstance(run_state, dict) or (missing := [k for k in RUN_STATE_KEYS if k not in run_state]):
        return f"{RUN_STATE} lacks {', '.join(missing) if isinstance(run_state, dict) else 'its keys'}"
    if not isinstance(run_state["world_size"], int) or run_state["world_size"] < 1:
        return f"{RUN_STATE} has no process count (world_size {run_state['world_size']!r})"
    for rank in range(run_state["world_size"]):
        f = path / f"process_{rank}.pt"
        if not f.is_file() or not f.stat().st_size:
            return f"{f.name} is {'empty' if f.is_file() else 'missing'}"
    return None


def check(path: Path, model_path: Path, resolved: dict, world_size: int) -> dict:
    """The run state of the checkpoint at `path` (step, evaluations, wall time), once it is known to continue this
    run exactly.

    Raises:
        ConfigError: the checkpoint comes from another start model, config or process count.
    """
    run_state = json.loads((path / RUN_STATE).read_text())
    if run_state["world_size"] != world_size:
        raise ConfigError(f"resume: '{path}' was written by {run_state['world_size']} processes; this run has "
                          f"{world_size} (each process's data position, generators and shards are saved)")
    if run_state["model_path"] != str(Path(model_path).resolve()):
        raise ConfigError(f"resume: '{path}' continues a run that started from '{run_state['model_path']}', "
                          f"not '{Path(model_path).resolve()}'")
    changed = differences(run_state["config"], resolved)
    changed.sort(key=lambda change: change[0] != "algorithm.name")  # another method first: the rest follows from it
    if changed:
        key, old, new = changed[0]
        if key == "algorithm.name":
            raise ConfigError(f"resume: {key} was {old!r} in the run being resumed, now {new!r}: a {new} run cannot "
                              f"continue a {old} run's checkpoint; give another output_dir, or overwrite=true to "
                              "start afresh")
        raise ConfigError(f"resume: {key} was {old!r} in the run being resumed, now {new!r}; only these may change: "
                          f"{', '.join(MAY_CHANGE)}")
    steps = resolved["train"]["steps"]
    if steps < run_state["step"]:
        raise ConfigError(f"train.steps: {steps} is below step {run_state['step']} of the checkpoint resumed from "
                          f"('{path}'); give train.steps={run_state['step']} or more, or overwrite=true to start "
                          "afresh")
    return run_state


def restore(path: Path, engine) -> None:
    """Puts the checkpoint at `path` back into `engine`: trained models, optimizers, schedules, controllers and
    random generators (`check` first)."""
    backend = engine.backend
    with loading(path, TRAINING_STATE + "/"):
        engine.load_training_state(path / TRAINING_STATE)
    with loading(path, f"process_{backend.rank}.pt"):
        mine = torch.load(path / f"process_{backend.rank}.pt", map_location="cpu", weights_only=False)
    if "controllers" not in mine:
        raise ConfigError(f"resume: '{path}' was written by an older posttrain, whose checkpoints kept the run's "
                          "changing state in the data source; start the run afresh")
    engine.controllers.load_state_dict(mine["controllers"])
    if engine.producer is not None:  # the batches made ahead and not trained on: trained first
        engine.producer.load_state_dict(mine["pipeline"])
    set_rng_state(mine["rng"])
    engine.sync_rollout()  # vLLM started from the start model's files


@contextlib.contextmanager
def loading(path: Path, name: str):
    """Turns an error loading `name` of the checkpoint at `path` (one an older posttrain wrote, without a manifest to
    verify it against, or damaged past what the manifest checks) into one line naming the file.

    Raises:
        ConfigError: naming the checkpoint, the file and the error.
    """
    try:
        yield
    except UserError:
        raise
    except Exception as err:  # noqa: BLE001 - whatever the format's reader raises on a damaged file
        raise ConfigError(f"resume: '{path}' is damaged ({name} cannot be read: {one_line(err)[:200]}); give "
                          "another checkpoints/step_N, or overwrite=true to start afresh") from None


def differences(old: dict, new: dict, prefix: str = "") -> list[tuple[str, object, object]]:
    """(key, old value, new value) of every key whose value differs, but for the keys of MAY_CHANGE."""
    out = []
    for key in sorted(set(old) | set(new), key=str):
        name = f"{prefix}{key}"
        if any(name == m or (m.endswith(".") and name.startswith(m)) for m in MAY_CHANGE):
            continue
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += differences(a, b, f"{name}.")
        elif a != b:
            out.append((name, a, b))
    return out


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
