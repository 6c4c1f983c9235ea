"""The output-folder check: every node of a run must read and write the same trainer.output_dir."""

from __future__ import annotations

from pathlib import Path

import pytest
from verity.config import ConfigError
from verity.controller.placement import NodeInfo
from verity.launch.shared_storage import MARKER_DIR, check_shared_output_dir, write_marker

NODES = [NodeInfo("aaaa1111bbbb", "10.0.0.2", {"CPU": 2.0}), NodeInfo("cccc2222dddd", "10.0.0.3", {"CPU": 2.0})]


def test_nodes_that_share_the_folder_pass_and_leave_nothing_behind(tmp_path):
    calls = []

    def shared(node_id, folder, name, token, timeout_s):
        calls.append(node_id)
        return write_marker(folder, name, token)

    check_shared_output_dir(tmp_path / "run", NODES, writer=shared)
    assert calls == ["aaaa1111bbbb", "cccc2222dddd"]
    assert not (tmp_path / "run" / MARKER_DIR).exists()


def test_a_node_with_its_own_disk_is_named(tmp_path):
    elsewhere = tmp_path / "node-local-disk"

    def second_node_apart(node_id, folder, name, token, timeout_s):
        # the second node writes the same path on a disk of its own: the driver never sees it
        target = folder if node_id == "aaaa1111bbbb" else str(elsewhere / Path(folder).name)
        return write_marker(target, name, token)

    with pytest.raises(ConfigError) as caught:
        check_shared_output_dir(tmp_path / "run", NODES, writer=second_node_apart)
    message = str(caught.value)
    assert "node 10.0.0.3/cccc2222" in message and "cannot read back" in message
    assert "\n" not in message


def test_a_node_that_cannot_write_is_named(tmp_path):
    def read_only(node_id, folder, name, token, timeout_s):
        raise PermissionError(f"[Errno 13] Permission denied: '{folder}'")

    with pytest.raises(ConfigError, match=r"node 10.0.0.2/aaaa1111 could not write into .*Permission denied"):
        check_shared_output_dir(tmp_path / "run", NODES, writer=read_only)
