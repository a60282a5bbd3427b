"""Test helpers for the real command line: `posttrain ...` in a fresh process, and the one-line error it must give
for bad input."""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# Read when used, never at import, so a forked command sees them as a new interpreter would. The last two appear in
# this process on their own: importing DeepSpeed sets the first, torch.compile's cache the second.
READ_WHEN_USED = ("COLUMNS", "PYTORCH_NVML_BASED_CUDA_CHECK", "TORCHINDUCTOR_CACHE_DIR")


def posttrain(*args, cwd=None) -> subprocess.CompletedProcess:
    """`python -m posttrain *args`, output captured, at 120 columns so progress lines are not cut differently per
    terminal. Forked from a process that has imported torch and transformers already (tests/zygote.py: 4 seconds
    less a call) where the environment allows; `posttrain_fresh` always starts an interpreter."""
    env = {**os.environ, "COLUMNS": "120"}
    args = [str(a) for a in args]
    zygote = Zygote.get(env)
    if zygote is None:
        Zygote.fresh += 1
        return posttrain_fresh(*args, cwd=cwd)
    return zygote.run(args, str(cwd or os.getcwd()), env)


def posttrain_fresh(*args, cwd=None) -> subprocess.CompletedProcess:
    """`python -m posttrain *args` in a new interpreter, as `posttrain()` but never forked."""
    return subprocess.run([sys.executable, "-m", "posttrain", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env={**os.environ, "COLUMNS": "120"})


class Zygote:
    """The tests' one tests/zygote.py process, started at the first `posttrain()` call it can serve."""

    instance: Zygote | None = None
    broken = False
    served = 0  # commands forked, over the session (a test that means to fork checks that it did)
    fresh = 0  # `posttrain()` calls that started an interpreter instead
    differed: set[str] = set()  # the variables whose values made it so (the session's summary names them)

    def __init__(self):
        self.env = dict(os.environ)
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("zygote.py"))], text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=self.env)
        ready = json.loads(self.proc.stdout.readline() or '{"ready": false, "why": "it did not start"}')
        if not ready["ready"]:
            raise RuntimeError(f"tests/zygote.py cannot serve: {ready['why']}")
        atexit.register(self.proc.stdin.close)  # its loop then ends, and it exits

    @classmethod
    def get(cls, env: dict) -> Zygote | None:
        if cls.broken or os.environ.get("POSTTRAIN_TEST_FORK") == "0":
            return None
        if cls.instance is None or cls.instance.proc.poll() is not None:
            try:
                cls.instance = cls()
            except (RuntimeError, OSError, ValueError) as err:
                cls.broken = True
                print(f"posttrain(): every call starts an interpreter ({err})", file=sys.stderr)
                return None
        differ = cls.instance.differ(env)
        cls.differed |= differ
        return None if differ else cls.instance

    def differ(self, env: dict) -> set[str]:
        """The variables whose values in `env` are not the ones this process started with, but for those posttrain
        reads at run time (a command forked under any other would miss what was read at import)."""
        def kept(e: dict) -> set:
            return {(k, v) for k, v in e.items()
                    if k not in READ_WHEN_USED and not k.startswith(("POSTTRAIN_", "PYTEST_"))}

        return {k for k, _ in kept(env) ^ kept(self.env)}

    def run(self, args: list[str], cwd: str, env: dict) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory() as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            request = {"args": args, "cwd": cwd, "env": env, "stdout": str(out), "stderr": str(err)}
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            answer = self.proc.stdout.readline()
            if not answer:
                raise RuntimeError(f"tests/zygote.py ended (status {self.proc.wait()}) while running {args}")
            code = json.loads(answer)["returncode"]
            Zygote.served += 1
            text = (out.read_text(errors="replace"), err.read_text(errors="replace"))
        return subprocess.CompletedProcess([sys.executable, "-m", "posttrain", *args], code, *text)


def assert_one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    """Bad input: exit status 2 and a single `posttrain: error: ...` line on stderr holding every fragment."""
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("posttrain: error: "), proc.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def posttrain_here(*args, cwd=None) -> subprocess.CompletedProcess:
    """`posttrain *args` run in this process (no interpreter or torch start-up: milliseconds, not seconds), with the
    same exit status and captured output as `posttrain()`. An exception the CLI does not turn into a one-line error
    propagates: that is the traceback a user would see. For bad input refused before any work; a run that trains or
    spawns processes belongs in `posttrain()`."""
    import contextlib
    import io

    from posttrain.apps.cli import main
    from posttrain.backends import ddp

    out, err = io.StringIO(), io.StringIO()
    before, exit_process = os.getcwd(), ddp.exit_process
    ddp.exit_process = lambda code: None  # after an in-process run made a process group, `main` would end pytest
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main([str(a) for a in args])
            except SystemExit as exit_:  # argparse's own errors
                code = exit_.code if isinstance(exit_.code, int) else 1
    finally:
        os.chdir(before)
        ddp.exit_process = exit_process
    return subprocess.CompletedProcess(["posttrain", *map(str, args)], code, out.getvalue(), err.getvalue())
