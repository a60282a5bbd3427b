"""Runs a model's Python code in a process of its own, within time, memory, output and file limits.

`run(code)` starts `python -I -S` (no site-packages, no environment variables read, no user directory) in a new
temporary directory and session, and gives it the code on stdin. Before the code runs, the process:

- caps its address space (`memory_mb`: a larger allocation raises MemoryError), its CPU seconds, the size of a file
  it writes (1 MiB) and its open files;
- imports the modules the code may use (`MODULES`: math, fractions, itertools, ...) and then refuses every other
  import, so no `socket`, `ctypes` or `subprocess` can be loaded;
- installs an audit hook (PEP 578, which no Python code can remove) that refuses opening a path outside its
  directory, and every `os`, `shutil`, `subprocess` and `socket` event: no process started or signalled (fork, exec,
  system, spawn, kill), no file removed, renamed or linked, no network.

Outside, the parent kills the whole session at `timeout_s` of wall time (a `while True`, a `sleep`) or as soon as the
output passes `max_output` characters, and reads no more. What the model sees is the output (stdout and stderr
together), the exception's last line when the code raised, or why the run was stopped: always text, never a hang or a
crash. This contains a model's mistakes and the usual hostile inputs (tests/test_environments.py runs an infinite
loop, a fork bomb, reads of /etc and of the parent's files, huge output and a memory bomb), and there is no network
namespace or seccomp filter behind it: for code from an adversary, run the training in a container without network.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

MODULES = ("math", "cmath", "fractions", "decimal", "itertools", "functools", "collections", "statistics", "re",
           "random", "string", "operator", "heapq", "bisect", "datetime")

# The child's first code: limits, the allowed modules, the audit hook, then the model's code from stdin.
PRELUDE = r"""
import os, resource, sys
memory, cpu_s = int(sys.argv[1]), int(sys.argv[2])
code = sys.stdin.read()
sys.stdin.close()
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
resource.setrlimit(resource.RLIMIT_NOFILE, (32, 32))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
for name in sys.argv[3].split(","):
    __import__(name)


def hook(event, args, root=os.path.realpath(os.getcwd()), modules=sys.argv[3], realpath=os.path.realpath,
         join=os.path.join, fsdecode=os.fsdecode, sep=os.sep,
         refused=("os.", "shutil.", "subprocess.", "socket.", "ctypes.", "_posixsubprocess.", "signal.", "mmap.")):
    # everything it reads is bound here, out of reach of code that walks frames to the module's globals
    if event in ("open", "os.listdir", "os.scandir"):
        if isinstance(args[0], int):
            return
        path = realpath(join(root, fsdecode(args[0] if args[0] is not None else ".")))
        if path != root and not path.startswith(root + sep):
            raise PermissionError(f"the sandbox reads and writes its own directory only, not {args[0]}")
    elif event == "import":
        raise ImportError(f"the sandbox has only the modules {modules} (not {args[0]})")
    elif event.startswith(refused):
        raise PermissionError(f"not allowed in the sandbox: {event}")


sys.addaudithook(hook)
del hook
try:
    exec(compile(code, "<python>", "exec"), {"__name__": "__main__"})
except SystemExit:
    raise
except BaseException as error:
    sys.stdout.flush()
    print(f"{type(error).__name__}: {error}", file=sys.stderr)
    sys.exit(1)
"""


@dataclass
class Result:
    text: str  # what the model sees
    ok: bool  # the code ran to its end without an exception or being stopped
    stopped: str = ""  # why the parent stopped it: "time", "output" (else "")


def run(code: str, *, timeout_s: float = 3.0, memory_mb: int = 256, max_output: int = 1000) -> Result:
    """Runs `code` in a sandboxed Python process (module docstring); its output, or why there is none."""
    with tempfile.TemporaryDirectory(prefix="posttrain-sandbox-") as workdir:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", PRELUDE, str(memory_mb << 20), str(int(timeout_s) + 1),
             ",".join(MODULES)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=workdir,
            env={"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8"}, start_new_session=True)
        try:
            proc.stdin.write(code.encode("utf-8", "replace"))
            proc.stdin.close()
        except BrokenPipeError:  # it died before reading (its limits refused the interpreter): read what it said
            pass
        out, stopped = _read(proc, timeout_s, max_output)
        _kill(proc)
    text = out.decode("utf-8", "replace")
    if len(text) > max_output:
        stopped = stopped or "output"
    shown = _cut(text, max_output).rstrip("\n")
    if stopped == "time":
        return Result(_note(shown, f"error: stopped after {timeout_s:g} s"), False, stopped)
    if stopped == "output":
        return Result(_note(shown, f"error: output cut at {max_output} characters"), False, stopped)
    if proc.returncode < 0:  # a signal: the CPU limit's SIGXCPU, or the kernel's
        return Result(_note(shown, f"error: killed by {signal.Signals(-proc.returncode).name}"), False)
    if proc.returncode and not shown.strip():  # sys.exit(3), say
        shown = f"error: exit status {proc.returncode}"
    return Result(shown, proc.returncode == 0)


def _read(proc: subprocess.Popen, timeout_s: float, max_output: int) -> tuple[bytes, str]:
    """The child's output until it closes it, or until the deadline or the cap: (bytes, why it was stopped)."""
    chunks, size, deadline = [], 0, time.monotonic() + timeout_s
    fd = proc.stdout.fileno()
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return b"".join(chunks), "time"
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:  # closed: it ended, or closed its output and goes on
            try:
                proc.wait(timeout=max(0.01, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return b"".join(chunks), "time"
            return b"".join(chunks), ""
        chunks.append(chunk)
        size += len(chunk)
        if size > 4 * max_output:  # enough to show the cut text in any encoding
            return b"".join(chunks), "output"


def _kill(proc: subprocess.Popen) -> None:
    """Ends the child's whole session (whatever it started, had it started anything) and reaps the child."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.stdout.close()
    proc.wait()


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit]


def _note(text: str, note: str) -> str:
    return f"{text}\n{note}" if text else note
