"""The driver's part of a checkpoint (``trainer_state.json``) and random-number-generator states.

The driver owns everything that is not a tensor of a model: the step counter, the
prompt sampler's position, the KL controller's coefficient, the tracking run id, the
per-step metrics and evaluations so far, the config (and its hash) and its own RNG
states. Worker processes save their shards and RNG states themselves
(:mod:`verity.checkpoint.sharded`).

JSON is used on purpose: it is readable, and Python writes floats with ``repr`` so
they read back bit for bit (NaN and infinities included, as Python's JSON extensions).
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from verity.checkpoint.layout import STATE_FILE, write_file_atomic

FORMAT_VERSION = 1


def capture_rng() -> dict[str, Any]:
    """This process's RNG states (Python ``random``, NumPy global, torch CPU and CUDA) as JSON-able data."""
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Set this process's RNG states from :func:`capture_rng` data (missing parts are left alone)."""
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "torch" in state:
        torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        saved = [torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]]
        if len(saved) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(saved)


@dataclass
class TrainerState:
    """Everything the driver needs to continue a run exactly where a checkpoint left it.

    Attributes:
        step: RL steps completed (the next step to run is ``step + 1``).
        total_steps: ``trainer.total_steps`` of the run that saved it.
        dataloader: the prompt loader's ``state_dict()`` (epoch and position).
        kl_coef: the KL controller's current coefficient (None without a controller).
        run_id / tracking_uri: the MLflow run to continue.
        config_hash / config: the run's config (plain dict) and its hash.
        history: per-step metrics of steps ``1..step``; validation: evaluations so far.
        wall_seconds: training wall time spent before this checkpoint.
        rng: the driver's RNG states (:func:`capture_rng`).
        roles: trained role name -> number of worker ranks that saved its shards.
        model_path: the policy's initial weights (the reference policy is reloaded from it).
        working_dir: the driver's working folder, against which the config's relative paths
            (``reward.custom_path``, a ``file.py:function`` in ``reward.overrides``) were read;
            empty in checkpoints saved before verity recorded it.
    """

    step: int
    total_steps: int
    dataloader: dict[str, Any]
    kl_coef: float | None
    run_id: str | None
    tracking_uri: str | None
    config_hash: str
    config: dict[str, Any]
    history: list[dict[str, float]] = field(default_factory=list)
    validation: list[dict[str, float]] = field(default_factory=list)
    wall_seconds: float = 0.0
    rng: dict[str, Any] = field(default_factory=dict)
    roles: dict[str, int] = field(default_factory=dict)
    model_path: str = ""
    working_dir: str = ""
    verity_version: str = ""
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        """The state as JSON text (one object)."""
        return json.dumps(asdict(self), indent=1)

    def write(self, folder: str | Path) -> Path:
        """Write ``folder/trainer_state.json`` atomically; returns its path."""
        path = Path(folder) / STATE_FILE
        write_file_atomic(path, self.to_json())
        return path

    @classmethod
    def read(cls, folder: str | Path) -> TrainerState:
        """Read ``folder/trainer_state.json``; ValueError names the file when it is not a verity state."""
        path = Path(folder) / STATE_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no trainer state here (is {folder} a complete checkpoint?)")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON ({err})") from None
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise ValueError(f"{path}: checkpoint format {version!r}; this verity reads {FORMAT_VERSION}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{path}: unknown fields {unknown}")
        return cls(**data)
