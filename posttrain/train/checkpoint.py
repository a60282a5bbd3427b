"""Checkpoints: the policy as an ordinary Hugging Face directory every `train.save_every` steps, and at the end.

Under LoRA the directory holds the adapter (loadable by transformers and peft, naming its base by path), and with
`model.lora.merge` the base with the adapter merged in is also written to merged_model/.
"""

from __future__ import annotations

from pathlib import Path


class Checkpoints:
    """Saves `engine`'s policy under `root`: checkpoints/step_N every `every` steps (0: never), model/ at the end
    (and merged_model/ when a LoRA run asks for it).

    Every process calls it; the backend decides who writes (all processes take part when weights are sharded).
    """

    def __init__(self, root: Path, every: int):
        self.root, self.every = root, every

    def after_step(self, engine, step: int) -> None:
        if self.every and step % self.every == 0:
            save_model(engine, self.root / "checkpoints" / f"step_{step}")

    def final(self, engine) -> Path:
        save_model(engine, self.root / "model")
        if engine.cfg.model.lora.r and engine.cfg.model.lora.merge:
            engine.backend.save(engine.policy, engine.tokenizer, self.root / "merged_model", merged=True)
        return self.root / "model"


def save_model(engine, path: Path) -> None:
    """The policy as an ordinary Hugging Face directory (safetensors + tokenizer)."""
    engine.backend.save(engine.policy, engine.tokenizer, path)
