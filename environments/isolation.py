"""The operating system's walls around the Python tool's process: what the sandbox's isolation rests on.

Checks inside the interpreter that runs untrusted code cannot hold: that code has the checker's own powers and can
rewrite it (swap a function's `__code__`, patch `os`, reach a module through `sys.modules`). So the process that runs
a model's code is started by bubblewrap (`bwrap`, Debian's `bubblewrap`) in a jail the kernel enforces:

- **its own namespaces**: mount, pid, network, IPC, UTS and cgroup. It sees no other process (the trainer included:
  it cannot signal what it cannot name), and has no network at all, only an unconfigured loopback;
- **a read-only view of the system's software and nothing else**: `/usr` and the Python installation are bound
  read-only, `/dev` holds the null, zero and random devices, and the one writable directory is the call's own fresh
  directory (`/tool`). No `/etc`, `/home`, `/root`, `/proc`, `/tmp`, nor the run's or the user's files;
- **an unprivileged user**: as root, the code runs as `nobody` (uid 65534) with no capabilities (util-linux's
  `setpriv`); as anyone else, as that user inside a user namespace of its own;
- **a seccomp filter** (x86-64 and aarch64): no new process or thread (`clone`, `fork`, `vfork`), no socket, no
  namespace or mount call, no `ptrace` or access to other processes' memory, no kernel keyring, BPF, io_uring,
  module or reboot call. Each fails with EPERM; a syscall of another ABI (x32) fails too;
- the parent's limits on address space, CPU seconds, file size, open files, processes, wall time and output
  (`environments/sandbox.py`).

What it does not protect against: a kernel bug that lets a process out of its namespaces or past seccomp; reading
what is world-readable under `/usr` and the Python installation (installed software, no user data); using the CPU
and memory within its limits. On another architecture the seccomp filter is left out (said by `describe()`).
"""

from __future__ import annotations

import functools
import os
import platform
import shutil
import struct
import subprocess
import sys

NOBODY = 65534
WORKDIR = "/tool"  # where the call's own directory appears inside the jail

# The syscalls the jail refuses, by architecture (numbers from the kernel's uapi headers: asm/unistd_64.h for
# x86-64, asm-generic/unistd.h for aarch64), and the audit architecture a filter must check first: a process may
# switch ABIs, and a number means another call in another ABI.
_REFUSED = ("clone", "clone3", "fork", "vfork", "unshare", "setns", "mount", "umount2", "pivot_root", "chroot",
            "mount_setattr", "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "ptrace",
            "process_vm_readv", "process_vm_writev", "socket", "socketpair", "bpf", "perf_event_open", "keyctl",
            "add_key", "request_key", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
            "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load", "open_by_handle_at",
            "name_to_handle_at", "swapon", "swapoff", "reboot", "acct", "quotactl", "sethostname", "setdomainname")
_SYSCALLS = {
    "x86_64": (0xC000003E, dict(
        clone=56, clone3=435, fork=57, vfork=58, unshare=272, setns=308, mount=165, umount2=166, pivot_root=155,
        chroot=161, mount_setattr=442, open_tree=428, move_mount=429, fsopen=430, fsconfig=431, fsmount=432,
        fspick=433, ptrace=101, process_vm_readv=310, process_vm_writev=311, socket=41, socketpair=53, bpf=321,
        perf_event_open=298, keyctl=250, add_key=248, request_key=249, userfaultfd=323, io_uring_setup=425,
        io_uring_enter=426, io_uring_register=427, init_module=175, finit_module=313, delete_module=176,
        kexec_load=246, kexec_file_load=320, open_by_handle_at=304, name_to_handle_at=303, swapon=167, swapoff=168,
        reboot=169, acct=163, quotactl=179, sethostname=170, setdomainname=171)),
    "aarch64": (0xC00000B7, dict(
        clone=220, clone3=435, unshare=97, setns=268, mount=40, umount2=39, pivot_root=41, chroot=51,
        mount_setattr=442, open_tree=428, move_mount=429, fsopen=430, fsconfig=431, fsmount=432, fspick=433,
        ptrace=117, process_vm_readv=270, process_vm_writev=271, socket=198, socketpair=199, bpf=280,
        perf_event_open=241, keyctl=219, add_key=217, request_key=218, userfaultfd=282, io_uring_setup=425,
        io_uring_enter=426, io_uring_register=427, init_module=105, finit_module=273, delete_module=106,
        kexec_load=104, kexec_file_load=294, open_by_handle_at=265, name_to_handle_at=264, swapon=224, swapoff=225,
        reboot=142, acct=89, quotactl=60, sethostname=161, setdomainname=162)),  # no fork or vfork: clone only
}
_ARCH = {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine().lower(), platform.machine().lower())


def seccomp_filter(arch: str = _ARCH) -> bytes | None:
    """The classic BPF program bwrap installs (`--seccomp FD`): refuse `_REFUSED` with EPERM, kill a process of
    another architecture, allow the rest. None where the architecture's numbers are not known here."""
    if arch not in _SYSCALLS:
        return None
    audit_arch, numbers = _SYSCALLS[arch]
    load, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_RET|K
    allow, deny, kill = 0x7FFF0000, 0x00050000 | 1, 0x80000000  # SECCOMP_RET_ALLOW, _ERRNO | EPERM, _KILL_PROCESS
    refused = sorted({numbers[name] for name in _REFUSED if name in numbers})
    # seccomp_data: the syscall's number at offset 0, the audit architecture at 4.
    program = [(load, 0, 0, 4), (jeq, 1, 0, audit_arch), (ret, 0, 0, kill), (load, 0, 0, 0)]
    checks = ([(jge, 0, 0, 0x40000000)] if arch == "x86_64" else []) + [(jeq, 0, 0, n) for n in refused]
    first = len(program)
    deny_at = first + len(checks) + 1  # after the checks and the allow
    for i, (code, _, _, k) in enumerate(checks):
        program.append((code, deny_at - (first + i) - 1, 0, k))
    program += [(ret, 0, 0, allow), (ret, 0, 0, deny)]
    return b"".join(struct.pack("HBBI", *op) for op in program)


def python() -> str:
    """The interpreter the jail runs, resolved out of a virtualenv (whose site-packages the tool never reads:
    `-I -S`), so that only the installation it belongs to is bound."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _binds() -> list[str]:
    """bwrap's arguments for the read-only view: /usr, the top-level links into it (or the directories, where /usr
    is not merged), the Python installation wherever it lives, and minimal /dev."""
    args = ["--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = "/" + name
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    roots = {os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix, os.path.dirname(python()))}
    bound = ["/usr"]
    for root in sorted(roots):  # a parent sorts before its children
        if root != "/" and not any((root + "/").startswith(b + "/") for b in bound):
            args += ["--ro-bind", root, root]
            bound.append(root)
    return args + ["--dev", "/dev"]


def command(workdir: str, argv: list[str], seccomp_fd: int | None) -> list[str]:
    """The command line that runs `argv` (starting with the interpreter, `python()`) in the jail, `workdir` writable
    as WORKDIR and the current directory. As root the jail drops to `nobody` with setpriv; otherwise bwrap makes a
    user namespace for the calling user."""
    jail = ["bwrap", *_binds(), "--bind", workdir, WORKDIR, "--chdir", WORKDIR,
            "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            "--hostname", "sandbox", "--die-with-parent", "--new-session", "--clearenv",
            "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "LC_ALL", "C.UTF-8"]
    if seccomp_fd is not None:
        jail += ["--seccomp", str(seccomp_fd)]
    if os.geteuid() == 0:
        drop = [shutil.which("setpriv") or "setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]
        return jail + ["--"] + drop + argv
    return jail + ["--unshare-user", "--cap-drop", "ALL", "--"] + argv


def prepare(workdir: str) -> None:
    """Makes the call's directory the jailed user's: as root, `nobody` owns it (else it could not write there)."""
    if os.geteuid() == 0:
        os.chown(workdir, NOBODY, NOBODY)


@functools.cache
def missing() -> str:
    """Why the jail cannot be set up on this machine ('' when it can): bwrap or setpriv not installed, or the
    kernel refusing its namespaces (a container without user namespaces, say). Checked once a process, by running
    the interpreter in the jail."""
    if shutil.which("bwrap") is None:
        return "bubblewrap (bwrap) is not installed (Debian/Ubuntu: apt-get install bubblewrap)"
    if os.geteuid() == 0 and shutil.which("setpriv") is None:
        return "util-linux's setpriv is not installed (it drops root to nobody inside the jail)"
    import tempfile

    with tempfile.TemporaryDirectory(prefix="posttrain-sandbox-") as workdir:
        prepare(workdir)
        try:
            proc = subprocess.run(command(workdir, [python(), "-I", "-S", "-c", "print(6 * 7)"], None),
                                  capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as error:
            return f"bwrap could not start the jail ({error})"
    if proc.returncode != 0 or proc.stdout.strip() != "42":
        said = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        return f"bwrap could not set up the jail here ({said})"
    return ""


def describe() -> str:
    """One line on what isolates the tool on this machine."""
    why = missing()
    if why:
        return f"not isolated: {why}"
    who = "nobody" if os.geteuid() == 0 else "the calling user in a user namespace"
    seccomp = f"seccomp ({_ARCH})" if seccomp_filter() is not None else f"no seccomp filter ({_ARCH} unknown here)"
    return f"bwrap: own mount, pid and network namespaces, read-only /usr, runs as {who}, {seccomp}"
