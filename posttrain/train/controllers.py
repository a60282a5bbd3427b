"""The run's controllers: the state that changes as a run trains, each a small object with `state_dict` and
`load_state_dict`, owned by the loop, saved in every checkpoint and handed to whoever reads it.

- `draws`: the row draws (posttrain.data: RowSampler, or a Curriculum that widens its pool step by step);
- `pass_rates`: each prompt's running pass rate (per-difficulty group sizes, the pass-rate curriculum);
- `temperature`: the online source's sampling temperature (fixed, or adapted by its stage);
- `elite`: the elite replay pool;
- `beta`: β under `train.beta_schedule`, applied to a copy of the plugin's config each step;
- `early_stop`: early stopping's best evaluation and patience (`eval.stop_on`).

The validated config never changes: a step reads the controllers, not config fields that something rewrote.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from posttrain.core.errors import ConfigError
from posttrain.core.schedules import KLWeight, SamplingTemperature
from posttrain.data import RowSampler
from posttrain.data.curriculum import Curriculum
from posttrain.data.difficulty import PassRates, tracks_pass_rates
from posttrain.schema import RunConfig
from posttrain.stages import ElitePool
from posttrain.train.evaluation import EarlyStop


@dataclass(eq=False)
class Controllers:
    draws: RowSampler
    early_stop: EarlyStop
    temperature: SamplingTemperature
    pass_rates: PassRates | None = None
    elite: ElitePool | None = None
    beta: KLWeight | None = None

    def at(self, step: int, draws: bool = True) -> None:
        """Before step `step` (1-based): the curriculum's pool (unless `draws` is False: a producer making batches
        ahead moves it to each batch's step) and β follow the step."""
        if draws:
            self.draws.at(step - 1)  # the steps done before this one
        if self.beta is not None:
            self.beta.at(step)

    def algorithm(self, algorithm: Any) -> Any:
        """The plugin's config for this step: the validated one, with β from its schedule when there is one."""
        return algorithm if self.beta is None else self.beta.apply(algorithm)

    def items(self) -> list[tuple[str, Any]]:
        """(name, controller) of those this run has."""
        return [(f.name, getattr(self, f.name)) for f in fields(self) if getattr(self, f.name) is not None]

    def state_dict(self) -> dict:
        return {name: c.state_dict() for name, c in self.items()}

    def load_state_dict(self, state: dict) -> None:
        """Every controller of this run back from `state`; one that `state` lacks is an error, never a silent
        fresh start."""
        for name, c in self.items():
            if name not in state:
                raise ConfigError(f"resume: the checkpoint holds no state for the run's {name} controller (written "
                                  "by another version of posttrain, or another config)")
            c.load_state_dict(state[name])


def build_controllers(cfg: RunConfig, train_rows: list[dict], rank: int, world: int, pad_id: int) -> Controllers:
    """The controllers `cfg` asks for, at their starting state (`pad_id` pads the elite pool's widened rows)."""
    d, r, t = cfg.data, cfg.rollout, cfg.train
    pass_rates = PassRates(d.prompt_field) if tracks_pass_rates(cfg) else None
    draws = RowSampler(train_rows, cfg.seed, rank, world)
    if d.curriculum != "none":
        draws = Curriculum(train_rows, cfg.seed, rank, world, mode=d.curriculum, field=d.difficulty_field,
                           start=d.curriculum_start, ramp_steps=d.curriculum_steps or max(1, t.steps // 2),
                           pass_rate=pass_rates and pass_rates.get, floor=d.curriculum_floor)
    temperature = SamplingTemperature(r.temperature, target=r.target_entropy, low=r.min_temperature,
                                      high=r.max_temperature)
    beta = None
    if t.beta_schedule != "constant":
        beta = KLWeight(cfg.algorithm.beta, schedule=t.beta_schedule, values=t.beta_values, total=t.steps)
    return Controllers(draws=draws, early_stop=EarlyStop(cfg.eval), temperature=temperature, pass_rates=pass_rates,
                       elite=ElitePool(r.elite_pool, pad_id) if r.elite_pool else None, beta=beta)
