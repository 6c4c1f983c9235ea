"""The first code a sandboxed program runs: confine this process, then execute the candidate.

Run as ``python -I -S sandbox_boot.py <config.json>`` by :mod:`verity.rewards.sandbox`
(standard library only; it imports nothing from verity). In order, it

1. asks the kernel to SIGKILL it if its parent dies (``PR_SET_PDEATHSIG``);
2. reads the candidate code and test code (the config folder is readable by root only)
   and enters its working folder;
3. leaves the network: a new network namespace (``unshare(CLONE_NEWNET)``, only a
   loopback device, which is down) when the kernel allows it; with ``private_tmp`` also
   a new mount namespace with fresh, small tmpfs mounts over ``/tmp``, ``/var/tmp`` and
   ``/dev/shm`` (the working folder stays reachable as the current directory);
4. sets resource limits: CPU seconds, address space, file size, process count, open
   files, no core dumps;
5. when started as root and the interpreter lives where other users cannot read it,
   bind-mounts the interpreter's prefix read-only into the private ``/tmp`` so the
   standard library stays importable; then drops to the unprivileged ``uid``/``gid`` of this sandbox slot,
   with no supplementary groups (so ``RLIMIT_NPROC`` binds and root-owned files are
   out of reach);
6. without a network namespace, replaces the ``socket`` module's socket constructors
   with a function that raises (a Python-level block only);
7. executes the candidate as ``__main__``; in test mode then executes the test code in
   the same namespace and prints the run's completion marker, which the parent requires
   (so ``sys.exit(0)`` or ``os._exit(0)`` inside the candidate does not count as passing).
"""

import contextlib
import ctypes
import json
import os
import resource
import signal
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_RDONLY = 1
MS_REMOUNT = 32
MS_BIND = 4096
PR_SET_PDEATHSIG = 1


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _die_with_parent(parent_pid):
    with contextlib.suppress(OSError, AttributeError):
        _libc().prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(137)


def _leave_network(private_tmp, tmp_size_bytes):
    """Returns (network_isolated, private_tmp_mounted)."""
    libc = _libc()
    if os.geteuid() == 0:
        flags = CLONE_NEWNET | (CLONE_NEWNS if private_tmp else 0)
        if libc.unshare(flags) == 0:
            mounted = False
            if private_tmp and libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) == 0:
                mounted = True
                options = f"size={tmp_size_bytes},mode=1777".encode()
                for target in (b"/tmp", b"/var/tmp", b"/dev/shm"):
                    if os.path.isdir(target) and libc.mount(b"tmpfs", target, b"tmpfs", 0, options) != 0:
                        mounted = False
            return True, mounted and private_tmp
        if libc.unshare(CLONE_NEWNET) == 0:
            return True, False
        return False, False
    # Not root: a user namespace may still grant a private network namespace.
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0:
        return True, False
    return False, False


def _world_traversable(path):
    """Whether every folder on the way to ``path`` lets other users in (o+x)."""
    path = os.path.abspath(path)
    while True:
        try:
            if not os.stat(path).st_mode & 0o001:
                return False
        except OSError:
            return False
        parent = os.path.dirname(path)
        if parent == path:
            return True
        path = parent


def _expose_python(private_tmp_mounted):
    """Keep the standard library importable after dropping to an unprivileged uid.

    When the interpreter lives under a folder other users cannot enter (e.g. ``/root/.pyenv``),
    bind-mount its prefix read-only at ``/tmp/.verity-python`` (inside the private tmpfs) and
    point ``sys.path`` there; without a private tmpfs, import the common modules now instead.
    """
    prefix = sys.base_prefix
    if os.geteuid() != 0 or _world_traversable(prefix):
        return
    if private_tmp_mounted:
        target = "/tmp/.verity-python"
        os.makedirs(target, mode=0o755, exist_ok=True)
        libc = _libc()
        if libc.mount(prefix.encode(), target.encode(), None, MS_BIND | MS_REC, None) == 0:
            libc.mount(None, target.encode(), None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_REC, None)

            def remap(paths):
                for index, entry in enumerate(paths):
                    if entry == prefix or entry.startswith(prefix + os.sep):
                        paths[index] = target + entry[len(prefix) :]

            remap(sys.path)
            for module in list(sys.modules.values()):  # packages already imported look up submodules here
                package_path = getattr(module, "__path__", None)
                if isinstance(package_path, list):
                    remap(package_path)
            sys.path_importer_cache.clear()
            return
    for name in _COMMON_MODULES:
        with contextlib.suppress(ImportError):
            __import__(name)


_COMMON_MODULES = (
    "bisect", "collections", "copy", "dataclasses", "decimal", "fractions", "functools", "heapq",
    "itertools", "json", "math", "operator", "random", "re", "socket", "statistics", "string",
    "time", "typing", "array", "queue", "threading", "io", "sys", "os",
)  # fmt: skip


def _set_limits(limits):
    def cap(kind, value):
        if value is None:
            return
        soft, hard = value if isinstance(value, list) else (value, value)
        try:
            resource.setrlimit(kind, (soft, hard))
        except (ValueError, OSError):
            resource.setrlimit(kind, (soft, resource.getrlimit(kind)[1]))

    cap(resource.RLIMIT_CPU, [limits["cpu_s"], limits["cpu_s"] + 1])
    cap(resource.RLIMIT_AS, limits["memory_bytes"])
    cap(resource.RLIMIT_FSIZE, limits["fsize_bytes"])
    cap(resource.RLIMIT_NPROC, limits["nproc"])
    cap(resource.RLIMIT_NOFILE, limits["nofile"])
    cap(resource.RLIMIT_CORE, 0)


def _drop_privileges(uid, gid):
    if os.geteuid() != 0 or uid is None:
        return
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    if os.geteuid() == 0 or os.getuid() == 0:
        os._exit(126)


def _block_sockets():
    import socket

    def refuse(*args, **kwargs):
        raise PermissionError("network access is disabled in this sandbox")

    for name in ("socket", "create_connection", "create_server", "socketpair", "fromfd", "getaddrinfo"):
        if hasattr(socket, name):
            setattr(socket, name, refuse)
    try:
        import _socket

        _socket.socket = refuse
        _socket.getaddrinfo = refuse
    except ImportError:
        pass


def main():
    with open(sys.argv[1]) as handle:
        config = json.load(handle)
    _die_with_parent(config["parent_pid"])
    with open(config["code_path"]) as handle:
        code = handle.read()
    test_code = None
    if config.get("test_path"):
        with open(config["test_path"]) as handle:
            test_code = handle.read()
    marker = config.get("marker")
    os.chdir(config["workdir"])  # before /tmp is covered: the working folder stays reachable
    isolated, private_tmp = _leave_network(config["private_tmp"], config["limits"]["fsize_bytes"])
    _expose_python(private_tmp)
    _set_limits(config["limits"])
    _drop_privileges(config.get("uid"), config.get("gid"))
    if not isolated:
        _block_sockets()
    os.environ.clear()
    os.environ.update({"HOME": config["workdir"], "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
    sys.argv = ["solution.py"]
    namespace = {"__name__": "__main__", "__file__": "solution.py", "__builtins__": __builtins__}
    del config, handle
    exec(compile(code, "solution.py", "exec"), namespace)
    if test_code is not None:
        exec(compile(test_code, "tests.py", "exec"), namespace)
        sys.stdout.flush()
        sys.stdout.write("\n" + marker + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
