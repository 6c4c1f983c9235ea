"""The first code a sandboxed program runs: confine this process, then execute the candidate.

Run as ``python -I -S sandbox_boot.py <config.json>`` by :mod:`verity.rewards.sandbox`
(standard library only; it imports nothing from verity). In order, it

1. asks the kernel to SIGKILL it if its parent dies (``PR_SET_PDEATHSIG``);
2. reads the candidate code and test code (the config folder is readable by root only)
   and enters its working folder;
3. leaves the network: a new network namespace (``unshare(CLONE_NEWNET)``, only a
   loopback device, which is down) and a new IPC namespace (no System V or POSIX shared
   memory that outlives it) when the kernel allows it; with ``private_tmp`` also a new
   mount namespace in which every place it may write is private (:func:`_private_filesystem`:
   one tmpfs of ``disk_bytes`` over ``/tmp`` holding a fresh working folder, and folders of
   it bound over ``/var/tmp``, ``/dev/shm`` and ``/run/lock``; every other mount read-only);
   it reports which of these held in ``report_path``;
4. sets resource limits: CPU seconds, address space, file size, process count, open
   files, no core dumps;
5. when started as root and the interpreter or its virtual environment lives where other
   users cannot read it, bind-mounts those prefixes read-only into the private ``/tmp`` so
   the standard library and site-packages stay importable; then drops to the unprivileged
   ``uid``/``gid`` of this sandbox slot, with no supplementary groups (so ``RLIMIT_NPROC``
   binds and root-owned files are out of reach);
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
import re
import resource
import signal
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_NOSYMFOLLOW = 256
MS_NOATIME = 1024
MS_NODIRATIME = 2048
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_RELATIME = 1 << 21
MS_STRICTATIME = 1 << 24
PR_SET_PDEATHSIG = 1


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _die_with_parent(parent_pid):
    with contextlib.suppress(OSError, AttributeError):
        _libc().prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(137)


def _leave_network(private_fs):
    """Enter new namespaces. Returns (network_isolated, mount_namespace)."""
    libc = _libc()
    if os.geteuid() == 0:
        flags = CLONE_NEWNET | CLONE_NEWIPC | (CLONE_NEWNS if private_fs else 0)
        if libc.unshare(flags) == 0:
            return True, bool(private_fs)
        if libc.unshare(CLONE_NEWNET) == 0:
            return True, False
        return False, False
    # Not root: a user namespace may still grant a private network namespace.
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0:
        return True, False
    return False, False


_MOUNT_FLAGS = {
    "nosuid": MS_NOSUID,
    "nodev": MS_NODEV,
    "noexec": MS_NOEXEC,
    "noatime": MS_NOATIME,
    "nodiratime": MS_NODIRATIME,
    "relatime": MS_RELATIME,
    "strictatime": MS_STRICTATIME,
    "nosymfollow": MS_NOSYMFOLLOW,
}
_PRIVATE_PLACES = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")


def _mount_points():
    """(mount point, its per-mount flags) of every mount this process sees, parents first."""
    points = []
    with open("/proc/self/mountinfo") as handle:
        for line in handle:
            fields = line.split()
            path = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
            flags = 0
            for option in fields[5].split(","):
                flags |= _MOUNT_FLAGS.get(option, 0)
            points.append((path, flags))
    return points


def _private_filesystem(workdir, owner, budget_bytes):
    """Make every place this process can write private, on one size-limited tmpfs.

    In the new mount namespace: a tmpfs of ``budget_bytes`` over ``/tmp`` holds the
    working folder (recreated at its own path, owned by ``owner``, so absolute paths to it
    keep working) and one folder each for ``/var/tmp``, ``/dev/shm`` and ``/run/lock``,
    bind-mounted there; every other mount is remounted read-only (devices stay usable: a
    read-only mount does not stop writes to ``/dev/null``). Nothing written survives the
    process, and the total written is capped by the tmpfs size. The working folder must
    lie under ``/tmp`` (the caller creates it there). Returns (mounted, read_only_elsewhere).
    """
    libc = _libc()
    workdir = os.path.abspath(workdir)
    if not workdir.startswith("/tmp/") or libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        return False, False
    options = f"size={budget_bytes},mode=1777".encode()
    if libc.mount(b"tmpfs", b"/tmp", b"tmpfs", MS_NOSUID | MS_NODEV, options) != 0:
        return False, False
    jail = os.path.dirname(workdir)
    os.makedirs(jail, mode=0o711)
    os.chmod(jail, 0o711)
    os.mkdir(workdir, mode=0o700)
    if owner is not None:
        os.chown(workdir, owner, owner)
    os.chdir(workdir)
    covered = {"/tmp"}
    others = [p for p in _PRIVATE_PLACES[1:] if os.path.isdir(p) and not os.path.islink(p)]
    for index, place in enumerate(others):
        source = f"/tmp/.verity-private/{index}"
        os.makedirs(source)
        os.chmod(source, 0o1777)
        if libc.mount(source.encode(), place.encode(), None, MS_BIND, None) != 0:
            return True, False
        covered.add(place)
    read_only = True
    for path, flags in _mount_points():
        if path in covered or path.startswith(("/tmp/", "/proc/")):
            continue
        remount = MS_REMOUNT | MS_BIND | MS_RDONLY | flags
        if libc.mount(None, path.encode(), None, remount, None) != 0 and os.path.exists(path):
            read_only = False
    return True, read_only


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


def _expose_python(private_fs):
    """Keep the standard library (and site-packages) importable after dropping to an unprivileged uid.

    When the interpreter or its virtual environment lives under a folder other users
    cannot enter (e.g. ``/root/.pyenv``, a venv under ``/root``), bind-mount each such
    prefix read-only under ``/tmp/.verity-python`` (inside the private tmpfs) and point
    ``sys.path`` there; without a private filesystem, import the common modules now instead.
    """
    prefixes = [p for p in dict.fromkeys((sys.base_prefix, sys.prefix)) if not _world_traversable(p)]
    if os.geteuid() != 0 or not prefixes:
        return
    if private_fs:
        libc = _libc()
        for index, prefix in enumerate(prefixes):
            target = f"/tmp/.verity-python{index}"
            os.makedirs(target, mode=0o755, exist_ok=True)
            if libc.mount(prefix.encode(), target.encode(), None, MS_BIND | MS_REC, None) != 0:
                continue
            libc.mount(None, target.encode(), None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_REC, None)

            def remap(paths, prefix=prefix, target=target):
                for i, entry in enumerate(paths):
                    if entry == prefix or entry.startswith(prefix + os.sep):
                        paths[i] = target + entry[len(prefix) :]

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


def _report(handle, facts):
    """Tell the parent which isolation held (written while still root, then closed)."""
    if handle is not None:
        with handle:
            json.dump(facts, handle)


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
    # opened now: /tmp, where the root-only control folder lives, is covered below
    report = open(config["report_path"], "w") if config.get("report_path") else None  # noqa: SIM115
    os.chdir(config["workdir"])  # before /tmp is covered: the working folder stays reachable
    isolated, own_mounts = _leave_network(config["private_tmp"])
    private_fs, read_only = (False, False)
    if own_mounts:
        private_fs, read_only = _private_filesystem(
            config["workdir"], config.get("uid"), config["disk_bytes"]
        )
    _expose_python(private_fs)
    _report(
        report,
        {"network_namespace": isolated, "private_filesystem": private_fs, "read_only_elsewhere": read_only},
    )
    _set_limits(config["limits"])
    _drop_privileges(config.get("uid"), config.get("gid"))
    if not isolated:
        _block_sockets()
    os.environ.clear()
    os.environ.update({"HOME": os.getcwd(), "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
    sys.argv = ["solution.py"]
    namespace = {"__name__": "__main__", "__file__": "solution.py", "__builtins__": __builtins__}
    del config, handle, report
    exec(compile(code, "solution.py", "exec"), namespace)
    if test_code is not None:
        exec(compile(test_code, "tests.py", "exec"), namespace)
        sys.stdout.flush()
        sys.stdout.write("\n" + marker + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
