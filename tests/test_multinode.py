"""Two launchers on this machine form one 4-rank run through torch's c10d rendezvous."""

import json
import os
import socket
import sqlite3
import subprocess
import sys

import pytest

from conftest import SRC

pytestmark = pytest.mark.multiprocess


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_form_one_run_and_node0_stores_all_ranks(tmp_path):
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    nodes = []
    for node_rank in (0, 1):
        folder = tmp_path / f"node{node_rank}"
        folder.mkdir()
        nodes.append(subprocess.Popen(
            [sys.executable, "-m", "ddlscope", "run", "--workload", "mlp-digits", "--strategy", "ddp",
             "--steps", "8", "--nnodes", "2", "--node-rank", str(node_rank), "--procs-per-node", "2",
             "--rdzv-endpoint", f"127.0.0.1:{port}", "--json"],
            cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = [node.communicate(timeout=240) for node in nodes]
    for node, (out, err) in zip(nodes, outputs):
        assert node.returncode == 0, err
    summary = json.loads(outputs[0][0])
    assert summary["run"]["world_size"] == 4 and summary["run"]["status"] == "finished"
    with sqlite3.connect(tmp_path / "node0" / "ddlscope.db") as conn:
        per_rank = conn.execute("SELECT rank, COUNT(*) FROM steps GROUP BY rank ORDER BY rank").fetchall()
        memory_ranks = {r for (r,) in conn.execute("SELECT DISTINCT rank FROM memory")}
    assert per_rank == [(0, 8), (1, 8), (2, 8), (3, 8)]
    assert memory_ranks == {0, 1, 2, 3}
    # node 1 owns no store: its rows went to node 0 over torch.distributed
    assert not (tmp_path / "node1" / "ddlscope.db").exists()
    assert "node 1" in outputs[1][0]
