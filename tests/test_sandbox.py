"""The Python tool's jail (environments/isolation.py) against code that attacks the checker itself.

Checks inside the interpreter cannot hold against code that rewrites them, so each attack here first beats the
interpreter's layer (a function's `__code__` swapped, `os` reached through a module that imported it, the layer turned
off altogether) and then tries what the jail must stop: reading and writing the user's files, starting processes,
reaching the network, signalling the trainer, entering namespaces, tracing, /proc/self/mem. The same escape is run
without the jail first, where it succeeds: the attack is real, and it is the jail that stops it.
"""

import os
import secrets
import socket
import time
from pathlib import Path

import pytest
from cli_helpers import assert_one_line_error, posttrain, posttrain_here

from posttrain.environments import isolation, sandbox
from posttrain.environments.python import Python
from posttrain.schema import EnvConfig

# Where the jail cannot be set up the tests skip, unless CI asks them to fail (.ci/run installs bubblewrap).
if isolation.missing():
    if os.environ.get("POSTTRAIN_REQUIRE_SANDBOX") == "1":
        raise RuntimeError(f"POSTTRAIN_REQUIRE_SANDBOX=1 but the jail cannot be set up: {isolation.missing()}")
    pytest.skip(f"no jail here: {isolation.missing()}", allow_module_level=True)


@pytest.fixture
def host(tmp_path):
    """A user's secret file (a random token the jail must not let out) and a place where nothing may be written."""
    token = secrets.token_hex(16)
    (tmp_path / "secret.txt").write_text(token)
    return tmp_path, token


# The escape: os, reached through a module that imported it (`import os` is refused), has its realpath's
# code swapped for one that says every path is the sandbox's own directory, which is how the audit hook decides.
ESCAPE = """
import random
os = random._os
root = os.getcwd()
os.path.realpath.__code__ = eval(f"lambda filename, *, strict=False: {{root!r}}").__code__
print(open({secret!r}).read())
open({marker!r}, "w").write("pwned")
"""


def test_the_interpreter_s_checks_are_escaped_without_the_jail_and_held_with_it(host):
    tmp, token = host
    code = ESCAPE.format(secret=str(tmp / "secret.txt"), marker=str(tmp / "pwned"))
    unjailed = sandbox.run(code, timeout_s=5, isolation="none")
    assert token in unjailed.text and (tmp / "pwned").read_text() == "pwned", unjailed  # the attack is real
    (tmp / "pwned").unlink()
    jailed = sandbox.run(code, timeout_s=5)
    assert token not in jailed.text and not (tmp / "pwned").exists(), jailed
    assert jailed.text.startswith("FileNotFoundError"), jailed.text  # the host's path does not exist in the jail


# Attacks on the checker itself, with the interpreter's layer on: each gets as far as it can; none may leak the
# secret, write the marker, or touch the test's process.
CHECKER_ATTACKS = {
    "code swap of realpath, then /etc": ESCAPE.replace("print(open({secret!r}).read())",
                                                       "print(open('/etc/passwd').read(), open({secret!r}).read())"),
    "monkeypatched os.path and builtins": """
import random
os = random._os
os.path.realpath = os.path.abspath = lambda p, *a, **k: os.getcwd()
__builtins__["__import__"] = random.__builtins__["__import__"]
print(open({secret!r}).read())
open({marker!r}, "w").write("pwned")
""",
    "sys.modules and importlib": """
import random
sys = random._os.sys
ctypes = sys.modules["_frozen_importlib"]._gcd_import("ctypes")
print(open({secret!r}).read())
""",
    "subclass walk to os.system": """
for c in ().__class__.__base__.__subclasses__():
    if c.__name__ == "_wrap_close":
        c.__init__.__globals__["system"]("cat {secret} > {marker}")
print(open({secret!r}).read())
""",
    "signal the trainer": """
import random
os = random._os
os.kill({pid}, 9)
""",
}


@pytest.mark.parametrize("attack", list(CHECKER_ATTACKS))
def test_attacks_on_the_checker_leak_nothing(host, attack):
    tmp, token = host
    code = CHECKER_ATTACKS[attack].format(secret=str(tmp / "secret.txt"), marker=str(tmp / "pwned"), pid=os.getpid())
    result = sandbox.run(code, timeout_s=5)
    assert token not in result.text and not (tmp / "pwned").exists() and not result.ok, result


# With the interpreter's layer off: code with every power Python has, against the jail alone.
OS_ATTACKS = [
    ("read a user's file", "print(open({secret!r}).read())", "FileNotFoundError"),
    ("write beside it", "open({marker!r}, 'w').write('pwned')", "FileNotFoundError"),
    ("write into the system", "open('/usr/pwned', 'w').write('x')", "Error: [Errno 30] Read-only file system"),
    ("list the host", "import os\nprint(sorted(os.listdir('/')))", "['bin', 'dev'"),
    ("read /etc", "print(open('/etc/passwd').read())", "FileNotFoundError"),
    ("/proc/self/mem", "open('/proc/self/mem', 'r+b')", "FileNotFoundError"),
    ("a fork bomb", "import os\nwhile True:\n    os.fork()", "PermissionError: [Errno 1] Operation not permitted"),
    ("a shell", "import subprocess\nsubprocess.run(['sh', '-c', 'cat {secret} > {marker}'])", "PermissionError"),
    ("a thread", "import _thread\n_thread.start_new_thread(print, (1,))", "can't start new thread"),
    ("the network", "import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)", "PermissionError"),
    ("signal the trainer", "import os\nos.kill({pid}, 9)", "ProcessLookupError"),
    ("signal everyone", "import os\nos.kill(-1, 9)\nprint('alive')", "ProcessLookupError"),  # none to signal
    ("become root", "import os\nos.setuid(0)", "PermissionError"),
    ("namespaces, mounts, ptrace", """
import ctypes, ctypes.util
libc = ctypes.CDLL(None, use_errno=True)
print(libc.unshare(0x10000000), libc.unshare(0x00020000), libc.mount(b"none", b"/tool", b"tmpfs", 0, None),
      libc.ptrace(16, 1, None, None), libc.chroot(b"/tool"))
""", "-1 -1 -1 -1 -1"),
    ("a memory bomb", "a = bytearray(1 << 30)", "MemoryError"),
    ("a sleep", "import time\ntime.sleep(60)", "error: stopped after 2 s"),
]


@pytest.mark.parametrize("attack, code, says", OS_ATTACKS, ids=[a[0] for a in OS_ATTACKS])
def test_the_jail_holds_code_that_has_beaten_the_interpreter(host, attack, code, says):
    tmp, token = host
    with socket.socket() as listener:  # a server on the host's loopback, for the network attack to reach
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(0.1)
        code = code.format(secret=str(tmp / "secret.txt"), marker=str(tmp / "pwned"), pid=os.getpid(),
                           port=listener.getsockname()[1])
        t0 = time.perf_counter()
        result = sandbox.run(code, timeout_s=2, interpreter_checks=False)
        assert time.perf_counter() - t0 < 4
        with pytest.raises(TimeoutError):
            listener.accept()
    assert says in result.text, result.text
    assert token not in result.text and not (tmp / "pwned").exists()


WRITES = """
import os
for p in ('/x', '/dev/x', '/dev/shm/x', '/usr/x', '/tool/x'):
    try:
        open(p, 'w').write('1')
        print(p, 'written')
    except OSError as e:
        print(p, e.errno)
try:
    for i in range(100):
        open(f'/tool/f{i}', 'wb').write(b'x' * (1 << 20))
except OSError as e:
    print('full at', i, 'MiB', e.errno)
print(os.getuid())
"""
# what a jail must print: every path read-only (30, EROFS) but its own directory, which fills (28, ENOSPC) at 64 MiB
JAILED = "/x 30\n/dev/x 30\n/dev/shm/x 30\n/usr/x 30\n/tool/x written\nfull at 64 MiB 28"


def test_only_its_own_bounded_directory_is_writable():
    result = sandbox.run(WRITES, timeout_s=5, interpreter_checks=False)
    assert result.text.startswith(JAILED) and result.text.endswith("\n65534"), result.text


@pytest.mark.skipif(os.geteuid() != 0 or not Path("/usr/bin/python3").exists(),
                    reason="needs root, to become another user, and a system Python that user can run")
def test_the_jail_of_an_unprivileged_user():
    """Run by a user other than root (here nobody, through setpriv), bwrap makes a user namespace: the same walls."""
    import subprocess

    import posttrain

    package = Path(posttrain.__file__).resolve().parents[1]  # the directory that holds posttrain/
    script = (f"import sys\nsys.path.insert(0, {str(package)!r})\n"
              "from posttrain.environments import isolation, sandbox\n"
              "print(isolation.describe())\n"
              f"print(sandbox.run({WRITES!r}, timeout_s=5, interpreter_checks=False).text)\n"
              "print(sandbox.run('import os\\nos.fork()', interpreter_checks=False).text)\n")
    proc = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-c",
                           script], capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"}, cwd="/")
    if "No module named" in proc.stderr or "Permission denied" in proc.stderr:  # a checkout nobody may read
        pytest.skip(f"nobody cannot import posttrain from here: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, proc.stderr
    assert "user namespace" in proc.stdout and JAILED in proc.stdout, proc.stdout
    assert "PermissionError: [Errno 1] Operation not permitted" in proc.stdout


def test_the_tool_still_computes_and_keeps_its_files_in_the_jail():
    tool = Python(EnvConfig(name="python"))
    assert tool.step("<python>from fractions import Fraction\nprint(37 * 48, Fraction(3, 4) * 2)</python>", [],
                     ended=False).text == "1776 3/2"
    assert tool.step("<python>open('a.txt', 'w').write('kept')\nprint(open('a.txt').read())</python>", [],
                     ended=False).text == "kept"
    assert sandbox.run("import os\nos.abort()", interpreter_checks=False).text == "error: killed by SIGABRT"


def test_without_the_jail_the_python_tool_is_refused_in_one_line_unless_opted_out(monkeypatch, tmp_path):
    monkeypatch.setattr(isolation.shutil, "which", lambda name: None)
    isolation.missing.cache_clear()
    try:
        with pytest.raises(Exception, match="bubblewrap .* not installed.*env.sandbox=none"):
            Python(EnvConfig(name="python"))
        assert Python(EnvConfig(name="python", sandbox="none")).step(
            "<python>print(6 * 7)</python>", [], ended=False).text == "42"
    finally:
        isolation.missing.cache_clear()


def test_a_run_without_the_jail_is_refused_before_the_warm_up(tmp_path):
    """In the CLI, a process of its own whose PATH has no bwrap: one line, before the warm-up (the recipe's
    model.path is null) or any directory is made."""
    os.environ["PATH"] = str(tmp_path)  # (each test's changes to the environment end with it)
    proc = posttrain("run", "recipe=grpo_tools", "env.name=python", f"output_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert_one_line_error(proc, "env.name=python", "bubblewrap (bwrap) is not installed", "env.sandbox=none")
    assert not (tmp_path / "run").exists() and not (tmp_path / "run.partial").exists()
    assert "step 1/" not in proc.stderr  # no warm-up ran


def test_env_sandbox_is_checked():
    proc = posttrain_here("run", "recipe=grpo_tools", "env.sandbox=docker")
    assert_one_line_error(proc, "env.sandbox: must be bwrap or none (got 'docker')")
    proc = posttrain_here("run", "recipe=grpo_math", "env.sandbox=none")
    assert_one_line_error(proc, "env.sandbox: set without env.name")
