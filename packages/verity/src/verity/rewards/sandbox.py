"""Run an untrusted Python program in a confined child process.

:func:`run_python` starts ``python -I [-S] sandbox_boot.py`` in a new session, with
stdin/stdout/stderr on files, in a fresh temporary working folder, and kills the
whole session at the wall-clock timeout. The boot script confines itself before
the candidate runs (see :mod:`verity.rewards.sandbox_boot`). What holds, by case:

============================  =====================================================================
root (tests, containers)      network and IPC namespaces (no network at all, no shared memory
                              that outlives it); a mount namespace where everything it may write
                              is private: one tmpfs of ``disk_mb`` over ``/tmp`` holds its working
                              folder, with folders of it over ``/var/tmp``, ``/dev/shm``,
                              ``/run/lock``, and every other mount is read-only — so nothing it
                              writes survives the run and the total it writes is capped; runs as
                              an unprivileged uid of its own (``uid_base + pid of the calling
                              process``), so ``RLIMIT_NPROC`` caps its process count (a fork bomb
                              stalls at ``nproc``) and root-owned files are out of reach. Leftover
                              processes are killed by uid afterwards, from this process (nothing
                              is executed as that uid, so an interpreter in a folder the uid cannot
                              enter, e.g. a venv under ``/root``, works).
not root, user namespaces     network namespace; same user as the caller; ``RLIMIT_NPROC``
                              counts all the user's processes; working folder on disk, its size
                              polled against ``disk_mb`` (the run is killed above it).
not root, none of that        Python-level socket block only (a program using ``ctypes`` or a
                              subprocess can get round it); files the user can write are
                              writable; the working folder polled against ``disk_mb``.
always                        ``RLIMIT_CPU``, ``RLIMIT_AS``, ``RLIMIT_FSIZE``, ``RLIMIT_NOFILE``, no
                              core dumps, wall timeout killing the session, output read back
                              capped at ``max_output_bytes``, the child dies if its parent dies.
============================  =====================================================================

This is process isolation, not a VM: it is meant to contain buggy or
reward-hacking programs written by a policy, not a determined attacker with
kernel exploits. The result says which isolation held (``SandboxResult.isolation``).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

_BOOT = Path(__file__).with_name("sandbox_boot.py")
_MIB = 1024 * 1024
PR_SET_CHILD_SUBREAPER = 36


@dataclass
class SandboxLimits:
    """Limits of one sandboxed run.

    ``wall_s``: seconds of wall time before the session is killed; ``cpu_s``: CPU seconds
    (``RLIMIT_CPU``, per process); ``memory_mb``: address space (``RLIMIT_AS``);
    ``fsize_mb``: largest file it may write, stdout included (``RLIMIT_FSIZE``);
    ``nproc``: processes and threads (``RLIMIT_NPROC``); ``nofile``: open files;
    ``max_output_bytes``: how much stdout/stderr is read back; ``site_packages``: let the
    program import installed packages (off: standard library only, faster start);
    ``drop_privileges``: when root, run as a per-slot unprivileged uid; ``uid_base``:
    first uid of that range; ``private_tmp``: when root, make every writable place private
    (see the module docstring); ``disk_mb``: the most it may write in all, its working folder
    and temporary folders together (MiB).
    """

    wall_s: float = 5.0
    cpu_s: int = 4
    memory_mb: int = 1024
    fsize_mb: int = 16
    nproc: int = 32
    nofile: int = 64
    max_output_bytes: int = 1 * _MIB
    site_packages: bool = False
    drop_privileges: bool = True
    uid_base: int = 200_000
    private_tmp: bool = True
    disk_mb: int = 64

    def __post_init__(self) -> None:
        names = ("wall_s", "cpu_s", "memory_mb", "fsize_mb", "nproc", "nofile", "max_output_bytes", "disk_mb")
        for name in names:
            if not getattr(self, name) > 0:
                raise ValueError(f"sandbox {name}: expected > 0, got {getattr(self, name)!r}")


@dataclass
class SandboxResult:
    """Outcome of one run.

    ``status``: ``"ok"`` (exit code 0), ``"error"`` (non-zero exit), ``"timeout"`` (killed at
    the wall limit), ``"signal"`` (killed by a signal, e.g. SIGXCPU at the CPU limit,
    SIGXFSZ at the file-size limit); ``returncode``: negative for a signal;
    ``stdout``/``stderr``: decoded text (capped); ``wall_s``: seconds;
    ``isolation``: what confinement held (see the module docstring).
    """

    status: str
    returncode: int | None
    stdout: str
    stderr: str
    wall_s: float
    isolation: dict[str, bool] = field(default_factory=dict)


def _uid_range_allows(uid: int) -> bool:
    try:
        lines = Path("/proc/self/uid_map").read_text().split("\n")
    except OSError:
        return False
    for line in lines:
        parts = line.split()
        if len(parts) == 3:
            inside, _, count = (int(p) for p in parts)
            if inside <= uid < inside + count:
                return True
    return False


def sandbox_uid_for(pid: int, limits: SandboxLimits | None = None) -> int | None:
    """The unprivileged uid a sandbox started by process ``pid`` runs as (None when no uid is dropped)."""
    limits = limits or SandboxLimits()
    if os.geteuid() != 0 or not limits.drop_privileges:
        return None
    uid = limits.uid_base + pid
    return uid if _uid_range_allows(uid) else None


def _processes() -> list[tuple[int, int, str, int, int]]:
    """(pid, uid, state, ppid, session) of every process this kernel shows us."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            uid = os.stat(f"/proc/{entry}").st_uid
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields_after_name = stat.rsplit(")", 1)[-1].split()
        if len(fields_after_name) < 4:
            continue
        state, ppid, _pgrp, session = (
            fields_after_name[0],
            int(fields_after_name[1]),
            0,
            int(fields_after_name[3]),
        )
        out.append((int(entry), uid, state, ppid, session))
    return out


def _alive_of_uid(uid: int) -> list[int]:
    return [pid for pid, p_uid, state, _, _ in _processes() if p_uid == uid and state != "Z"]


def _kill_all_of_uid(uid: int) -> None:
    """In a forked child (never exec'd): become ``uid`` and ``kill(-1, SIGKILL)``, which signals
    every process of that uid in one sweep of the kernel's task list (a fork bomb cannot outrun it)."""
    pid = os.fork()
    if pid == 0:  # the child calls only async-signal-safe system calls, then _exit
        code = 0
        try:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            os.kill(-1, signal.SIGKILL)
        except BaseException:
            code = 1
        os._exit(code)
    os.waitpid(pid, 0)


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of ``uid``, from this process: nothing is executed as ``uid``."""
    for _ in range(5):
        if not _alive_of_uid(uid):
            break
        try:
            _kill_all_of_uid(uid)
        except OSError:  # no fork possible: kill them one by one from here (root may signal any)
            for pid in _alive_of_uid(uid):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)
    _reap_orphans(lambda proc: proc[1] == uid)


def _kill_session(session: int) -> None:
    """SIGKILL every process still in session ``session`` (those that did not leave it)."""
    for _ in range(5):
        members = [pid for pid, _, state, _, sid in _processes() if sid == session and state != "Z"]
        if not members:
            break
        for pid in members:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)
    _reap_orphans(lambda proc: proc[4] == session)


def _reap_orphans(selects) -> None:
    """Reap zombie children of this process that ``selects`` picks (orphans adopted as subreaper)."""
    me = os.getpid()
    for proc in _processes():
        pid, _, state, ppid, _ = proc
        if ppid == me and state == "Z" and selects(proc):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)


_subreaper_set = False


def _adopt_orphans_if_pool_worker() -> None:
    """In a pool worker, adopt the sandbox's orphaned processes so that their zombies get reaped here."""
    global _subreaper_set
    if _subreaper_set or multiprocessing.parent_process() is None:
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    _subreaper_set = True


def cleanup_after_worker(pid: int, limits: SandboxLimits | None = None) -> None:
    """Kill what a sandbox started by (now dead) process ``pid`` may have left running (root mode only)."""
    uid = sandbox_uid_for(pid, limits)
    if uid is not None:
        _kill_uid(uid)


def _read_report(path: Path) -> dict[str, bool]:
    """What the boot script said held (empty when it died before saying)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _folder_bytes(folder: Path) -> int:
    """Bytes allocated under ``folder`` (files and folders, not following links)."""
    total = 0
    stack = [str(folder)]
    while stack:
        with contextlib.suppress(OSError), os.scandir(stack.pop()) as entries:
            for entry in entries:
                with contextlib.suppress(OSError):
                    info = entry.stat(follow_symlinks=False)
                    total += info.st_blocks * 512
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
    return total


def _wait(
    process: subprocess.Popen, limits: SandboxLimits, report: Path, workdir: Path
) -> tuple[int, bool, bool]:
    """Wait for the run: ``(returncode, timed_out, over_disk)``.

    Without a private filesystem (the boot script's report says so) the working folder is
    on the real disk: its size is polled and the run killed above ``disk_mb``.
    """
    deadline = time.monotonic() + limits.wall_s
    polled: bool | None = None
    while True:
        left = deadline - time.monotonic()
        try:
            return process.wait(timeout=max(0.0, min(left, 0.1))), False, False
        except subprocess.TimeoutExpired:
            pass
        if polled is None and report.is_file():
            polled = not _read_report(report).get("private_filesystem", False)
        over = bool(polled) and _folder_bytes(workdir) > limits.disk_mb * _MIB
        if over or time.monotonic() >= deadline:
            with contextlib.suppress(OSError):
                os.killpg(process.pid, signal.SIGKILL)
            return process.wait(), not over, over


def _read_capped(path: Path, limit: int) -> str:
    with open(path, "rb") as handle:
        data = handle.read(limit)
    return data.decode("utf-8", errors="replace")


def run_python(
    code: str,
    stdin: str = "",
    limits: SandboxLimits | None = None,
    test_code: str | None = None,
) -> tuple[SandboxResult, bool]:
    """Run ``code`` (then ``test_code`` in the same namespace, if given) in the sandbox.

    Returns ``(result, completed)``: ``completed`` is True when, with ``test_code``, the
    run reached its end (the boot script's secret marker was printed last; the marker is
    removed from ``result.stdout``); without ``test_code`` it is ``result.status == "ok"``.
    """
    limits = limits or SandboxLimits()
    _adopt_orphans_if_pool_worker()
    uid = sandbox_uid_for(os.getpid(), limits)
    private = Path(tempfile.mkdtemp(prefix="verity-sbx-ctl-"))  # root-only (0700): config, code, output
    # The working folder sits inside a root-only (0700) folder, so that "../" from it leads
    # nowhere the sandboxed uid may write (its parent is not world-writable /tmp). Under /tmp:
    # with a private filesystem the boot script recreates it there, on the run's own tmpfs.
    jail = Path(tempfile.mkdtemp(prefix="verity-sbx-", dir="/tmp" if os.path.isdir("/tmp") else None))
    workdir = jail / "work"
    workdir.mkdir()
    marker = "verity-sandbox-done-" + secrets.token_hex(16) if test_code is not None else None
    try:
        (private / "code.py").write_text(code)
        if test_code is not None:
            (private / "tests.py").write_text(test_code)
        (private / "stdin.txt").write_text(stdin)
        if uid is not None:
            os.chown(workdir, uid, uid)
        config = {
            "parent_pid": os.getpid(),
            "workdir": str(workdir),
            "code_path": str(private / "code.py"),
            "test_path": str(private / "tests.py") if test_code is not None else None,
            "marker": marker,
            "uid": uid,
            "gid": uid,
            "private_tmp": limits.private_tmp,
            "disk_bytes": int(limits.disk_mb) * _MIB,
            "report_path": str(private / "isolation.json"),
            "limits": {
                "cpu_s": int(limits.cpu_s),
                "memory_bytes": int(limits.memory_mb) * _MIB,
                "fsize_bytes": int(limits.fsize_mb) * _MIB,
                "nproc": int(limits.nproc),
                "nofile": int(limits.nofile),
            },
        }
        (private / "config.json").write_text(json.dumps(config))
        command = [sys.executable, "-I"] + ([] if limits.site_packages else ["-S"])
        command += [str(_BOOT), str(private / "config.json")]
        started = time.monotonic()
        with (
            open(private / "stdin.txt", "rb") as stdin_file,
            open(private / "stdout.txt", "wb") as stdout_file,
            open(private / "stderr.txt", "wb") as stderr_file,
        ):
            process = subprocess.Popen(
                command,
                stdin=stdin_file,
                stdout=stdout_file,
                stderr=stderr_file,
                cwd=str(workdir),
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                start_new_session=True,
                close_fds=True,
            )
        returncode, timed_out, over_disk = _wait(process, limits, private / "isolation.json", workdir)
        wall = time.monotonic() - started
        _kill_session(process.pid)
        if uid is not None:
            _kill_uid(uid)
        stdout = _read_capped(private / "stdout.txt", limits.max_output_bytes)
        stderr = _read_capped(private / "stderr.txt", limits.max_output_bytes)
        if over_disk:
            stderr += f"\nsandbox: killed after writing more than disk_mb = {limits.disk_mb} MiB\n"
        held = _read_report(private / "isolation.json")
    finally:
        shutil.rmtree(jail, ignore_errors=True)
        shutil.rmtree(private, ignore_errors=True)
    if timed_out:
        status = "timeout"
    elif returncode == 0:
        status = "ok"
    elif returncode < 0:
        status = "signal"
    else:
        status = "error"
    completed = status == "ok"
    if marker is not None:
        tail = stdout.rstrip("\n")
        completed = completed and tail.endswith(marker)
        if tail.endswith(marker):
            stdout = tail[: -len(marker)].rstrip("\n") + "\n"
    isolation = {
        "unprivileged_uid": uid is not None,
        "network_namespace": bool(held.get("network_namespace")),
        "private_filesystem": bool(held.get("private_filesystem")),
        "read_only_elsewhere": bool(held.get("read_only_elsewhere")),
    }
    return SandboxResult(status, returncode, stdout, stderr, wall, isolation), completed


_netns_cache: bool | None = None


def _network_namespace_possible() -> bool:
    """Whether a child of this process can enter a fresh network namespace (probed once)."""
    global _netns_cache
    if _netns_cache is None:
        probe = (
            "import ctypes, sys\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            "ok = libc.unshare(0x40000000) == 0 or libc.unshare(0x10000000 | 0x40000000) == 0\n"
            "sys.exit(0 if ok else 1)\n"
        )
        result = subprocess.run([sys.executable, "-I", "-S", "-c", probe], check=False, timeout=30)
        _netns_cache = result.returncode == 0
    return _netns_cache


def isolation_report(limits: SandboxLimits | None = None) -> dict[str, object]:
    """What isolation a sandbox started from this process gets (for logs and ``verity diagnose``)."""
    limits = limits or SandboxLimits()
    uid = sandbox_uid_for(os.getpid(), limits)
    return {
        "running_as_root": os.geteuid() == 0,
        "unprivileged_uid": uid,
        "network_namespace": _network_namespace_possible(),
        "private_tmp": bool(limits.private_tmp and os.geteuid() == 0),
        "limits": asdict(limits),
    }
