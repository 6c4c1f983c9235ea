"""The code sandbox against hostile programs: each is contained and the run goes on.

Runs real child processes (no Ray). Limits are small so the file stays fast:
wall 3 s, CPU 2 s, 256 MiB address space, 16 processes.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest
from verity.rewards.code import code_sandbox, outputs_match
from verity.rewards.sandbox import SandboxLimits, isolation_report, run_python, sandbox_uid_for

LIMITS = SandboxLimits(wall_s=3.0, cpu_s=2, memory_mb=256, nproc=16)
ROOT = os.geteuid() == 0


def _alive_processes_of(uid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if (
                    os.stat(f"/proc/{entry}").st_uid == uid
                    and "Z" not in Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
                ):
                    pids.append(int(entry))
            except (OSError, IndexError):
                continue
    return pids


def _still_works() -> None:
    result, completed = run_python("print(sum(range(10)))", limits=LIMITS)
    assert completed and result.stdout.strip() == "45"


def test_plain_program_reads_stdin_and_prints():
    result, completed = run_python("print(int(input()) * 2)", stdin="21\n", limits=LIMITS)
    assert completed and result.status == "ok" and result.stdout == "42\n"


def test_infinite_loop_is_killed():
    started = time.monotonic()
    result, completed = run_python("while True:\n    pass\n", limits=LIMITS)
    assert not completed
    assert result.status in ("timeout", "signal")  # wall kill or SIGXCPU at the CPU limit
    assert time.monotonic() - started < LIMITS.wall_s + 5
    _still_works()


def test_sleeping_program_is_killed_at_the_wall_timeout():
    result, completed = run_python("import time\ntime.sleep(600)\n", limits=LIMITS)
    assert result.status == "timeout" and not completed
    _still_works()


def test_fork_bomb_is_contained_and_cleaned_up():
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    result, completed = run_python(bomb, limits=LIMITS)
    assert not completed
    if ROOT:
        uid = sandbox_uid_for(os.getpid(), LIMITS)
        assert uid is not None
        assert _alive_processes_of(uid) == []  # every forked process was killed afterwards
    _still_works()


def test_huge_allocation_fails_inside_the_sandbox():
    result, completed = run_python("x = bytearray(10 * 1024**3)\nprint('allocated')\n", limits=LIMITS)
    assert not completed and "allocated" not in result.stdout
    assert "MemoryError" in result.stderr
    _still_works()


def test_writing_outside_its_folder_is_refused(tmp_path):
    target = tmp_path / "escaped.txt"
    code = (
        "import os\n"
        f"for path in [{str(target)!r}, '/etc/verity-escape.txt', '../escaped.txt']:\n"
        "    try:\n"
        "        open(path, 'w').write('x')\n"
        "        print('WROTE', path)\n"
        "    except OSError as error:\n"
        "        print('REFUSED', path, type(error).__name__)\n"
        "open('inside.txt', 'w').write('ok')\n"
        "print('INSIDE', open('inside.txt').read())\n"
    )
    result, completed = run_python(code, limits=LIMITS)
    assert completed, result.stderr
    if ROOT:
        assert "WROTE" not in result.stdout
        assert not target.exists() and not Path("/etc/verity-escape.txt").exists()
    assert "INSIDE ok" in result.stdout


def test_private_tmp_hides_and_discards_tmp_writes():
    if not ROOT:
        pytest.skip("private /tmp needs root (mount namespace)")
    marker = Path("/tmp") / f"verity-sandbox-probe-{os.getpid()}"
    code = f"open({str(marker)!r}, 'w').write('x')\nprint('ok')\n"
    result, completed = run_python(code, limits=LIMITS)
    assert completed and not marker.exists()


def test_opening_a_socket_reaches_nothing():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    accepted = []

    def accept() -> None:
        server.settimeout(4)
        try:
            conn, _ = server.accept()
            accepted.append(True)
            conn.close()
        except OSError:
            pass

    thread = threading.Thread(target=accept)
    thread.start()
    code = (
        "import socket\n"
        "try:\n"
        f"    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
        "    print('CONNECTED')\n"
        "except Exception as error:\n"
        "    print('BLOCKED', type(error).__name__)\n"
    )
    result, completed = run_python(code, limits=LIMITS)
    thread.join()
    server.close()
    assert completed, result.stderr
    assert "BLOCKED" in result.stdout and not accepted
    _still_works()


def test_exiting_early_does_not_pass_assert_tests():
    result, completed = run_python("import os\nos._exit(0)\n", limits=LIMITS, test_code="assert False\n")
    assert result.status == "ok" and not completed
    result, completed = run_python("import sys\nsys.exit(0)\n", limits=LIMITS, test_code="assert True\n")
    assert not completed


def test_code_reward_scores_pass_fraction_over_hostile_and_honest_programs():
    tests = json.dumps({"inputs": ["1 2\n", "5 7\n", "10 -3\n"], "outputs": ["3", "12", "7"]})
    honest = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    partial = "```python\na, b = map(int, input().split())\nprint(abs(a) + abs(b))\n```"
    hostile = "```python\nwhile True:\n    pass\n```"
    kwargs = {"case_timeout_s": 2.0, "total_timeout_s": 4.0}
    assert code_sandbox("code", honest, tests, **kwargs)["score"] == 1.0
    assert code_sandbox("code", partial, tests, **kwargs)["score"] == pytest.approx(2 / 3)
    assert code_sandbox("code", hostile, tests, **kwargs)["score"] == 0.0  # budget spent, rest fail
    assert code_sandbox("code", "no code block", tests)["score"] == 0.0


def test_code_reward_test_formats():
    add = "```python\ndef add(a, b):\n    return a + b\n```"
    asserts = {"asserts": ["assert add(1, 2) == 3", "assert add(2, 2) == 5"]}
    assert code_sandbox("code", add, asserts)["score"] == 0.5
    calls = {"fn_name": "add", "inputs": [[1, 2], [3, 4]], "outputs": [3, [7]]}
    assert code_sandbox("code", add, calls)["score"] == 1.0
    program = {"test_code": "def check(f):\n    assert f(2, 3) == 5\n", "entry_point": "add"}
    assert code_sandbox("code", add, program)["score"] == 1.0


@pytest.mark.parametrize(
    ("actual", "expected", "same"),
    [("3\n", "3", True), ("1 2  \n\n", "1 2", True), ("0.3333333", "0.33333334", True), ("3", "4", False)],
)
def test_output_comparison(actual, expected, same):
    assert outputs_match(actual, expected) is same


def test_isolation_report_says_what_holds():
    report = isolation_report(LIMITS)
    assert report["running_as_root"] is ROOT
    assert isinstance(report["network_namespace"], bool)
    if ROOT:
        assert report["unprivileged_uid"] == LIMITS.uid_base + os.getpid()


def _world_writable_folders(depth: int = 3) -> list[str]:
    """World-writable folders the sandbox's uid could reach, down to ``depth`` levels below /."""
    found, frontier = [], ["/"]
    for _ in range(depth):
        deeper = []
        for folder in frontier:
            try:
                entries = list(os.scandir(folder))
            except OSError:
                continue
            for entry in entries:
                if entry.path in ("/proc", "/sys") or not entry.is_dir(follow_symlinks=False):
                    continue
                mode = entry.stat(follow_symlinks=False).st_mode
                if mode & 0o001:  # others may enter
                    deeper.append(entry.path)
                    if mode & 0o002:
                        found.append(entry.path)
        frontier = deeper
    return found


def test_no_file_written_anywhere_survives_the_run(tmp_path):
    if not ROOT:
        pytest.skip("a private filesystem needs root (mount namespace)")
    name = f"verity-sandbox-leak-{os.getpid()}"
    planted = (
        Path("/run") / f"verity-open-{os.getpid()}"
    )  # a world-writable folder outside /tmp, like /run/lock
    planted.mkdir(mode=0o777)
    planted.chmod(0o1777)
    try:
        targets = sorted(
            {*_world_writable_folders(), str(planted), "/", "/etc", "/tmp", "/var/tmp", "/dev/shm", ".."}
        )
        code = (
            "import json, os\n"
            f"wrote = []\nfor folder in {targets!r} + [os.getcwd()]:\n"
            "    try:\n"
            f"        open(os.path.join(folder, {name!r}), 'w').write('x')\n"
            "        wrote.append(folder)\n"
            "    except OSError:\n"
            "        pass\n"
            "print(json.dumps({'cwd': os.getcwd(), 'wrote': wrote}))\n"
        )
        result, completed = run_python(code, limits=LIMITS)
        assert completed, result.stderr
        report = json.loads(result.stdout)
        assert result.isolation["private_filesystem"] and result.isolation["read_only_elsewhere"]
        assert report["cwd"] in report["wrote"] and "/tmp" in report["wrote"]  # it could work where it may
        assert str(planted) not in report["wrote"]  # outside its private places: read-only
        left = [f for f in [*targets, report["cwd"]] if os.path.lexists(os.path.join(f, name))]
        assert left == [] and not Path(report["cwd"]).exists()  # and nothing it wrote is left
    finally:
        for leftover in planted.iterdir():
            leftover.unlink()
        planted.rmdir()


def test_a_total_disk_budget_caps_many_files_under_the_file_size_limit():
    limits = SandboxLimits(wall_s=10.0, cpu_s=8, memory_mb=256, fsize_mb=2, disk_mb=8)
    code = (
        "import os\nwritten = 0\n"
        "for i in range(64):\n"  # 64 files of 1 MiB, each far below fsize_mb
        "    try:\n"
        "        with open(f'chunk{i}', 'wb') as handle:\n"
        "            handle.write(b'x' * 1024 * 1024)\n"
        "        written += 1\n"
        "    except OSError as error:\n"
        "        print('STOPPED', type(error).__name__)\n"
        "        break\n"
        "print('WRITTEN', written)\n"
    )
    result, _ = run_python(code, limits=limits)
    if result.isolation.get("private_filesystem"):
        assert "STOPPED OSError" in result.stdout  # ENOSPC from the run's own tmpfs
        assert int(result.stdout.split("WRITTEN")[1]) <= 8
    else:  # on the real disk: the folder is polled and the run killed
        assert result.status == "signal" and "disk_mb = 8 MiB" in result.stderr


VENV_DRIVER = """
import importlib.util, json, os, sys
spec = importlib.util.spec_from_file_location("sandbox", sys.argv[1])
sandbox = importlib.util.module_from_spec(spec)
sys.modules["sandbox"] = sandbox
spec.loader.exec_module(sandbox)
limits = sandbox.SandboxLimits(wall_s=5.0, cpu_s=4, memory_mb=256, nproc=16)
# a program that leaves a detached process behind (new session, double fork): only the uid kill reaches it
code = (
    "import os, time\\n"
    "if os.fork() == 0:\\n"
    "    os.setsid()\\n"
    "    if os.fork() == 0:\\n"
    "        time.sleep(60)\\n"
    "    os._exit(0)\\n"
    "print(sum(range(10)))\\n"
)
result, completed = sandbox.run_python(code, limits=limits)
uid = sandbox.sandbox_uid_for(os.getpid(), limits)
print(json.dumps({"completed": completed, "stdout": result.stdout, "stderr": result.stderr,
                  "left": sandbox._alive_of_uid(uid), "python": sys.executable}))
"""


def test_runs_and_cleans_up_from_a_venv_in_a_folder_the_sandbox_uid_cannot_enter(tmp_path):
    if not ROOT:
        pytest.skip("the unprivileged sandbox uid exists only when running as root")
    import shutil
    import subprocess
    import sys

    import verity.rewards.sandbox as sandbox_module

    home = tmp_path / "home"
    home.mkdir(mode=0o700)  # like /root: other users cannot enter
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(home / "venv")], check=True, timeout=120
    )
    package = home / "venv" / "sandbox_pkg"
    package.mkdir()
    for name in ("sandbox.py", "sandbox_boot.py"):
        shutil.copy(Path(sandbox_module.__file__).with_name(name), package / name)
    done = subprocess.run(
        [str(home / "venv" / "bin" / "python"), "-c", VENV_DRIVER, str(package / "sandbox.py")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["python"].startswith(str(home))
    assert report["completed"] and report["stdout"].strip() == "45", report["stderr"]
    assert report["left"] == []  # the detached sleeper was killed without executing anything as the uid
