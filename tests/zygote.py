"""A process that imports what every `posttrain` command imports, once, and then forks one child per command.

The tests run the real command line hundreds of times, and each fresh interpreter spends about 4 seconds on imports
(torch, transformers, accelerate) before it does anything. This process pays that once: it imports them without
running any tensor code, so no compute thread pool exists to be lost in a fork (checked: it refuses to serve
otherwise), then reads one request a line on stdin, JSON {"args", "cwd", "env", "stdout", "stderr"}, forks, and
answers {"returncode"} once the child has ended. The child is then what `python -m posttrain ARGS` would be: its
working directory, environment, argv, sys.path[0] (the working directory, as `-m` puts it) and standard streams
are the request's, it runs `posttrain/__main__.py`, and it ends as an interpreter does (atexit handlers, the exit
status of SystemExit, a traceback and 1 for an uncaught exception, a negative status for a signal).

`tests/cli_helpers.py` uses it for `posttrain()` unless the environment differs from the one this process started
with in anything but POSTTRAIN_* and PYTEST_* (a variable read at import time would then be missed), or
POSTTRAIN_TEST_FORK=0.
"""

from __future__ import annotations

import importlib
import json
import os
import sys

# What a command imports only once it runs, not at `import posttrain.train`: transformers' model classes and
# tokenizers are lazy attributes, and a run reaches torch.distributed.tensor (FSDP2), torch._dynamo (transformers'
# masks), DeepSpeed (transformers looks for it), sympy (math-verify) and peft (LoRA). Imported here once, they take
# 2.7 s off every forked run (3.5 s -> 0.8 s for a one-step GRPO run on the tiny model, 2 cores
# of an AVX-512 with AMX machine capped to AVX2 kernels).
# DeepSpeed's line at its import ("Setting accelerator to CPU") is then printed here, not by the forked command.
LAZY = ("transformers.models.llama.modeling_llama", "transformers.models.auto.modeling_auto",
        "transformers.tokenization_utils_fast", "transformers.generation.utils", "torch.distributed.tensor",
        "torch.distributed.fsdp", "torch._dynamo", "sympy", "math_verify", "deepspeed", "peft")


def threads() -> int:
    return len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1


def child(request: dict) -> None:
    """Becomes `python -m posttrain ARGS` as the request describes it; never returns (SystemExit ends it)."""
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, fd)
        os.close(out)
    sys.stdin = open(os.devnull)  # not the requests' pipe, whose unread lines this process's buffer may hold
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[0] = os.getcwd()
    sys.argv = ["posttrain", *request["args"]]
    import runpy

    runpy.run_module("posttrain", run_name="__main__", alter_sys=True)
    sys.exit(0)


def serve() -> None:
    from posttrain.apps.cli import prepare_process

    prepare_process()  # as the command does before its imports: transformers reads some of it when imported
    import numpy  # noqa: F401  (its BLAS starts threads of its own, made safe to fork by OpenBLAS)

    before = threads()
    import accelerate  # noqa: F401
    import transformers  # noqa: F401

    import posttrain.apps.evaluate  # noqa: F401
    import posttrain.train  # noqa: F401

    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)  # DeepSpeed's import prints a line to stdout, which carries this process's answers
    try:
        for name in LAZY:
            try:
                importlib.import_module(name)
            except ImportError:  # an extra this environment lacks (DeepSpeed): its commands import nothing of it
                pass
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)  # fd 1 again, so what its loggers print later goes where the command's stdout goes
        os.close(saved)
    started = threads() - before  # torch's compute threads start with its first parallel op, which must not be here
    print(json.dumps({"ready": started == 0, "why": f"the imports started {started} threads"}), flush=True)
    if started:
        return
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            child(request)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    serve()
