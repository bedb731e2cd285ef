"""`--trace`: per-rank torch.profiler traces, and `ddlscope trace` merging them onto one clock."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SRC, run_cli_here
from ddlscope.analysis.trace_merge import RankTrace, TraceMergeError, merge_traces

PHASES = ("ddlscope.data", "ddlscope.forward", "ddlscope.backward", "ddlscope.synchronize", "ddlscope.optimizer")
TINY = ("--workload", "gpt-synthetic", "--set", "workload.hidden=32", "--set", "workload.seq_len=16",
        "--batch-size", "8", "--steps", "5", "--seed", "1")


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    home = tmp_path_factory.mktemp("trace")
    result = run_cli_here("run", "--quiet", *TINY, "--strategy", "ddp", "--world-size", "2", "--trace", "--name", "traced",
                     cwd=home, timeout_s=60)
    assert result.returncode == 0, result.stdout + result.stderr
    return home


@pytest.mark.multiprocess
@pytest.mark.timeout(40)
def test_traced_run_writes_a_trace_per_rank_beside_the_store(traced):
    folders = list((traced / "ddlscope-traces").iterdir())
    assert len(folders) == 1
    assert sorted(p.name for p in folders[0].iterdir()) == [
        "rank-0.json", "rank-0.meta.json", "rank-1.json", "rank-1.meta.json"]
    meta = json.loads((folders[0] / "rank-1.meta.json").read_text())
    assert meta["steps"] == [1, 3] and meta["rank"] == 1


@pytest.mark.multiprocess
@pytest.mark.timeout(40)
def test_trace_command_merges_ranks_on_one_clock(traced):
    result = run_cli_here("trace", "traced", "-o", "run.json", cwd=traced, timeout_s=30)
    assert result.returncode == 0, result.stderr
    assert "wrote run.json" in result.stdout
    events = json.loads((traced / "run.json").read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1}
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    for rank in (0, 1):
        labels = {e["name"] for e in events if e["pid"] == rank and e.get("ph") == "X"}
        assert set(PHASES) <= labels
        forwards = [e for e in events if e["pid"] == rank and e.get("name") == "ddlscope.forward"]
        assert len(forwards) == 3  # steps 1..3, step 0 is not traced
    first_forward = [min(e["ts"] for e in events if e["pid"] == r and e.get("name") == "ddlscope.forward")
                     for r in (0, 1)]
    assert abs(first_forward[0] - first_forward[1]) < 2e6  # microseconds: the same 2 s window
    assert min(first_forward) >= 0


@pytest.mark.multiprocess
@pytest.mark.timeout(40)
def test_trace_of_bad_or_untraced_run_is_one_line_exit_2(traced, tmp_path):
    bad = run_cli_here("trace", "no-such-run", cwd=traced, timeout_s=30)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    plain = run_cli_here("run", "--quiet", *TINY, "--strategy", "single", "--world-size", "1", "--steps", "2",
                    "--name", "plain", cwd=traced, timeout_s=60)
    assert plain.returncode == 0, plain.stderr
    untraced = run_cli_here("trace", "plain", cwd=traced, timeout_s=30)
    assert untraced.returncode == 2 and "no traces" in untraced.stderr
    assert len(untraced.stderr.strip().splitlines()) == 1


def _rank_trace(folder: Path, rank: int, base_us: float, anchor_wall_s: float, pid: int) -> RankTrace:
    events = [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": "python"}},
        {"ph": "X", "name": "ddlscope.trace_anchor", "pid": pid, "tid": pid, "ts": base_us, "dur": 1},
        {"ph": "X", "name": "ddlscope.forward", "pid": pid, "tid": pid, "ts": base_us + 1000, "dur": 500},
        {"ph": "X", "name": "kernel", "pid": 0, "tid": 7, "ts": base_us + 1200, "dur": 5},
    ]
    path = folder / f"rank-{rank}.json"
    path.write_text(json.dumps({"traceEvents": events}))
    (folder / f"rank-{rank}.meta.json").write_text(json.dumps({"anchor_wall_s": anchor_wall_s}))
    return RankTrace(rank, path)


def test_merge_aligns_on_wall_clock_anchors(tmp_path):
    # Different profiler bases; rank 1's profiler started 0.25 s after rank 0's.
    traces = [_rank_trace(tmp_path, 0, 5e9, 1000.0, 4242), _rank_trace(tmp_path, 1, 123.0, 1000.25, 4343)]
    result = merge_traces(traces, tmp_path / "out.json")
    events = json.loads((tmp_path / "out.json").read_text())["traceEvents"]
    forward = {e["pid"]: e["ts"] for e in events if e.get("name") == "ddlscope.forward"}
    assert forward == {0: pytest.approx(1000.0), 1: pytest.approx(251000.0)}
    assert result.offsets_us == {0: 0.0, 1: pytest.approx(250000.0)}
    kernels = [e for e in events if e.get("name") == "kernel"]
    assert {e["pid"] for e in kernels} == {0, 1} and len({e["tid"] for e in kernels}) == 1
    assert all(e["tid"] != 7 for e in kernels)  # device tracks become separate threads of the rank
    assert not any(e.get("args", {}).get("name") == "python" for e in events)


def test_merge_refuses_a_trace_without_anchor(tmp_path):
    (tmp_path / "rank-0.json").write_text(json.dumps({"traceEvents": []}))
    (tmp_path / "rank-0.meta.json").write_text(json.dumps({"anchor_wall_s": 1.0}))
    with pytest.raises(TraceMergeError):
        merge_traces([RankTrace(0, tmp_path / "rank-0.json")], tmp_path / "out.json")


def test_merge_needs_no_torch():
    code = "import sys, ddlscope.analysis.trace_merge; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": str(SRC)}).returncode == 0
