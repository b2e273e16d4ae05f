"""The sandbox's first Python: runs inside the sandboxed interpreter, hardens it, then runs the model's code.

Standard library only: the sandbox copies this file into the scratch directory and starts it with ``python -I -S -B``
(no site-packages there). ``argv[1]`` is a JSON plan from ``training/sandbox``: ``mounts`` (the namespaces level: hide
and make read-only, as the new user namespace's root), ``landlock`` (paths it may read / write), ``seccomp`` (a BPF
file built outside with libseccomp), ``mode`` (``run``: exec ``main.py`` once; ``serve``: cells from a control pipe,
state kept between them). Each wall reports what it did on stderr only when it fails: a plan that cannot be applied
exits 70 before any model code runs (the sandbox refuses to run weaker than it said).
"""
import ctypes
import json
import os
import struct
import sys

FAILED_TO_HARDEN = 70
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]
_libc.syscall.restype = ctypes.c_long
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 8, 32, 4096, 16384
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 24, 22, 2
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446  # on every arch
SYS_CAPSET = {"x86_64": 126, "aarch64": 91}[os.uname().machine]
_LOCKED_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
                 "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME}


def _check(result, what):
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def _mount(source, target, fstype, flags, data=None):
    _check(_libc.mount(source and source.encode(), target.encode(), fstype and fstype.encode(), flags,
                       data and data.encode()), f"mount {target}")


# ---- the namespaces level: a private tmpfs over the secrets, the rest of the tree read-only

def _mount_points():
    with open("/proc/self/mountinfo") as f:
        rows = [line.split() for line in f]
    return [(row[4].replace("\\040", " "), row[5].split(",")) for row in rows]


def _remount_read_only(keep_writable, covered):
    """Every mount read-only except ``keep_writable`` ones and those under a tmpfs we laid (unreachable now); a
    mount inherited from the host keeps its locked flags (nosuid, nodev, ...), which a remount must repeat."""
    for point, options in _mount_points():
        if point in keep_writable or "ro" in options or any(point.startswith(top + "/") for top in covered):
            continue
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for name, bit in _LOCKED_FLAGS.items():
            flags |= bit if name in options else 0
        _mount(None, point, None, flags)


def _bind_from_fd(fd, target, is_dir):
    if is_dir:
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    _mount(f"/proc/self/fd/{fd}", target, None, MS_BIND | MS_REC)


def setup_mounts(plan):
    """tmpfs over ``hide`` (storage root, Dagster home, $HOME, /tmp) and /dev; ``keep`` paths (the interpreter's
    install tree, when it lives under $HOME) and a few devices bound back; the scratch dir rw; the rest read-only."""
    keep = {path: os.open(path, os.O_PATH) for path in plan["keep"] if os.path.exists(path)}
    devices = {dev: os.open(dev, os.O_PATH) for dev in ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")}
    scratch = plan["scratch"]
    scratch_fd = os.open(scratch, os.O_PATH)
    for path in [*plan["hide"], "/dev"]:
        _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=64m")
    for path, fd in keep.items():
        _bind_from_fd(fd, path, True)
    for dev, fd in devices.items():
        _bind_from_fd(fd, dev, False)
    _bind_from_fd(scratch_fd, scratch, True)
    _remount_read_only({scratch, "/tmp", "/proc", *plan["hide"]} - set(plan["keep"]), [*plan["hide"], "/dev"])
    # the tmpfs over the secrets stays writable scratch space only where it is /tmp
    for path in plan["hide"]:
        if path != "/tmp":
            _mount(None, path, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def drop_capabilities():
    """No capability left (the namespace's root could otherwise unmount the tmpfs over the secrets)."""
    for cap in range(64):  # EPERM where it may not (no CAP_SETPCAP: then it had none to keep); EINVAL past the last
        if _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0 and ctypes.get_errno() == 22:
            break
    header = struct.pack("II", 0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = ctypes.create_string_buffer(24)
    _check(_libc.syscall(SYS_CAPSET, ctypes.c_char_p(header), data), "capset")


# ---- Landlock: read the system and the interpreter, write the scratch dir; no TCP; no signals or abstract
# sockets out of the sandbox (ABI 6)

_FS_RIGHTS = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 4: (1 << 15) - 1, 5: (1 << 16) - 1}
_READ = 1 | 4 | 8  # execute, read file, read dir
_FILE_ONLY = 1 | 2 | 4 | (1 << 14) | (1 << 15)  # rights a rule on a file (not a directory) may carry


def landlock(plan):
    abi = min(_libc.syscall(SYS_LANDLOCK_CREATE_RULESET, None, 0, 1), 7)
    if abi < 1:
        raise OSError("Landlock is not available in this kernel")
    fs = _FS_RIGHTS.get(abi, (1 << 16) - 1)
    attr = struct.pack("QQQ", fs, 3 if abi >= 4 else 0, 3 if abi >= 6 else 0)[:8 if abi < 4 else 16 if abi < 6 else 24]
    ruleset = _check(_libc.syscall(SYS_LANDLOCK_CREATE_RULESET, ctypes.c_char_p(attr), len(attr), 0),
                     "landlock_create_ruleset")
    for paths, rights in ((plan["read"], _READ), (plan["write"], fs)):
        for path in paths:
            if not os.path.exists(path):
                continue
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            allowed = rights if os.path.isdir(path) else rights & _FILE_ONLY
            rule = struct.pack("=Qi", allowed, fd)
            _check(_libc.syscall(SYS_LANDLOCK_ADD_RULE, ruleset, 1, ctypes.c_char_p(rule), 0), f"landlock {path}")
            os.close(fd)
    _check(_libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset, 0), "landlock_restrict_self")
    os.close(ruleset)
    return abi


def seccomp(path):
    """Load the BPF program libseccomp compiled outside (no ptrace, no new processes or programs, no sockets but
    AF_UNIX, no mounts or namespaces, no kernel keyrings/bpf/perf)."""
    with open(path, "rb") as f:
        program = f.read()
    filt = ctypes.create_string_buffer(program)
    prog = struct.pack("HxxxxxxQ", len(program) // 8, ctypes.addressof(filt))
    _check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.c_char_p(prog), 0, 0), "seccomp")


def audit_guard(root, stdlib):
    """The weak level's Python-level wall: files outside the scratch dir (reads also outside the stdlib), new
    processes, ctypes, signals and sockets refused. Not a boundary (native code can pass it)."""
    def inside(path, *tops):
        path = os.path.realpath(os.fsdecode(path))
        return any(path == top or path.startswith(top + os.sep) for top in tops)

    def hook(event, args):
        if event == "open" and args and not isinstance(args[0], int):
            mode, flags = (list(args[1:3]) + [None, None])[:2]
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool(
                (flags or 0) & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
            if not inside(args[0], root) and (writing or not inside(args[0], stdlib)):
                raise PermissionError(f"sandbox: {args[0]} is outside the sandbox")
        elif event in ("os.listdir", "os.scandir", "os.chdir") and args and isinstance(args[0], (str, bytes)):
            if not inside(args[0], root, stdlib):
                raise PermissionError(f"sandbox: {event} outside the sandbox")
        elif event in ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.symlink", "os.link", "os.chmod",
                       "os.truncate") and args and isinstance(args[0], (str, bytes)):
            if not inside(args[0], root) or (len(args) > 1 and isinstance(args[1], (str, bytes))
                                             and not inside(args[1], root)):
                raise PermissionError(f"sandbox: {event} outside the sandbox")
        elif event.startswith(("subprocess.", "os.exec", "os.posix_spawn", "os.system", "os.fork", "os.forkpty",
                               "ctypes.", "os.kill", "os.killpg", "pty.", "socket.")):
            raise PermissionError(f"sandbox: {event} is not allowed")
    sys.addaudithook(hook)


def set_limits(limits):
    """rlimits set here, before any model code, rather than between fork and exec in the parent: a parent that
    sets none can start us with vfork, which stays cheap when the parent is a trainer holding gigabytes."""
    import resource
    for name, value in limits.items():
        resource.setrlimit(getattr(resource, name), (value, value))


def harden(plan):
    set_limits(plan["limits"])
    if plan.get("mounts"):
        setup_mounts(plan["mounts"])
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    drop_capabilities()  # at every level: bubblewrap run by root keeps them in its namespace, so does root itself
    if plan.get("landlock"):
        landlock(plan["landlock"])
    if plan.get("seccomp"):
        seccomp(plan["seccomp"])
    os.chdir(plan["cwd"])
    if plan.get("audit_guard"):
        audit_guard(os.path.realpath(plan["cwd"]), os.path.realpath(sys.base_prefix))


# ---- running the model's code

def _print_trimmed(exc, prefix):
    """The traceback from the first frame of the model's code on (this file's frames are not the model's)."""
    import traceback
    trace = exc.__traceback__
    while trace is not None and not trace.tb_frame.f_code.co_filename.startswith(prefix):
        trace = trace.tb_next
    traceback.print_exception(type(exc), exc, trace)


def _exit_code(exc):
    """What the process exit status of ``raise SystemExit(code)`` would be."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code % 256
    print(exc.code, file=sys.stderr)
    return 1


def run_once():
    with open("main.py") as f:
        code = compile(f.read(), "main.py", "exec")
    try:
        exec(code, {"__name__": "__main__", "__file__": "main.py", "__builtins__": __builtins__})
    except SystemExit:
        raise
    except BaseException as exc:
        _print_trimmed(exc, "main.py")
        sys.exit(1)


class _Discard:
    def write(self, text):
        return len(text)

    def flush(self):
        pass


def _run_cell(scope, source, name, echo):
    """A cell as a REPL runs it: its last expression's value is printed (``training/agent/tools.py``'s replay)."""
    import ast
    tree = ast.parse(source, name)
    last = tree.body.pop() if echo and tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, name, "exec"), scope)
    if last is not None:
        value = eval(compile(ast.Expression(last.value), name, "eval"), scope)
        if value is not None:
            print(repr(value))


def cell(scope, message, streams):
    """Run one cell message (``silent``: a replay, output dropped, errors swallowed); its exit code."""
    if message.get("silent"):  # a replay after a restart: output dropped, errors swallowed
        sys.stdout = sys.stderr = _Discard()
        try:
            _run_cell(scope, message["cell"], message["name"], False)
        except BaseException:
            pass
        return 0
    try:
        _run_cell(scope, message["cell"], message["name"], True)
        return 0
    except SystemExit as exc:
        sys.stdout, sys.stderr = streams
        return _exit_code(exc)
    except BaseException as exc:
        sys.stdout, sys.stderr = streams
        _print_trimmed(exc, "<cell")
        return 1


def serve(control_in, control_out):
    """Cells from ``control_in`` (4-byte length + JSON), one reply each on ``control_out`` after the cell's
    output and an end marker on stdout and stderr (the parent reads each stream up to its marker)."""
    scope, streams = {"__name__": "__main__"}, (sys.stdout, sys.stderr)
    reader = os.fdopen(control_in, "rb", buffering=0)
    while True:
        header = reader.read(4)
        if len(header) < 4:
            return
        size, body = struct.unpack("I", header)[0], b""
        while len(body) < size:
            chunk = reader.read(size - len(body))
            if not chunk:
                return
            body += chunk
        message = json.loads(body)
        code = cell(scope, message, streams)
        sys.stdout, sys.stderr = streams  # a cell that swapped them does not keep them (as in a fresh process)
        if message.get("silent"):
            continue
        for stream in streams:
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        marker = b"\0" + message["token"].encode() + b"\0"
        os.write(1, marker)
        os.write(2, marker)
        os.write(control_out, json.dumps({"exit": code}).encode() + b"\n")


def main():
    plan = json.loads(sys.argv[1])
    try:
        harden(plan)
    except OSError as exc:
        print(f"sandbox: could not harden the interpreter ({exc}); nothing ran", file=sys.stderr)
        os._exit(FAILED_TO_HARDEN)
    if plan["mode"] == "serve":
        serve(*plan["control"])
    else:
        run_once()


if __name__ == "__main__":
    main()
