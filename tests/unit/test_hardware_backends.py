"""verity.hardware: detection order, overrides and device queries, with the machine faked."""

from __future__ import annotations

import pytest
import torch
from verity.hardware import (
    BackendUnavailableError,
    Probes,
    UnknownBackendError,
    available_backends,
    get_backend,
    make_backend,
)


class FakeDeviceRuntime:
    """Stands in for torch.cuda / torch.npu: the subset of the API the backend calls."""

    def __init__(self, names: list[str], total_memory: int = 80 * 2**30) -> None:
        self.names = names
        self.total_memory = total_memory
        self.seeds: list[int] = []
        self.emptied = 0
        self.synced = 0

    def device_count(self) -> int:
        return len(self.names)

    def get_device_name(self, index: int = 0) -> str:
        return self.names[index]

    def memory_allocated(self, index: int = 0) -> int:
        return 1000 + index

    def memory_reserved(self, index: int = 0) -> int:
        return 2000 + index

    def max_memory_allocated(self, index: int = 0) -> int:
        return 3000 + index

    def get_device_properties(self, index: int = 0):
        return type("Props", (), {"total_memory": self.total_memory})()

    def empty_cache(self) -> None:
        self.emptied += 1

    def synchronize(self) -> None:
        self.synced += 1

    def manual_seed_all(self, seed: int) -> None:
        self.seeds.append(seed)


def fake_machine(*, cuda: bool = False, hip: str | None = None, npu: bool = False, names=("X",)) -> Probes:
    runtime = FakeDeviceRuntime(list(names))
    return Probes(
        cuda_available=lambda: cuda,
        hip_version=lambda: hip,
        npu_available=lambda: npu,
        cuda_runtime=lambda: runtime,
        npu_runtime=lambda: runtime,
    )


@pytest.fixture(autouse=True)
def no_device_env(monkeypatch):
    monkeypatch.delenv("VERITY_DEVICE", raising=False)


def test_this_machine_falls_back_to_cpu_with_gloo():
    if torch.cuda.is_available():
        pytest.skip("machine has a GPU")
    hw = get_backend()
    assert (hw.name, hw.device_type, hw.dist_backend, hw.ray_resource) == ("cpu", "cpu", "gloo", "CPU")
    assert hw.visible_devices_env is None
    assert hw.device(3) == torch.device("cpu")
    assert hw.device_count() == 1
    assert hw.peak_flops() is None


def test_rocm_detected_from_hip_build_of_torch_cuda():
    probes = fake_machine(cuda=True, hip="6.2.41133", names=["AMD Instinct MI300X"] * 8)
    hw = get_backend(probes=probes)
    assert hw.name == "rocm"
    assert hw.device_type == "cuda"  # HIP answers behind torch.cuda
    assert hw.dist_backend == "nccl"  # torch maps nccl onto RCCL
    assert hw.collective_library == "RCCL"
    assert hw.ray_resource == "GPU"
    assert hw.visible_devices_env == "HIP_VISIBLE_DEVICES"
    assert "ROCR_VISIBLE_DEVICES" in hw.other_visible_devices_envs
    assert hw.device(5) == torch.device("cuda", 5)
    assert hw.device_count() == 8
    assert hw.peak_flops(torch.bfloat16) == pytest.approx(1307.4e12)
    assert available_backends(probes) == ["rocm", "cpu"]


def test_cuda_detected_when_torch_is_not_a_hip_build():
    hw = get_backend(probes=fake_machine(cuda=True, hip=None, names=["NVIDIA H100 80GB HBM3"]))
    assert (hw.name, hw.device_type, hw.dist_backend, hw.visible_devices_env) == (
        "cuda",
        "cuda",
        "nccl",
        "CUDA_VISIBLE_DEVICES",
    )
    assert hw.peak_flops() == pytest.approx(989.4e12)


def test_npu_wins_detection_over_gpu():
    probes = fake_machine(cuda=True, hip=None, npu=True, names=["Ascend910B3"])
    hw = get_backend(probes=probes)
    assert hw.name == "npu"
    assert (hw.device_type, hw.dist_backend, hw.ray_resource) == ("npu", "hccl", "NPU")
    assert hw.visible_devices_env == "ASCEND_RT_VISIBLE_DEVICES"
    assert hw.peak_flops() == pytest.approx(313e12)
    assert available_backends(probes) == ["npu", "cuda", "cpu"]


def test_environment_variable_overrides_detection(monkeypatch):
    probes = fake_machine(cuda=True, hip="6.2", npu=True)
    monkeypatch.setenv("VERITY_DEVICE", "cpu")
    assert get_backend(probes=probes).name == "cpu"
    monkeypatch.setenv("VERITY_DEVICE", "hip")
    assert get_backend(probes=probes).name == "rocm"
    monkeypatch.setenv("VERITY_DEVICE", "auto")
    assert get_backend(probes=probes).name == "npu"


def test_argument_overrides_environment_variable(monkeypatch):
    monkeypatch.setenv("VERITY_DEVICE", "npu")
    probes = fake_machine(cuda=True, hip="6.2", npu=True)
    assert get_backend("gpu", probes=probes).name == "rocm"
    assert get_backend("ascend", probes=probes).name == "npu"


def test_unknown_name_lists_the_choices(monkeypatch):
    with pytest.raises(UnknownBackendError, match=r"'tpu'.*npu, rocm, cuda, cpu"):
        get_backend("tpu", probes=fake_machine())
    monkeypatch.setenv("VERITY_DEVICE", "xpu")
    with pytest.raises(UnknownBackendError, match="VERITY_DEVICE"):
        get_backend(probes=fake_machine())


def test_unavailable_backend_names_what_is_available():
    rocm_machine = fake_machine(cuda=True, hip="6.2")
    with pytest.raises(BackendUnavailableError, match=r"'cuda'.*available here: rocm, cpu"):
        get_backend("cuda", probes=rocm_machine)
    with pytest.raises(BackendUnavailableError, match=r"'npu'.*available here: cpu"):
        get_backend("npu", probes=fake_machine())
    with pytest.raises(BackendUnavailableError, match="neither"):
        get_backend("gpu", probes=fake_machine())


def test_device_queries_go_through_the_runtime():
    probes = fake_machine(cuda=True, names=["NVIDIA A100-SXM4-80GB", "NVIDIA A100-SXM4-80GB"])
    hw = get_backend("cuda", probes=probes)
    runtime = probes.cuda_runtime()
    assert hw.memory_stats(1) == {"allocated": 1001, "reserved": 2001, "peak": 3001, "total": 80 * 2**30}
    hw.manual_seed(7)
    hw.empty_cache()
    hw.synchronize()
    assert (runtime.seeds, runtime.emptied, runtime.synced) == ([7], 1, 1)
    assert hw.device_name(1) == "NVIDIA A100-SXM4-80GB"
    assert hw.peak_flops(torch.float16) == pytest.approx(312e12)
    assert hw.peak_flops(torch.float32) is None


def test_queries_on_an_absent_device_fail_clearly():
    hw = make_backend("rocm", fake_machine(cuda=False))
    assert not hw.is_available()
    with pytest.raises(RuntimeError, match="'rocm' is not available"):
        hw.device_count()


def test_cpu_memory_stats_are_plausible_bytes():
    stats = make_backend("cpu").memory_stats()
    assert set(stats) == {"allocated", "reserved", "peak", "total"}
    assert 10 * 2**20 < stats["allocated"] <= stats["peak"] < stats["total"]


def test_visible_devices_reads_primary_then_fallback_variable(monkeypatch):
    hw = make_backend("rocm", fake_machine(cuda=True, hip="6.2"))
    monkeypatch.delenv("HIP_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("ROCR_VISIBLE_DEVICES", raising=False)
    assert hw.visible_devices() is None
    monkeypatch.setenv("ROCR_VISIBLE_DEVICES", "2,3")
    assert hw.visible_devices() == ["2", "3"]
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "0")
    assert hw.visible_devices() == ["0"]


def test_bad_local_rank_and_seed_are_rejected():
    hw = make_backend("cpu")
    with pytest.raises(ValueError, match="local_rank"):
        hw.device(-1)
    with pytest.raises(TypeError, match="seed"):
        hw.manual_seed(1.5)  # type: ignore[arg-type]
