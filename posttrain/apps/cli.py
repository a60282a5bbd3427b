"""The `posttrain` command line.

    posttrain run recipe=NAME_OR_PATH [key=value ...]     train
    posttrain config recipe=NAME_OR_PATH [key=value ...]  print the resolved config
    posttrain explain recipe=NAME_OR_PATH [key=value ...] what one step does: batch sizes, updates, models, memory
    posttrain recipes                                     list the recipes that ship with posttrain
    posttrain eval MODEL_DIR [eval.k=8 key=value ...]     greedy accuracy, pass@k and maj@k of a model
    posttrain estimate model=DIR_OR_PRESET gpus=N ...     per-GPU memory of SFT, DPO, PPO and GRPO
    posttrain compare RECIPE RECIPE ... [key=value ...]   run recipes on one budget and report them side by side
    posttrain reproduce figure5|figure7 [seeds=3 ...]     DeepSeekMath's Figures 5 and 7 at toy scale, with seeds
    posttrain env [--json]                                versions, device, CPU class, threads, what auto picks
    posttrain docs config|metrics                         the reference pages docs/config.md and docs/metrics.md

Exit status: 0 done, 2 bad input (one line naming the culprit), 1 internal error.
"""

from __future__ import annotations

import argparse
import os
import sys

from posttrain.apps.api import prepare_process
from posttrain.core.errors import UserError

EPILOG = """overrides are OmegaConf dotlists, e.g. algorithm.beta=0.02 train.steps=50 rollout.temperature=0.7;
`posttrain config recipe=NAME` shows every key with its value. Exit status: 0 done, 2 bad input, 1 internal error."""

# The registered methods (algorithm.name), by their papers' names; written out, as importing the plugins would cost
# `--help` the second torch takes (tests/test_cli.py checks it against the registry).
METHODS = ("SFT, RFT, Online RFT, DPO, Online DPO, PPO, GRPO, GRPO+PS (process supervision), RLOO, REINFORCE++, "
           "CISPO, GSPO, SAPO, on-policy distillation; DAPO and Dr. GRPO as GRPO recipes")


def _split_recipe(items: list[str]) -> tuple[str, list[str]]:
    recipes = [i.split("=", 1)[1] for i in items if i.startswith("recipe=")]
    stray = [i for i in items if "=" not in i]
    if not recipes and stray:  # `posttrain run grpo_math`: the recipe without its key
        raise UserError(f"recipe: got {stray[0]!r}, which is not key=value; did you mean recipe={stray[0]}?")
    if len(recipes) != 1:
        given = f" (got {len(recipes)}: {', '.join(recipes)})" if recipes else ""
        raise UserError(f"recipe: give exactly one recipe=NAME_OR_PATH{given} (see `posttrain recipes`)")
    return recipes[0], [i for i in items if not i.startswith("recipe=")]


def cmd_recipes(args) -> int:
    from posttrain.config import known_recipes, recipe_description

    recipes = known_recipes()
    width = max(map(len, recipes), default=0)
    for name, path in recipes.items():
        print(f"{name:<{width}}  {recipe_description(path)}")
    return 0


def cmd_config(args) -> int:
    import yaml

    recipe, overrides = _split_recipe(args.overrides)
    from posttrain import config

    cfg, resolved = config.load(recipe, overrides)
    text = yaml.safe_dump(resolved, sort_keys=False, allow_unicode=True, width=1000)
    at = text.index("\n  custom:", text.index("\nrewards:\n")) + 1  # after the weights
    print(text[:at] + "".join(off_rewards(cfg)) + text[at:], end="")
    return 0


def off_rewards(cfg) -> list[str]:
    """A comment line for each registered rule reward the config leaves out (weight 0, not computed), so that
    `posttrain config` shows every key there is; none for a method that scores no reward."""
    from posttrain import config
    from posttrain.rewards import REWARDS

    if config.algorithm_of(cfg).source != "online":
        return []
    return [f"  # {name}: off (a registered rule reward; rewards.{name}=0.1 weighs it in)\n" for name in REWARDS
            if name not in cfg.rewards.weights]


def cmd_explain(args) -> int:
    recipe, overrides = _split_recipe(args.overrides)
    from posttrain.apps import explain

    return explain.main(recipe, overrides, as_json=args.json)


def cmd_run(args) -> int:
    recipe, overrides = _split_recipe(args.overrides)
    from posttrain.apps import api  # the library's run: the CLI is this one call

    summary = api.Run(recipe, overrides, quiet=args.quiet).train()
    if summary is not None:  # None: not the main process, which prints nothing
        api.print_report(summary)
    return 0


def cmd_eval(args) -> int:
    from posttrain.apps import evaluate

    report = evaluate.main(args.model, args.overrides, output=args.output, quiet=args.quiet, base=args.base)
    print(evaluate.summary_line(report))
    print(f"per-problem records in {args.output}")
    return 0


def cmd_estimate(args) -> int:
    from posttrain.apps import estimate

    return estimate.main(args.settings)


def cmd_compare(args) -> int:
    from posttrain.apps import compare

    return compare.main(args.items)


def cmd_reproduce(args) -> int:
    from posttrain.apps import reproduce

    return reproduce.main(args.figure, args.items)


def cmd_docs(args) -> int:
    from posttrain.apps import reference

    return reference.main(args.page)


def cmd_env(args) -> int:
    from posttrain.apps import env

    return env.main(as_json=args.json)


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose errors are one line like every other bad input's: the message and where help is,
    without the usage block before it (`--help` prints that)."""

    def error(self, message: str):
        self.exit(2, f"posttrain: error: {message} (see {self.prog} --help)\n")


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="posttrain", description="Post-training methods as gradient-coefficient plugins "
                                f"over one shared engine: {METHODS}.", epilog=EPILOG)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = sub.add_parser("run", help="train with a recipe", description="Train: posttrain run recipe=grpo_math "
                         "[key=value ...]. Writes config.yaml, metrics.jsonl, summary.json and the final model "
                         "(model/) to output_dir.", epilog=EPILOG)
    run.add_argument("overrides", nargs="*", metavar="recipe=NAME key=value")
    run.add_argument("-q", "--quiet", action="store_true", help="no progress bar or status lines")
    run.set_defaults(func=cmd_run)
    cfg = sub.add_parser("config", help="print the resolved config of a recipe with overrides",
                         description="Print the resolved config: posttrain config recipe=grpo_math [key=value ...]",
                         epilog=EPILOG)
    cfg.add_argument("overrides", nargs="*", metavar="recipe=NAME key=value")
    cfg.set_defaults(func=cmd_config)
    exp = sub.add_parser("explain", help="what one step of a recipe does: batch sizes, updates, models, memory",
                         description="Explain a run without running it: posttrain explain recipe=grpo_math "
                         "[key=value ...]. Prompts and sequences per step (per process and over WORLD_SIZE "
                         "processes), micro-batches, optimizer steps per batch and per run, token bounds, the models "
                         "loaded and why, the stages of the data pipeline, how far off-policy a sample can be, and "
                         "`posttrain estimate`'s memory for the config. Loads no model.", epilog=EPILOG)
    exp.add_argument("overrides", nargs="*", metavar="recipe=NAME key=value")
    exp.add_argument("--json", action="store_true", help="one JSON object instead of text")
    exp.set_defaults(func=cmd_explain)
    rec = sub.add_parser("recipes", help="list the recipes that ship with posttrain, one line each",
                         description="List the recipes that ship with posttrain, each with a one-line description.")
    rec.set_defaults(func=cmd_recipes)
    ev = sub.add_parser("eval", help="greedy accuracy, pass@k and maj@k of a model on held-out problems",
                        description="Evaluate a model: posttrain eval MODEL_DIR [recipe=NAME] [eval.k=8 eval.n=16 "
                        "eval.num_problems=N data.test_path=… rollout.temperature=…]; MODEL_DIR is a model directory or a LoRA "
                        "run's model/ (an adapter, on its base). Greedy accuracy, and with "
                        "eval.k pass@k (unbiased, from eval.n ≥ k samples per problem) and maj@k (majority vote over "
                        "the final answers of k samples), on the recipe's held-out problems (grpo_math's embedded "
                        "task by default). Writes per-problem records to eval.json.", epilog=EPILOG)
    ev.add_argument("model", metavar="MODEL_DIR", help="a model directory, a GGUF file (pip install "
                    "'posttrain[gguf]'), or a LoRA run's model/ (an adapter, evaluated on its base)")
    # default=[]: argparse counts a `*` positional without a default as required, and names it when MODEL_DIR is missing
    ev.add_argument("overrides", nargs="*", default=[], metavar="key=value",
                    help="optional overrides: recipe=NAME (grpo_math), eval.k=8, data.test_path=…, …")
    ev.add_argument("-o", "--output", default="eval.json", help="where to write the report (default: eval.json; "
                    "an existing file is never replaced)")
    ev.add_argument("--base", metavar="DIR", help="for a LoRA adapter (a LoRA run's model/): its base model, when "
                    "neither the run's base_model/ copy beside it nor the directory its adapter_config.json names is "
                    "there")
    ev.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    ev.set_defaults(func=cmd_eval)
    est = sub.add_parser("estimate", help="per-GPU memory of SFT, DPO, PPO and GRPO for a model and GPU count",
                         description="Estimate per-GPU memory: posttrain estimate model=DIR_OR_PRESET gpus=N zero=0|1|2|3 "
                         "[backend=NAME] [offload=none|optimizer|params (all: the same as params)] [lora=R] "
                         "[batch=… G=… prompt_len=… response_len=…] "
                         "[grad_ckpt=true|false] [dtype=bf16|fp16|fp32] [rollout=hf|vllm gpu_memory_utilization=0.3] "
                         "[gpu_mem=80]. See docs/estimate.md.")
    est.add_argument("settings", nargs="*", metavar="key=value")
    est.set_defaults(func=cmd_estimate)
    cmp = sub.add_parser("compare", help="run several recipes on one budget and compare memory, time and accuracy",
                         description="Compare recipes: posttrain compare ppo_math grpo_math [steps=N] [eval_every=N] "
                         "[seeds=N] [output_dir=runs/compare] [overwrite=true] [key=value ...]. Each recipe runs in "
                         "its own process with the same overrides (seed, model, task, step budget), N times with "
                         "seeds=N (figures then mean ± sd); writes compare.md, compare.json and compare.png to "
                         "output_dir. Without steps=N every run trains a full budget, the smallest train.steps among "
                         "the recipes (60 for ppo_math grpo_math, 140 for grpo_math and its variants), evaluated on "
                         "the held-out problems every steps // 5 steps, one run after another: minutes, not seconds; "
                         "steps=2 is a quick try. See docs/compare.md.", epilog=EPILOG)
    cmp.add_argument("items", nargs="*", metavar="RECIPE ... key=value")
    cmp.set_defaults(func=cmd_compare)
    rep = sub.add_parser("reproduce", help="DeepSeekMath's Figure 5 or Figure 7 at toy scale, with seeds",
                         description="posttrain reproduce figure5 [seeds=3] [steps=100]: RFT, Online RFT, GRPO and "
                         "GRPO+PS on one budget, held-out accuracy against step. posttrain reproduce figure7 [seeds=3] "
                         "[steps=140] [k=64] [problems=200]: Maj@K and Pass@K before and after GRPO. Both take "
                         "[output_dir=DIR] [overwrite=true] and run overrides, and write a report (figureN.md, .png, "
                         ".json) to output_dir. Without seeds= and steps= both run their full budgets: figure5 12 "
                         "runs (4 methods x 3 seeds) of 100 steps of 256 samples; figure7 3 GRPO runs of 140 steps, "
                         "each with 64 samples of 200 held-out problems before and after: minutes, not seconds; "
                         "seeds=1 steps=2 is a quick try. See docs/reproduction.md for the times and results.",
                         epilog=EPILOG)
    rep.add_argument("figure", metavar="figure5|figure7")
    rep.add_argument("items", nargs="*", metavar="key=value")
    rep.set_defaults(func=cmd_reproduce)
    env = sub.add_parser("env", help="what a bug report needs: versions, device, CPU class, threads, precision",
                         description="Print what a bug report needs: the versions of posttrain, Python, torch, "
                         "transformers, accelerate, peft, datasets and the optional libraries installed; the device; "
                         "the CPU's class and whether bf16 is native or emulated there, with fp32 and bf16 matmul "
                         "rates measured now (about a second); the compute threads a run uses; the precision "
                         "train.precision=auto picks; the cache directory.")
    env.add_argument("--json", action="store_true", help="one JSON object instead of text")
    env.set_defaults(func=cmd_env)
    docs = sub.add_parser("docs", help="print a generated reference page: every config key, or every metric",
                          description="Print a reference page generated from the code: config (every key of every "
                          "group, with its type, default and help, and each method's algorithm.* keys: "
                          "docs/config.md) or metrics (every key metrics.jsonl can hold, with its unit and meaning: "
                          "docs/metrics.md).")
    docs.add_argument("page", choices=("config", "metrics"))
    docs.set_defaults(func=cmd_docs)
    return p


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line, with `key=value` overrides allowed after a flag as well as before it (`posttrain run
    recipe=grpo_math -q train.steps=5`); argparse alone takes one run of positionals only."""
    p = parser()
    args, rest = p.parse_known_args(argv)
    listed = next((name for name in ("overrides", "settings", "items") if isinstance(getattr(args, name, None), list)),
                  None)
    if rest and (listed is None or any(a.startswith("-") for a in rest)):
        p.parse_args(argv)  # the error argparse gives, naming what it did not recognise
    if rest:
        getattr(args, listed).extend(rest)
    return args


def main(argv: list[str] | None = None) -> int:
    prepare_process()
    args = parse(argv)
    try:
        code = args.func(args)
    except UserError as err:
        print(f"posttrain: error: {err}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        print("posttrain: interrupted", file=sys.stderr)
        code = 130
    except BrokenPipeError:  # the reader went away (`posttrain recipes | head -3`): stop without a traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nor one at exit, flushing stdout
        code = 141  # 128 + SIGPIPE, as a shell reports a pipe writer that stopped
    if "posttrain.backends" in sys.modules:  # one of several processes: leave without the interpreter's teardown
        from posttrain.backends.ddp import exit_process

        exit_process(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
