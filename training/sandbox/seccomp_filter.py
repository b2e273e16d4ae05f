"""The seccomp filter, the sandbox's second wall: compiled once here with libseccomp (``pyseccomp``, a ctypes binding
to the system's ``libseccomp.so.2``), loaded inside the sandbox by ``inside.py`` before any model code runs.

Refused with EPERM (the model sees ``PermissionError: [Errno 1] Operation not permitted``): new processes (fork,
vfork, clone without CLONE_THREAD: threads still work) and new programs (execve), ptrace and reading other processes'
memory, signals to anything but its own process group, sockets other than AF_UNIX, mounts and namespaces, kernel
keyrings, bpf, perf, userfaultfd, io_uring, module and reboot calls. clone3 answers ENOSYS (its flags sit behind a
pointer a filter cannot read) so the C library falls back to clone, which the filter can check.
"""
from __future__ import annotations

import errno
import os
import socket
import tempfile

CLONE_THREAD = 0x10000
DENIED = (
    "fork", "vfork", "execve", "execveat", "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_open",
    "pidfd_getfd", "pidfd_send_signal", "tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo", "mount", "umount2",
    "pivot_root", "chroot", "unshare", "setns", "move_mount", "open_tree", "fsopen", "fsmount", "fsconfig", "keyctl",
    "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter",
    "io_uring_register", "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load", "reboot",
    "swapon", "swapoff", "acct", "open_by_handle_at", "name_to_handle_at", "syslog", "settimeofday", "clock_settime",
    "adjtimex", "sethostname", "setdomainname", "iopl", "ioperm", "personality", "capset", "quotactl",
    "mknod", "mknodat",
)

_CACHE: dict[str, object] = {}


def unavailable_reason() -> str | None:
    """Why no filter can be built here (the binding or the library missing), None when one can."""
    try:
        import pyseccomp  # noqa: F401
    except (ImportError, RuntimeError, OSError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _build() -> bytes:
    import pyseccomp as sc

    filt = sc.SyscallFilter(sc.ALLOW)
    deny = sc.ERRNO(errno.EPERM)
    for name in DENIED:
        try:
            filt.add_rule(deny, name)
        except (OSError, ValueError, RuntimeError):  # a call this architecture does not have (e.g. iopl on arm64)
            continue
    filt.add_rule(deny, "clone", sc.Arg(0, sc.MASKED_EQ, CLONE_THREAD, 0))
    filt.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    filt.add_rule(deny, "socket", sc.Arg(0, sc.NE, socket.AF_UNIX))
    filt.add_rule(deny, "kill", sc.Arg(0, sc.NE, 0))  # kill(0, sig): its own process group only
    with tempfile.TemporaryFile() as f:
        filt.export_bpf(f)
        f.seek(0)
        return f.read()


def program() -> bytes:
    """The compiled BPF program (built once per process); raises when ``unavailable_reason()`` says why not."""
    if "bpf" not in _CACHE:
        _CACHE["bpf"] = _build()
    return _CACHE["bpf"]  # type: ignore[return-value]


def write_program(folder: str) -> str:
    """The program as a file in ``folder`` (read inside the sandbox before the filter goes on)."""
    path = os.path.join(folder, ".seccomp.bpf")
    with open(path, "wb") as f:
        f.write(program())
    return path
