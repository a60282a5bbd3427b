"""The operating system's walls around the Python tool's process: what the sandbox's isolation rests on.

Checks inside the interpreter that runs untrusted code cannot hold: that code has the checker's own powers and can
rewrite it (swap a function's `__code__`, patch `os`, reach a module through `sys.modules`). So the process that runs
a model's code is started by bubblewrap (`bwrap`, Debian's `bubblewrap`) in a jail the kernel enforces:

- **its own namespaces**: mount, pid, network, IPC, UTS and cgroup. It sees no other process (the trainer included:
  it cannot signal what it cannot name), and has no network at all, only an unconfigured loopback;
- **a read-only view of the system's software and nothing else**: `/usr`, and the interpreter, its standard library
  and its shared library where Python is installed elsewhere, are bound read-only; `/dev` holds the null, zero and
  random devices, read-only; the one writable directory is the call's own (`/tool`), a 64 MiB tmpfs that is gone
  with the call. No `/etc`, `/home`, `/root`, `/proc`, `/tmp`, nor the run's or the user's files;
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
WORKDIR = "/tool"  # the call's own directory inside the jail: a tmpfs of its own, gone with the call
WORKDIR_BYTES = 64 << 20  # its size: files written there are memory the address-space limit does not count

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


@functools.cache  # the same for every call of a process: the installation does not move
def _binds() -> tuple[str, ...]:
    """bwrap's arguments for the read-only view: /usr, the top-level links into it (or the directories, where /usr
    is not merged), and, for an interpreter installed elsewhere (pyenv, a prefix under a home directory), its
    executable, its standard library and its shared library alone, not the directory around them."""
    args = ["--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = "/" + name
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    import sysconfig

    base = {"base": sys.base_prefix, "platbase": sys.base_exec_prefix, "installed_base": sys.base_prefix,
            "installed_platbase": sys.base_exec_prefix}
    paths = sysconfig.get_paths(vars=base)
    needed = [python(), paths["stdlib"], paths["platstdlib"]]  # lib-dynload is in the latter
    if sysconfig.get_config_var("Py_ENABLE_SHARED"):
        needed.append(os.path.join(sysconfig.get_config_var("LIBDIR") or "", sysconfig.get_config_var("INSTSONAME")
                                   or ""))
    bound: list[str] = []
    for path in sorted({os.path.realpath(p) for p in needed if p and os.path.exists(p)}):  # parents sort first
        if not path.startswith("/usr/") and not any(path.startswith(b + "/") for b in bound):
            args += ["--ro-bind", path, path]
            bound.append(path)
    return tuple(args + ["--dev", "/dev"])


def command(argv: list[str], seccomp_fd: int | None) -> list[str]:
    """The command line that runs `argv` (starting with the interpreter, `python()`) in the jail, in its own writable
    WORKDIR, the rest of its view read-only. As root the jail drops to `nobody` with setpriv; otherwise bwrap makes a
    user namespace for the calling user."""
    jail = ["bwrap", *_binds(), "--perms", "1777", "--size", str(WORKDIR_BYTES), "--tmpfs", WORKDIR,
            "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", WORKDIR,
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


def seccomp_pipe() -> tuple[int, ...]:
    """The seccomp filter in a pipe bwrap reads (its `--seccomp FD`): (the read end,), or () where there is none."""
    program = seccomp_filter()
    if program is None:
        return ()
    read, write = os.pipe()
    os.write(write, program)  # a few hundred bytes: far below a pipe's buffer
    os.close(write)
    return (read,)


@functools.cache
def missing() -> str:
    """Why the jail cannot be set up on this machine ('' when it can): bwrap or setpriv not installed, or the
    kernel refusing its namespaces (a container without user namespaces, say). Checked once a process, by running
    the interpreter in the jail."""
    if shutil.which("bwrap") is None:
        return "bubblewrap (bwrap) is not installed (Debian/Ubuntu: apt-get install bubblewrap)"
    if os.geteuid() == 0 and shutil.which("setpriv") is None:
        return "util-linux's setpriv is not installed (it drops root to nobody inside the jail)"
    fds = seccomp_pipe()  # the jail as each call sets it up, its seccomp filter included
    try:
        proc = subprocess.run(command([python(), "-I", "-S", "-c", "print(6 * 7)"], fds[0] if fds else None),
                              capture_output=True, text=True, timeout=30, pass_fds=fds, cwd="/")
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"bwrap could not start the jail ({error})"
    finally:
        for fd in fds:
            os.close(fd)
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
