"""`posttrain eval MODEL_DIR [recipe=NAME] [key=value ...]`: greedy accuracy, and with `eval.k` pass@k and maj@k,
of a model on a recipe's held-out problems (the embedded task unless `data.*` says otherwise), through the same
evaluation and rollout engine a run uses. Writes eval.json with one record per problem.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from posttrain.core.errors import UserError
from posttrain.core.outputs import check_writable

DEFAULT_RECIPE = "grpo_math"  # its data, template, rollout settings and evaluation budget


def main(model: str, items: list[str], *, output: str = "eval.json", quiet: bool = False,
         base: str | None = None) -> dict:
    """Evaluates `model`, writes `output` (never over an existing file) and returns what it wrote. A LoRA adapter
    directory (a LoRA run's model/) is evaluated on its base, as the run did: `base`, else the one the run names
    (`posttrain.models.lora.adapter_base`)."""
    from posttrain import config, judge, rollout
    from posttrain.backends.ddp import DDP
    from posttrain.data import prompt_texts, uses_chat
    from posttrain.models import gguf, lora
    from posttrain.models.loading import is_adapter, load, stop_token_ids
    from posttrain.schema import cache_root, weights_dtype
    from posttrain.sources import run_splits
    from posttrain.sources.episodes import episodes_for
    from posttrain.train.evaluation import evaluate
    from posttrain.train.tracking import Progress

    recipes = [i.split("=", 1)[1] for i in items if i.startswith("recipe=")]
    if len(recipes) > 1:
        raise UserError("recipe: give at most one recipe=NAME_OR_PATH")
    out = Path(output)
    if out.is_dir():
        raise UserError(f"-o: '{out}' is a directory; give the report's file name, e.g. -o {out / 'eval.json'}")
    if out.exists():
        raise UserError(f"{out}: already exists; remove it or give another with --output")
    check_writable(out, "-o")  # before the evaluation, not after it; missing directories are made when writing
    adapter = Path(model) if is_adapter(model) else None
    if base is not None and adapter is None:
        raise UserError(f"--base: '{model}' is a whole model, not a LoRA adapter; --base names an adapter's base")
    weights = lora.adapter_base(adapter, base) if adapter is not None else Path(model)  # what the config loads
    overrides = [i for i in items if not i.startswith("recipe=")]
    cfg, _ = config.load(recipes[0] if recipes else DEFAULT_RECIPE, overrides + [f"model.path={weights}"])
    given = {"model": str(Path(model).resolve())}
    if gguf.is_gguf(model):  # read once into a model directory in the cache (posttrain/models/gguf.py)
        model = weights = gguf.converted(model, "MODEL_DIR", cache_root(cfg), quiet=quiet)
        given["converted"] = str(weights)
    e, sampling = cfg.eval, cfg.rollout
    if e.num_problems == 0:
        raise UserError("eval.num_problems: 0 leaves nothing to evaluate")
    from transformers import set_seed

    set_seed(cfg.seed)
    rows = run_splits(cfg)[1][: e.num_problems]
    cfg, _ = config.settle_precision(cfg)  # `auto` resolved for this device
    backend = DDP(precision=cfg.train.precision)
    dtype = weights_dtype(cfg.train.precision, trained=True)
    policy, tokenizer = load(model, dtype=dtype) if adapter is None else lora.load_adapted(adapter, weights, dtype)
    uses_chat(tokenizer, cfg.data)  # chat_template=true without a template fails before any work
    policy = backend.place(policy.eval().requires_grad_(False).to(backend.device))
    n = (e.n or e.k) if e.k else 0
    engine = rollout.get(sampling.engine).start(rollout.Setup(
        policy=policy, model_path=weights, pad_id=tokenizer.pad_token_id,
        stop_ids=stop_token_ids(policy, tokenizer), sampling=sampling, precision=cfg.train.precision, seed=cfg.seed,
        max_seqs=e.batch_size * max(n, 1)))
    if adapter is not None and not engine.colocated:  # an engine with its own weights (vLLM) started from the base
        engine.load_weights(lora.merged_weights(policy))
    with Progress(len(rows), enabled=not quiet, unit="problems") as bar, backend.autocast():
        the_judge = judge.build(cfg, backend.device, with_reward_model=False, tokenizer=tokenizer)
        episodes = episodes_for(cfg.env, engine, tokenizer, cfg.data, stop_token_ids(policy, tokenizer))
        result = evaluate(engine, the_judge, tokenizer, rows, cfg.data, episodes=episodes,
                          max_new_tokens=e.max_new_tokens or sampling.max_new_tokens, batch_size=e.batch_size,
                          k=e.k, n=e.n, temperature=sampling.temperature, top_p=sampling.top_p, records=True,
                          progress=lambda done: bar.update({"step": done}))
    merged = {"adapter_base": str(weights.resolve())} if adapter is not None else {}  # the base the adapter ran on
    report = {**given, **merged, "rollout_engine": engine.name, "env": cfg.env.name,
              "chat_template": uses_chat(tokenizer, cfg.data), "answer_format": cfg.data.answer_format,
              "prompt_example": prompt_texts(rows[:1], cfg.data, tokenizer)[0],
              "temperature": sampling.temperature, "top_p": sampling.top_p, "greedy": result.pop("accuracy"), **result}
    report.pop("examples")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(json.dumps(report, indent=1))
    os.replace(tmp, out)  # whole or not at all
    return report


def summary_line(report: dict) -> str:
    """`greedy 0.362  pass@8 0.700  maj@8 0.450  (500 problems; 8 samples each at temperature 1)`, then with more
    than one K the curve: a line of K, of pass@K and of maj@K."""
    k = report.get("k")
    parts = [f"greedy {report['greedy']:.3f}"]
    if k:
        parts += [f"pass@{k} {report[f'pass@{k}']:.3f}", f"maj@{k} {report[f'maj@{k}']:.3f}"]
    tail = f"; {report['n']} samples each at temperature {report['temperature']:g}" if k else ", greedy"
    line = "  ".join(parts) + f"  ({report['num_problems']} problems{tail})"
    curve = report.get("curve") or {"K": []}
    if len(curve["K"]) < 2:
        return line
    rows = [("K", [f"{K:>6d}" for K in curve["K"]]), ("pass@K", [f"{v:6.3f}" for v in curve["pass"]]),
            ("maj@K", [f"{v:6.3f}" for v in curve["maj"]])]
    return "\n".join([line, *(f"{name:<7}" + " ".join(cells) for name, cells in rows)])
