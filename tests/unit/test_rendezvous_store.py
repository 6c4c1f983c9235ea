"""The rendezvous port is handed out already listening, so no other process can take it first."""

from __future__ import annotations

import errno
import socket

import pytest
import torch
import torch.distributed as dist
from verity.controller import Worker
from verity.controller import worker as worker_module
from verity.controller.worker import open_rendezvous_store


def test_the_port_handed_out_is_already_taken_by_the_store(monkeypatch) -> None:
    port = open_rendezvous_store("127.0.0.1", timeout_s=30)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other, pytest.raises(OSError) as err:
        other.bind(("127.0.0.1", port))  # what another job's process would try
    assert err.value.errno == errno.EADDRINUSE
    # rank 0's process group is built on that very store
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    try:
        Worker().init_process_group("gloo", timeout_s=30)
        assert worker_module._RENDEZVOUS_STORE is None  # taken, not left open beside the group
        value = torch.ones(1)
        dist.all_reduce(value)
        assert value.item() == 1.0
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
