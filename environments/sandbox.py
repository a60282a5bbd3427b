"""Runs a model's Python code in a process of its own, within time, memory, output and file limits.

`run(code)` starts `python -I -S` (no site-packages, no environment variables read, no user directory) in a new
temporary directory and session, and gives it the code on stdin. Two layers stand between that code and the machine:

1. **The operating system's** (`isolation="bwrap"`, the default; environments/isolation.py): the process runs in a
   bubblewrap jail, in namespaces of its own (no network, no other process in sight), with a read-only view of the
   system's software and its own directory as the only one it can write, as an unprivileged user, under a seccomp
   filter that refuses new processes, sockets and namespace, mount and ptrace calls. This is what the isolation
   rests on: it holds whatever the code does to the interpreter it runs in.
2. **The interpreter's**, which tell the model in plain words what it may not do: the process caps its address
   space (`memory_mb`: a larger allocation raises MemoryError), its CPU seconds, the size of a file it writes
   (1 MiB), its open files and its processes; imports the modules the code may use (`MODULES`: math, fractions,
   itertools, ...) and refuses every other import; and installs an audit hook (PEP 578) that refuses opening a path
   outside its directory and every `os`, `shutil`, `subprocess` and `socket` event. Code written to get past these
   can (it runs with the checker's own powers: it can swap a function's `__code__`), which is why the first layer
   exists. `isolation="none"` runs with this layer alone: for code one trusts, on a machine without bubblewrap.

Outside, the parent kills the jail at `timeout_s` of wall time (a `while True`, a `sleep`) or as soon as the output
passes `max_output` characters, and reads no more. What the model sees is the output (stdout and stderr together),
the exception's last line when the code raised, or why the run was stopped: always text, never a hang or a crash.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from posttrain.core.errors import ConfigError
from posttrain.environments import isolation as jail

MODULES = ("math", "cmath", "fractions", "decimal", "itertools", "functools", "collections", "statistics", "re",
           "random", "string", "operator", "heapq", "bisect", "datetime")

# The child's first code: limits, the allowed modules, the audit hook and a guarded `__import__` (unless argv[4] is
# "0", which tests use to attack the operating system's layer alone), then the model's code from stdin.
PRELUDE = r"""
import os, resource, sys
memory, cpu_s, checks = int(sys.argv[1]), int(sys.argv[2]), sys.argv[4] == "1"
code = sys.stdin.read()
sys.stdin.close()
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
resource.setrlimit(resource.RLIMIT_NOFILE, (32, 32))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))  # no process or thread (root, unjailed, is exempt)
for name in sys.argv[3].split(","):
    __import__(name)
scope = {"__name__": "__main__"}


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


def guarded(name, globals=None, locals=None, fromlist=(), level=0, real=__import__, modules=sys.argv[3],
            allowed=frozenset(sys.argv[3].split(","))):
    # the modules imported above are cached, so the audit hook's import event never sees them: refuse them here
    if level or name.partition(".")[0] not in allowed:
        raise ImportError(f"the sandbox has only the modules {modules} (not {name})")
    return real(name, globals, locals, fromlist, level)


if checks:
    import builtins

    scope["__builtins__"] = dict(vars(builtins), __import__=guarded)
    sys.addaudithook(hook)
del hook, guarded
try:
    exec(compile(code, "<python>", "exec"), scope)
except SystemExit:
    raise
except BaseException as error:
    sys.stdout.flush()
    print(f"{type(error).__name__}: {error}", file=sys.stderr)
    sys.exit(1)
"""
ISOLATION = ("bwrap", "none")  # env.sandbox's values


@dataclass
class Result:
    text: str  # what the model sees
    ok: bool  # the code ran to its end without an exception or being stopped
    stopped: str = ""  # why the parent stopped it: "time", "output" (else "")


def require(isolation: str) -> None:
    """Raises ConfigError, naming what is missing, where `isolation` cannot be set up on this machine."""
    if isolation not in ISOLATION:
        raise ConfigError(f"env.sandbox: must be one of {', '.join(ISOLATION)} (got {isolation!r})")
    why = jail.missing() if isolation == "bwrap" else ""
    if why:
        raise ConfigError(f"env.name=python: the Python tool runs the model's code in an isolated jail, and {why}; "
                          "env.sandbox=none runs it without that isolation (trusted code only)")


def run(code: str, *, timeout_s: float = 3.0, memory_mb: int = 256, max_output: int = 1000,
        isolation: str = "bwrap", interpreter_checks: bool = True) -> Result:
    """Runs `code` in a sandboxed Python process (module docstring); its output, or why there is none.

    Args:
        isolation: "bwrap" (the operating system's jail around the process, environments/isolation.py) or "none".
        interpreter_checks: the interpreter's own layer; off only to test the jail against code that has beaten it.
    """
    require(isolation)
    with contextlib.ExitStack() as stack:  # unjailed, the code's directory is a temporary one on the host
        argv = [jail.python() if isolation == "bwrap" else sys.executable, "-I", "-S", "-c", PRELUDE,
                str(memory_mb << 20), str(int(timeout_s) + 1), ",".join(MODULES), "1" if interpreter_checks else "0"]
        fds, workdir = (), "/"
        if isolation == "bwrap":  # its own tmpfs in the jail
            fds = jail.seccomp_pipe()
            argv = jail.command(argv, fds[0] if fds else None)
        else:
            workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="posttrain-sandbox-"))
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    cwd=workdir, env={"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8"},
                                    start_new_session=True, pass_fds=fds)
        finally:
            for fd in fds:
                os.close(fd)
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
    killed = -proc.returncode if proc.returncode < 0 else 0  # a signal: the CPU limit's SIGXCPU, or the kernel's
    if isolation == "bwrap" and 128 < proc.returncode < 128 + signal.NSIG:
        killed = proc.returncode - 128  # bwrap's init reports its child's death by a signal as 128 + the signal
    if killed:
        name = signal.Signals(killed).name if killed in signal.valid_signals() else f"signal {killed}"
        return Result(_note(shown, f"error: killed by {name}"), False)
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
