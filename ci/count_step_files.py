"""Count the verity source files that execute during one GRPO training step.

Measures how many files of the runtime (``packages/verity/src/verity``) and of
``packages/toyworld/src`` a reader must open to follow one RL step, mechanically:
a tiny 2-worker GRPO run (``verity train``, embedded default model, 2 steps) runs with
a ``sitecustomize.py`` first on ``PYTHONPATH`` (Ray workers on this machine inherit
it) and a plug-in (``VERITY_PLUGINS``) whose stage planner adds a first and a last
stage. The window is one full loop iteration: from the end of step 1's stages
(phase ``between``: the loop's metrics, logging and step-end hooks, drawing step 2's
prompts) through step 2's stages (phase ``stages``); start-up, config loading, worker
construction and validation fall outside it. During the window every thread of the
driver and of every worker gets a C-level profile hook (``_PyEval_SetProfile`` over
all thread states, via ctypes: CPython 3.11 has no ``setprofile_all_threads``; Ray
runs actor methods on threads it makes in C) that records ``co_filename`` of each
'call' event; the marker file ``<work>/recording`` holding the phase switches it,
and each process writes ``<work>/files-<pid>.txt`` whenever its set grows.

Run: ``nice -n 10 python -m ci.count_step_files [--json out.json] [--work /tmp/cnt]``
(about 30 s on 2 CPUs once the embedded default is cached; its first build takes minutes).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUNTIME = REPO / "packages/verity/src/verity"
TOYWORLD = REPO / "packages/toyworld/src"
OVERRIDES = [
    "data.train_batch_size=8", "rollout.n=4", "data.max_response_length=16", "data.val_max_samples=8",
    "actor.ppo_mini_batch_size=8", "actor.micro_batch_size=8", "trainer.total_steps=2",
    "trainer.n_workers=2", "trainer.cpus_per_worker=0.5", "trainer.progress=false",
    "trainer.val_before_train=false", "trainer.checkpoint.save_final=false",
]  # fmt: skip
#: files a reader would not open to follow the step: registries, errors, plug-in loading, test hooks
#: (planted faults and slowdowns, inert unless a test switches them on)
INFRA_NAMES = ("registry.py", "errors.py", "plugins.py", "optional_packages.py", "faults.py", "slow_stage.py")

SITECUSTOMIZE = r'''
import ctypes, os, threading, time
_DIR = os.environ.get("COUNT_STEP_DIR")
_ROOTS = tuple(os.environ.get("COUNT_STEP_ROOTS", "").split(os.pathsep))
_api = ctypes.pythonapi
_api.PyInterpreterState_Get.restype = ctypes.c_void_p
_api.PyInterpreterState_ThreadHead.restype = ctypes.c_void_p
_api.PyInterpreterState_ThreadHead.argtypes = [ctypes.c_void_p]
_api.PyThreadState_Next.restype = ctypes.c_void_p
_api.PyThreadState_Next.argtypes = [ctypes.c_void_p]
_api._PyEval_SetProfile.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
_phase = [None]
_seen = set()
_written = [0]

@ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.py_object, ctypes.c_int, ctypes.c_void_p)
def _hook(obj, frame, what, arg):
    if what == 0 and _phase[0]:  # PyTrace_CALL (also a generator resuming)
        name = frame.f_code.co_filename
        if name.startswith(_ROOTS):
            _seen.add((_phase[0], name))
    return 0

_HOOK = ctypes.cast(_hook, ctypes.c_void_p)

def _set_all(on):
    ts = _api.PyInterpreterState_ThreadHead(_api.PyInterpreterState_Get())
    while ts:
        _api._PyEval_SetProfile(ts, _HOOK if on else None, None)
        ts = _api.PyThreadState_Next(ts)

def _flush():
    if len(_seen) == _written[0]:
        return
    _written[0] = len(_seen)
    path = os.path.join(_DIR, "files-%d.txt" % os.getpid())
    with open(path + ".tmp", "w") as f:
        f.write("".join("%s\t%s\n" % item for item in sorted(_seen)))
    os.replace(path + ".tmp", path)

def set_phase(phase):
    """Record from now on as ``phase`` in every thread of this process (None: stop)."""
    _phase[0] = phase
    _set_all(bool(phase))
    _flush()

def _poll():
    while True:
        try:
            with open(os.path.join(_DIR, "recording")) as f:
                phase = f.read().strip() or None
        except OSError:
            phase = None
        if phase != _phase[0]:
            set_phase(phase)
        elif phase:
            _set_all(True)  # threads started since
            _flush()
        time.sleep(0.01)

def _start():
    _seen.clear()
    _written[0] = 0
    _phase[0] = None
    threading.Thread(target=_poll, name="count-step-files", daemon=True).start()

if _DIR:
    _start()
    os.register_at_fork(after_in_child=_start)
'''

PLUGIN = r'''
import os, time
from verity.trainer.stage_plan import register_stage_planner
from verity.trainer.stages import Stage

def _mark(phase):
    import sitecustomize
    marker = os.path.join(os.environ["COUNT_STEP_DIR"], "recording")
    with open(os.path.join(os.environ["COUNT_STEP_DIR"], "driver-pid"), "w") as f:
        f.write(str(os.getpid()))
    if phase:
        with open(marker, "w") as f:
            f.write(phase)
    elif os.path.exists(marker):
        os.remove(marker)
    sitecustomize.set_phase(phase)
    time.sleep(0.3)  # the workers' pollers (10 ms) switch too, and flush

def _begin(ctx, batch):
    if ctx.step == 2:
        _mark("stages")
    return batch

def _end(ctx, batch):
    if ctx.step in (1, 2):
        _mark("between" if ctx.step == 1 else None)
    return batch

def _planner(cfg, plan):
    plan.insert_before(plan.names()[0], Stage("count_begin", _begin))
    plan.append(Stage("count_end", _end))

def register():
    register_stage_planner("count_step_files", _planner)
'''


def run_recorded(work: Path, extra: list[str]) -> tuple[int, float]:
    """Run the tiny GRPO job with the hook; return (exit status, wall seconds)."""
    for old in [*work.glob("files-*.txt"), work / "recording", work / "driver-pid"]:
        old.unlink(missing_ok=True)
    shutil.rmtree(work / "run", ignore_errors=True)
    hook = work / "hook"
    hook.mkdir(parents=True, exist_ok=True)
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    (hook / "count_step_plugin.py").write_text(PLUGIN)
    env = dict(os.environ, COUNT_STEP_DIR=str(work), COUNT_STEP_ROOTS=os.pathsep.join([f"{RUNTIME}/", f"{TOYWORLD}/"]))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(hook), env.get("PYTHONPATH")]))
    env["VERITY_PLUGINS"] = ",".join(filter(None, [env.get("VERITY_PLUGINS"), "count_step_plugin:register"]))
    cmd = [sys.executable, "-m", "verity.cli.main", "train", *OVERRIDES, f"trainer.output_dir={work / 'run'}", *extra]
    started = time.perf_counter()
    status = subprocess.run(cmd, env=env, cwd=REPO).returncode
    return status, time.perf_counter() - started


def reexport_only(path: Path) -> bool:
    """True when ``path`` has only a docstring, imports and ``__all__``."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and all(getattr(t, "id", "") == "__all__" for t in targets):
            continue
        return False
    return True


def room(path: str) -> str:
    """The first folder under ``verity/`` (``(top)`` for a file directly in it), or ``toyworld``."""
    p = Path(path)
    if p.is_relative_to(TOYWORLD):
        return "toyworld"
    parts = p.relative_to(RUNTIME).parts
    return parts[0] if len(parts) > 1 else "(top)"


def summarise(work: Path) -> dict:
    """Read every process's file set and count: driver, workers, union; by room; logic vs infra."""
    driver_pid = (work / "driver-pid").read_text().strip() if (work / "driver-pid").exists() else ""
    per_process: dict[str, set[str]] = {}
    phases: dict[str, set[str]] = {}
    for f in sorted(work.glob("files-*.txt")):
        pid = f.stem.split("-", 1)[1]
        for line in f.read_text().splitlines():
            phase, name = line.split("\t", 1)
            if Path(name).exists():  # "<frozen ...>" and the like are not files
                per_process.setdefault(pid, set()).add(name)
                phases.setdefault(phase, set()).add(name)
    driver = per_process.get(driver_pid, set())
    workers = set().union(*(s for pid, s in per_process.items() if pid != driver_pid))
    union = driver | workers
    infra = {n for n in union if Path(n).name.endswith(INFRA_NAMES) or (Path(n).name == "__init__.py" and reexport_only(Path(n)))}
    rel = {n: str(Path(n).relative_to(RUNTIME if Path(n).is_relative_to(RUNTIME) else TOYWORLD)) for n in union}
    rooms: dict[str, list[str]] = {}
    for n in sorted(union, key=lambda n: (room(n), rel[n])):
        where = "D" if n in driver else ""
        where += "W" if n in workers else ""
        rooms.setdefault(room(n), []).append(f"{rel[n]} [{where}]" + (" (infra)" if n in infra else ""))

    def counts(files: set[str]) -> dict[str, int]:
        return {"all": len(files), "without_init": sum(Path(n).name != "__init__.py" for n in files)}

    return {
        "processes_recorded": len(per_process),
        "driver": counts(driver),
        "workers": counts(workers),
        "union": counts(union),
        "logic": counts(union - infra),
        "infra": sorted(rel[n] for n in infra),
        "phase_stages_only": counts(phases.get("stages", set())),
        "between_only": sorted(rel[n] for n in phases.get("between", set()) - phases.get("stages", set())),
        "rooms": rooms,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the result here too")
    parser.add_argument("--work", type=Path, default=Path("/tmp/cnt"), help="scratch folder (its earlier results removed)")
    parser.add_argument("overrides", nargs="*", help="more config overrides for the run")
    args = parser.parse_args(argv)
    status, wall = run_recorded(args.work, args.overrides)
    if status != 0:
        print(f"the run failed (exit {status})", file=sys.stderr)
        return status
    result = {"wall_s": round(wall, 1), **summarise(args.work)}
    print(f"\nwall {result['wall_s']} s, {result['processes_recorded']} processes recorded")
    for key in ("driver", "workers", "union", "logic", "phase_stages_only"):
        print(f"{key:>18}: {result[key]['all']:3d} files, {result[key]['without_init']:3d} without __init__.py")
    print(f"only between step 1's stages and step 2's: {', '.join(result['between_only'])}")
    print(f"infrastructure: {', '.join(result['infra'])}")
    for name, files in result["rooms"].items():
        print(f"\n{name} ({len(files)})")
        print("".join(f"  {f}\n" for f in files), end="")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
