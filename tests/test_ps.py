"""Parameter-server family: equivalences and staleness, through the real launcher."""

import math
import sqlite3

import pytest
import torch

from phase_checks import assert_store_phases

pytestmark = [pytest.mark.multiprocess, pytest.mark.cli_in_this_process]

STEPS = 6


def _train(cli, tmp_path, strategy: str, out: str, *extra: str) -> dict:
    result = cli("run", "--workload", "mlp-digits", "--strategy", strategy, "--world-size", "2",
                 "--steps", str(STEPS), "--batch-size", "32", "--seed", "5", "--set", "workload.lr=0.2",
                 "--set", f"save_model_path=\"{tmp_path / out}\"", "--quiet", *extra, timeout_s=180)
    assert result.returncode == 0, result.stderr
    return torch.load(tmp_path / out)


def _assert_same(a: dict, b: dict, atol: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=0)


def test_ps_sync_matches_ddp_with_momentum_and_two_servers(cli, tmp_path):
    momentum = ("--set", "workload.momentum=0.9")
    ddp = _train(cli, tmp_path, "ddp", "ddp.pt", *momentum)
    _assert_same(_train(cli, tmp_path, "ps-sync", "ps1.pt", *momentum), ddp)
    _assert_same(_train(cli, tmp_path, "ps-sync", "ps2.pt", *momentum, "--set", "strategy.servers=2"), ddp)


def test_ssp_with_bound_zero_is_synchronous(cli, tmp_path):
    sync = _train(cli, tmp_path, "ps-sync", "sync.pt")
    _assert_same(_train(cli, tmp_path, "ssp", "ssp0.pt", "--set", "strategy.staleness=0"), sync)
    assert assert_store_phases(tmp_path / "ddlscope.db") == {"ps-sync", "ssp"}


def test_staleness_is_zero_for_sync_and_positive_for_async_under_a_straggler(cli, tmp_path):
    straggler = ("--set", "cluster.slowdown=[1, 3]")
    for strategy in ("ps-sync", "ps-async"):
        assert cli("run", "--strategy", strategy, "--world-size", "2", "--steps", "20", "--quiet", *straggler,
                   timeout_s=180).returncode == 0
    with sqlite3.connect(tmp_path / "ddlscope.db") as conn:
        rows = conn.execute("SELECT r.strategy, AVG(u.staleness), COUNT(*), MIN(u.queue_s), MIN(u.apply_s)"
                            " FROM updates u JOIN runs r ON r.id = u.run_id GROUP BY r.strategy").fetchall()
        server_memory = conn.execute("SELECT COUNT(*) FROM memory WHERE rank = 2 AND category = 'optimizer'").fetchone()
    stats = {name: (mean, count, q, a) for name, mean, count, q, a in rows}
    assert stats["ps-sync"][0] == 0 and stats["ps-sync"][1] == 2 * 20
    assert stats["ps-async"][0] > 0 and stats["ps-async"][1] == 2 * 20
    assert all(s[2] >= 0 and s[3] > 0 for s in stats.values())
    assert server_memory == (2,)  # the server (rank 2) records its own memory in both runs


def test_block_cyclic_async_pushes_one_block_per_step(cli, tmp_path):
    """Block-partitioned async SGD (PAPERS.md item 2): each step a worker pushes and pulls one server's
    block, so each of two servers takes half of the pushes, each a whole shard, and the model still learns."""
    assert cli("run", "--strategy", "ps-async", "--world-size", "2", "--steps", str(STEPS), "--quiet", "--json",
               "--set", "strategy.servers=2", "--set", "strategy.block_cyclic=true", "--set", "workload.momentum=0.9",
               timeout_s=180).returncode == 0
    with sqlite3.connect(tmp_path / "ddlscope.db") as conn:
        per_server = dict(conn.execute("SELECT rank, COUNT(*) FROM updates GROUP BY rank").fetchall())
        pushed = conn.execute("SELECT DISTINCT rank, bytes FROM updates ORDER BY rank").fetchall()
        sent = conn.execute("SELECT SUM(bytes_sent) FROM steps WHERE rank = 0").fetchone()[0]
        losses = [r[0] for r in conn.execute("SELECT loss FROM steps WHERE rank = 0 ORDER BY step")]
    assert per_server == {2: STEPS, 3: STEPS}  # 2 workers x STEPS pushes, split evenly
    # rank 0 pushes block 0, 1, 0, 1, ...: one shard a step, never both
    assert len(pushed) == 2 and sent == sum(b for _, b in pushed) * STEPS // 2
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]


def test_block_cyclic_blocks_cycle_over_the_servers():
    from ddlscope.specs.strategies.ps import PSAsyncSpec

    spec = PSAsyncSpec(servers=3, block_cyclic=True)
    assert [spec.blocks_pushed(0, step) for step in range(4)] == [[0], [1], [2], [0]]
    assert spec.blocks_pushed(1, 0) == [1]  # workers start on different blocks
    assert spec.pushes_per_round(6) == 2 and spec.pushes_per_round(2) == 1  # never scaled up
    plain = PSAsyncSpec(servers=3)
    assert plain.blocks_pushed(0, 0) == [0, 1, 2] and plain.pushes_per_round(6) == 6


def test_shard_ranges_read_and_write_the_flattened_tensors():
    from ddlscope.strategies.ps import _read_range, _write_range, shard_ranges

    params = [torch.nn.Parameter(torch.arange(6.0).reshape(2, 3)), torch.nn.Parameter(torch.arange(6.0, 10.0))]
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    ranges = shard_ranges(flat.numel(), 3)
    for lo, hi in ranges:  # boundaries inside a tensor, and at one
        torch.testing.assert_close(_read_range(params, lo, hi), flat[lo:hi])
    assert _read_range(params, 4, 4).numel() == 0
    lo, hi = ranges[1]
    _write_range(params, lo, -flat[lo:hi])
    expected = flat.clone()
    expected[lo:hi] *= -1
    torch.testing.assert_close(torch.cat([p.detach().reshape(-1) for p in params]), expected)
