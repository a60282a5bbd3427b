"""The real command line, end to end: outputs, the warm-up cache, the real-data path, and one-line errors."""

import io
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from cli_helpers import Zygote, assert_one_line_error, posttrain, posttrain_fresh, posttrain_here
from conftest import FIXTURES
from rich.console import Console
from transformers import AutoModelForCausalLM

from posttrain.train.tracking import Progress

FAST = ["eval.num_problems=6", "eval.batch_size=6", "train.batch_size=2", "algorithm.group_size=2",
        "rollout.max_new_tokens=6", "data.train_size=100", "data.test_size=20"]


def test_recipes_and_help():
    proc = posttrain("recipes")
    assert proc.returncode == 0 and "grpo_math" in proc.stdout and "sft_math" in proc.stdout
    for args in (["--help"], ["run", "--help"], ["config", "--help"], ["recipes", "--help"]):
        assert posttrain(*args).returncode == 0


def test_eval_requires_only_the_model_directory():
    """Overrides are optional: before, `posttrain eval` alone said "required: MODEL_DIR, key=value"."""
    proc = posttrain_here("eval")
    assert_one_line_error(proc, "the following arguments are required: MODEL_DIR (see posttrain eval --help)")
    for args, says in ((("run", "--bogus"), "unrecognized arguments: --bogus"), (("frob",), "invalid choice: 'frob'"),
                       ((), "required: COMMAND")):  # usage errors are one line too, not the usage block and a line
        assert_one_line_error(posttrain_here(*args), says, "(see posttrain --help)")
    shown = " ".join(posttrain_here("eval", "--help").stdout.split())
    assert "posttrain eval [-h] [-o OUTPUT] [--base DIR] [-q] MODEL_DIR [key=value ...]" in shown
    assert ("MODEL_DIR a model directory, a GGUF file (pip install 'posttrain[gguf]'), or a LoRA run's model/ (an "
            "adapter, evaluated on its base)") in shown
    assert "key=value optional overrides: recipe=NAME" in shown


def test_a_forked_command_is_the_fresh_interpreters(tiny_model_dir, tmp_path):
    """`posttrain()` forks its commands from tests/zygote.py: a run there writes what a new interpreter writes."""
    args = ["run", "recipe=grpo_math", f"model.path={tiny_model_dir}", "train.steps=2", "train.threads=1", *FAST]
    served = Zygote.served
    forked = posttrain(*args, "output_dir=out_a", cwd=tmp_path)
    assert Zygote.served == served + 1, Zygote.differed  # it did fork, not fall back to an interpreter
    fresh = posttrain_fresh(*args, "output_dir=out_b", cwd=tmp_path)
    assert forked.returncode == fresh.returncode == 0, forked.stderr
    def lines(text: str) -> list[str]:  # but the time of "done in" and of DeepSpeed's log lines, and the line
        # DeepSpeed prints at its import, which for a forked command happened in the zygote (tests/zygote.py, LAZY)
        return [re.sub(r"^\[[-0-9 :,]+\]|done in [0-9.]+s", "", line) for line in text.splitlines()
                if "Setting accelerator to" not in line]

    assert lines(forked.stdout.replace("out_a", "out_b")) == lines(fresh.stdout) and "held-out accuracy" in fresh.stdout
    for name in ("model/model.safetensors", "config.yaml"):
        assert (tmp_path / "out_a" / name).read_bytes().replace(b"out_a", b"out_b") == (
            tmp_path / "out_b" / name).read_bytes()
    failed = posttrain("run", "recipe=grpo_math", "train.steps=-1", cwd=tmp_path)
    assert Zygote.served == served + 2
    assert (failed.returncode, failed.stderr) == (2, posttrain_fresh("run", "recipe=grpo_math", "train.steps=-1",
                                                                    cwd=tmp_path).stderr) and "train.steps" in failed.stderr


def test_a_reader_that_stops_early_gets_no_traceback():
    """`posttrain config recipe=grpo_math | head -3`: the pipe closes under a long print."""
    proc = subprocess.Popen([sys.executable, "-m", "posttrain", "config", "recipe=grpo_math"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, bufsize=1)
    proc.stdout.close()  # the reader is gone before the first line
    err = proc.stderr.read()
    assert proc.wait() == 141 and "Traceback" not in err and err == "", err


LIGHT = """
import sys
from posttrain.apps import cli
assert cli.main(["recipes"]) == 0
assert cli.main(["config", "recipe=grpo_math", "train.stpes=1"]) == 2
assert cli.main(["run", "grpo_math"]) == 2
heavy = ("transformers", "torch", "posttrain.algorithms", "posttrain.backends", "posttrain.rollout",
         "posttrain.sources")
print(sorted(m for m in sys.modules if m.startswith(heavy)))
"""


def test_listing_and_bad_input_load_no_plugin():
    """`posttrain recipes`, a bad key outside `algorithm` and a missing recipe= answer without loading the plugins
    and their libraries (torch, transformers), which take seconds before the answer appears."""
    proc = subprocess.run([sys.executable, "-c", LIGHT], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-1] == "[]"


def test_progress_line_keeps_its_times_whole_at_80_columns(monkeypatch):
    """At 80 columns there is no room for the bar, and the figures give way (cut with an ellipsis), never the step
    count or the elapsed and remaining times, which rich otherwise cuts like every other column."""
    monkeypatch.setenv("COLUMNS", "80")
    progress = Progress(1000, unit="problems")
    progress.bar.add_task("train", total=1000, completed=570, info="reward -0.125  kl 0.0012  loss -12.0023  12345 tok/s")
    [task] = progress.bar.tasks
    task.start_time -= 500  # 0:08:20 elapsed
    console = Console(file=io.StringIO(), width=80, record=True)
    console.print(progress.bar.get_renderable())
    line = console.export_text().rstrip("\n")
    assert len(line) <= 80 and line.startswith("problems  570/1000 reward -0.125 "), line
    assert line.endswith("… 0:08:20 < -:--:--"), line


def test_run_writes_outputs_then_refuses_to_overwrite(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    proc = posttrain("run", "recipe=grpo_math", f"model.path={tiny_model_dir}", f"output_dir={out}", "train.steps=2",
                     "train.save_every=1", *FAST)
    assert proc.returncode == 0, proc.stderr
    assert "held-out accuracy" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert {"eval_before", "eval_after", "wall_seconds", "steps", "peak_rss_mb"} <= summary.keys()
    assert summary["steps"] == 2 and 0 <= summary["eval_after"]["accuracy"] <= 1
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and {"reward", "kl", "loss", "tokens_per_s"} <= metrics[0].keys()
    assert "beta: 0.04" in (out / "config.yaml").read_text()
    AutoModelForCausalLM.from_pretrained(out / "model")  # the final model is an ordinary HF directory
    assert (out / "model" / "model.safetensors").exists()
    assert (out / "checkpoints" / "step_2" / "model.safetensors").exists()
    for folder in (out / "model", out / "checkpoints" / "step_2"):  # the weights as readable as the rest
        mode = (folder / "config.json").stat().st_mode
        files = [f for f in folder.iterdir() if f.is_file()]
        assert {f.name: oct(f.stat().st_mode) for f in files} == {f.name: oct(mode) for f in files}
    assert not (out.parent / "run.partial").exists()

    again = posttrain("run", "recipe=grpo_math", f"model.path={tiny_model_dir}", f"output_dir={out}", *FAST)
    assert_one_line_error(again, "output_dir", "not empty", "overwrite=true")

    # A run that fails half-way (a reference answer with no number) leaves the old results as they were.
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(json.dumps({"question": f"{i}+1", "answer": "unknown"}) for i in range(20)))
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    failed = posttrain("run", "recipe=grpo_math", f"model.path={tiny_model_dir}", f"output_dir={out}",
                       "overwrite=true", f"data.path={bad}", *FAST)
    assert failed.returncode == 2 and "Traceback" not in failed.stderr, failed.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


def test_warmup_is_cached(tmp_path):
    args = ["recipe=grpo_math", "train.steps=1", "warmup.steps=3", "warmup.hidden=32", "warmup.layers=1",
            f"warmup.cache_dir={tmp_path / 'cache'}", *FAST]
    first = posttrain("run", *args, f"output_dir={tmp_path / 'a'}")
    assert first.returncode == 0, first.stderr
    assert "warming up" in first.stderr
    second = posttrain("run", *args, f"output_dir={tmp_path / 'b'}", "model.lora.r=4")  # a LoRA run on the cached base
    assert second.returncode == 0 and "warming up" not in second.stderr
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert summary["warmup"]["cached"] is True and summary["adapter_base"]["copy"] == "base_model"
    # its adapter evaluates with the cache cleared and the run directory moved, from another directory
    shutil.rmtree(tmp_path / "cache")
    (tmp_path / "b").rename(tmp_path / "moved")
    (tmp_path / "elsewhere").mkdir()
    proc = posttrain("eval", tmp_path / "moved" / "model", "eval.num_problems=6", "rollout.max_new_tokens=6",
                     "data.train_size=100", "data.test_size=20", cwd=tmp_path / "elsewhere")
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "elsewhere" / "eval.json").read_text())
    assert report["adapter_base"] == str((tmp_path / "moved" / "base_model").resolve())
    assert report["greedy"] == summary["eval_after"]["accuracy"]  # the adapter on its copied base, as the run had it


def test_sft_on_gsm8k_rows(tiny_model_dir, tmp_path):
    """The real-data path: GSM8K's question/answer fields, held-out tail, `#### N` answers."""
    data = FIXTURES / "gsm8k" / "test_head.jsonl"
    proc = posttrain("run", "recipe=sft_math", f"model.path={tiny_model_dir}", f"data.path={data}",
                     f"output_dir={tmp_path / 'sft'}", "train.steps=2", "train.batch_size=4", "eval.num_problems=4",
                     "rollout.max_new_tokens=4", r'data.template="Question: {prompt}\nAnswer: "')  # YAML quoting, as in a shell
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "sft" / "summary.json").read_text())["eval_before"]["num_problems"] == 4


@pytest.mark.parametrize("args, fragments", [
    (["recipe=nope"], ["unknown recipe 'nope'", "known: "]),
    (["recipe=grpo_math", "algorithm.bta=1"], ["did you mean algorithm.beta?"]),
    (["recipe=grpo_math", "-q", "algorithm.bta=1"], ["did you mean algorithm.beta?"]),  # overrides after a flag too
    (["recipe=grpo_math", "train.steps=x"], ["train.steps: expected int"]),
    (["recipe=grpo_math", "algorithm.group_size=1"], ["algorithm.group_size"]),
    (["recipe=grpo_math", "algorithm.scale_std=false"], ["algorithm.scale_std: removed; use algorithm.adv_norm=none"]),
    (["recipe=grpo_math", "data.path=missing.jsonl"], ["data.path: no such file or directory 'missing.jsonl'"]),
    (["recipe=grpo_math", "model.path=nowhere"], ["model.path: 'nowhere' is not a Hugging Face model directory"]),
    ([], ["recipe"]),
    (["grpo_math"], ["recipe: got 'grpo_math', which is not key=value; did you mean recipe=grpo_math?"]),
])
def test_bad_input_exits_2_with_one_line(tmp_path, args, fragments):
    assert_one_line_error(posttrain_here("run", *args, f"output_dir={tmp_path / 'x'}", "warmup.steps=1", cwd=tmp_path),
                          *fragments)


def test_a_recipe_that_is_not_yaml(tmp_path):
    """A colon in an unquoted value: YAML's scanner error, as one line naming the file and the line."""
    (tmp_path / "mine.yaml").write_text("algorithm: {name: grpo}\ndescription: GRPO: mine\n")
    assert_one_line_error(posttrain_here("run", f"recipe={tmp_path / 'mine.yaml'}", cwd=tmp_path),
                          f"recipe {tmp_path / 'mine.yaml'}: cannot be read as YAML, line 2")


def test_empty_data_and_missing_field(tmp_path, tiny_model_dir):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert_one_line_error(posttrain_here("run", "recipe=sft_math", f"model.path={tiny_model_dir}", f"data.path={empty}",
                                    f"output_dir={tmp_path / 'o'}"), "holds no rows")
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"question": "1+1", "answer": "2"}) + "\n" + json.dumps({"question": "2+2"}) + "\n")
    assert_one_line_error(posttrain_here("run", "recipe=sft_math", f"model.path={tiny_model_dir}", f"data.path={rows}",
                                    f"data.test_path={rows}", f"output_dir={tmp_path / 'o'}"),
                          f"data.path: '{rows}' row 2 has no field 'answer'")


ARENAS = """
import ctypes, os, sys, threading
from posttrain.core.heap import limit_malloc_arenas
print(limit_malloc_arenas(), file=sys.stderr)
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
barrier = threading.Barrier(8)
def work():
    block = libc.malloc(1 << 16)  # each thread's first malloc takes a heap of its own, up to the cap
    barrier.wait()
    libc.free(block)
threads = [threading.Thread(target=work) for _ in range(8)]
[t.start() for t in threads]
[t.join() for t in threads]
libc.malloc_stats()  # one "Arena i:" block per heap, on stderr
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
@pytest.mark.parametrize("env, capped", [({}, True), ({"MALLOC_ARENA_MAX": "8"}, False)])
def test_malloc_arenas_are_capped_unless_the_user_set_a_limit(env, capped):
    proc = subprocess.run([sys.executable, "-c", ARENAS], capture_output=True, text=True, check=True,
                          env={**os.environ, **env})
    lines = proc.stderr.splitlines()
    arenas = sum(line.startswith("Arena ") for line in lines)
    assert lines[0] == str(capped)
    assert arenas == 2 if capped else arenas > 2  # 8 threads and the main one: uncapped, more than two heaps


MAPPED = """
import ctypes, sys
import torch
from posttrain.core.heap import large_allocations_mapped

libc = ctypes.CDLL(None)


class Info(ctypes.Structure):  # glibc's struct mallinfo2
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


libc.mallinfo2.restype = Info
torch.empty(31 << 20, dtype=torch.uint8)  # freed, it moves glibc's threshold up to 31 MiB, as a training run does
def mapped_blocks(nbytes):
    t = torch.empty(nbytes, dtype=torch.uint8)
    n = libc.mallinfo2().hblks
    del t
    return n
base = mapped_blocks(1)
with large_allocations_mapped(8 << 20):
    inside = mapped_blocks(9 << 20) - base
after = mapped_blocks(9 << 20) - base
print(inside, after)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
@pytest.mark.parametrize("env, inside", [({}, 1), ({"MALLOC_MMAP_THRESHOLD_": str(16 << 20)}, 0)])
def test_update_maps_large_blocks_then_the_heap_takes_them_again(env, inside):
    """Inside `large_allocations_mapped` a 9 MiB tensor is a mapped block of its own; after it, the heap serves it
    again (glibc's threshold is back at its ceiling); a user's own threshold is left alone."""
    proc = subprocess.run([sys.executable, "-c", MAPPED], capture_output=True, text=True, check=True,
                          env={**os.environ, **env})
    assert proc.stdout.split() == [str(inside), "0"], proc.stdout
