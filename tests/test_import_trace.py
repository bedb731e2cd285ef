"""`ddlscope import-trace`: torch.profiler traces of a job ddlscope never launched, read per rank and step.

One 2-rank gloo DDP job (module fixture, through the project's launcher on 127.0.0.1) profiles a few steps
and writes real CPU traces; they are checked against an independent reading of the same events on a
nanosecond grid. Holistic Trace Analysis (HTA) reads GPU kernels only (on CPU traces it has no kernels to
read), so a GPU-style trace the test writes (CUDA and NCCL kernel names, memcpy, memset, launches
correlated with their kernels, ProfilerStep#N, distributedInfo) is read by both and compared: temporal
breakdown (idle, compute, non-compute) and comm-comp overlap per rank within 2%.
"""

from __future__ import annotations

import json
import os
import random
import re
import sqlite3
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ddlscope.analysis.kineto import (BACKWARD, HOST_COMM, HOST_COPY, OPTIMIZER, TraceImportError, combine, length,
                                      load_rank_traces, merged)
from ddlscope.cli import main

STEPS_PROFILED = 3


# ---------------------------------------------------------------------------- a real 2-rank job
def profiled_job(out_dir: str) -> int:
    """One rank: DDP over gloo with small buckets (the first all-reduce overlaps the rest of backward),
    torch.profiler on steps 2..4 of 5, the trace written as rank<N>.json."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    layers = [torch.nn.Linear(256, 256) if i % 2 == 0 else torch.nn.ReLU() for i in range(12)]
    model = DistributedDataParallel(torch.nn.Sequential(*layers), bucket_cap_mb=0.3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    schedule = torch.profiler.schedule(wait=1, warmup=1, active=STEPS_PROFILED, repeat=1)
    path = os.path.join(out_dir, f"rank{rank}.json")
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], schedule=schedule,
                                    on_trace_ready=lambda p: p.export_chrome_trace(path)) as prof:
            for _ in range(2 + STEPS_PROFILED):
                x = torch.randn(64, 256)
                loss = model(x).square().mean()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                prof.step()
    finally:
        # gloo's worker threads drop the last steps' work objects, whose thread-local state holds a Python
        # object (the profiler's), taking the GIL; freeing DDP's reducer at return frees the process group,
        # whose destructor waits for those threads with the GIL held. That deadlocked a rank once in CI
        # (gdb: ~ProcessGroupGloo on the main thread, ~AsyncWork waiting for the GIL on pt_gloo_runloop;
        # runtime/worker.py _finish_together is the launcher's side of the same race). A sleep releases the
        # GIL while the threads finish.
        time.sleep(0.2)
        dist.destroy_process_group()
    return rank


@pytest.fixture(scope="module")
def cpu_traces(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ddlscope.runtime.launcher import launch_processes

    out = tmp_path_factory.mktemp("cpu-traces")
    launch_processes(profiled_job, (str(out),), 2, run_id=f"import-trace-{os.getpid()}")
    assert sorted(p.name for p in out.iterdir()) == ["rank0.json", "rank1.json"]
    return out


def _grid_expectations(path: Path) -> dict[int, dict[str, float]]:
    """The host breakdown by another route: every event on a nanosecond grid per step (boolean arrays),
    the definitions of docs/import-trace.md applied point by point. Seconds per step."""
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
    steps = {int(e["name"].split("#")[1]): (e["ts"], e["ts"] + e["dur"]) for e in events
             if re.fullmatch(r"ProfilerStep#\d+", e["name"])}
    out = {}
    for n, (lo, hi) in steps.items():
        origin, size = round(lo * 1000), round(hi * 1000) - round(lo * 1000)

        def mask(items: list[dict[str, Any]]) -> np.ndarray:
            m = np.zeros(size, dtype=bool)
            for e in items:
                a = max(round(e["ts"] * 1000) - origin, 0)
                b = min(round((e["ts"] + e["dur"]) * 1000) - origin, size)
                if b > a:
                    m[a:b] = True
            return m

        compute = np.zeros(size, dtype=bool)
        comm = np.zeros(size, dtype=bool)
        copies = np.zeros(size, dtype=bool)
        backward = np.zeros(size, dtype=bool)
        optimizer = np.zeros(size, dtype=bool)
        for tid in {e["tid"] for e in events}:
            mine = [e for e in events if e["tid"] == tid and not e["name"].startswith("ProfilerStep#")]
            ops = [e for e in mine if e.get("cat") == "cpu_op"]
            c = mask([e for e in mine if e.get("cat") in ("cpu_op", "user_annotation") and HOST_COMM.match(e["name"])])
            k = mask([e for e in ops if e["name"] in HOST_COPY]) & ~c
            busy = mask(ops) & ~c & ~k
            compute |= busy
            comm |= c
            copies |= k
            optimizer |= busy & mask([e for e in mine if e["cat"] == "user_annotation"
                                      and e["name"].startswith(OPTIMIZER)])
            backward |= busy & mask([e for e in ops if e["name"].startswith(BACKWARD)])
        ns = 1e-9
        out[n] = {"step_s": size * ns, "compute_s": compute.sum() * ns, "comm_s": comm.sum() * ns,
                  "overlap_s": (comm & compute).sum() * ns, "exposed_comm_s": (comm & ~compute).sum() * ns,
                  "exposed_memory_s": (copies & ~comm & ~compute).sum() * ns,
                  "idle_s": (~(compute | comm | copies)).sum() * ns,
                  "backward_s": (backward & ~optimizer).sum() * ns, "optimizer_s": optimizer.sum() * ns}
    return out


def test_cpu_traces_match_an_independent_reading(cpu_traces: Path):
    traces = load_rank_traces(cpu_traces)
    assert [(t.rank, t.world_size, t.rank_from, t.device, t.backend) for t in traces] == \
        [(0, 2, "distributedInfo", "cpu", "gloo"), (1, 2, "distributedInfo", "cpu", "gloo")]
    for trace in traces:
        expected = _grid_expectations(trace.path)
        assert [s.step for s in trace.steps] == sorted(expected) and len(trace.steps) == STEPS_PROFILED
        for step in trace.steps:
            want = expected[step.step]
            for key, value in want.items():
                # the grid rounds each boundary to a nanosecond: a few hundred events, < 1 us per step
                assert getattr(step, key) == pytest.approx(value, abs=1e-6), (trace.rank, step.step, key)
            assert step.compute_s + step.exposed_comm_s + step.exposed_memory_s + step.idle_s == \
                pytest.approx(step.step_s, abs=1e-9)
            assert step.forward_s + step.backward_s + step.optimizer_s + step.data_compute_s == \
                pytest.approx(step.compute_s, abs=1e-9)
            assert step.comm_s > 0 and step.backward_s > 0 and step.optimizer_s > 0 and step.forward_s > 0


def test_import_trace_stores_a_run_that_show_and_report_read(cpu_traces: Path, tmp_path: Path, capsys):
    db = tmp_path / "s.db"
    assert main(["import-trace", str(cpu_traces), "--db", str(db), "--name", "theirs", "--samples", "64"]) == 0
    capsys.readouterr()
    with sqlite3.connect(db) as conn:
        conn.row_factory = sqlite3.Row
        run = conn.execute("SELECT * FROM runs").fetchone()
        rows = conn.execute("SELECT * FROM steps ORDER BY rank, step").fetchall()
    assert (run["name"], run["strategy"], run["world_size"], run["status"]) == ("theirs", "imported", 2, "finished")
    assert len(rows) == 2 * STEPS_PROFILED
    traces = {t.rank: {s.step: s for s in t.steps} for t in load_rank_traces(cpu_traces)}
    for row in rows:
        step = traces[row["rank"]][row["step"]]
        parts = row["data_s"] + row["forward_s"] + row["backward_s"] + row["comm_wait_s"] + row["optimizer_s"]
        assert parts == pytest.approx(row["step_s"], rel=1e-9)
        assert row["comm_wait_s"] == pytest.approx(step.exposed_comm_s)
        assert row["comm_s"] == pytest.approx(step.comm_s)
        assert row["data_s"] == pytest.approx(step.idle_s + step.exposed_memory_s + step.data_compute_s)
        assert row["samples"] == 64
    assert main(["show", "1", "--db", str(db), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["ranks_recorded"] == 2 and summary["throughput_samples_per_s"] > 0
    names = {(m["name"], m.get("rank")) for m in summary["strategy_metrics"]}
    assert ("trace comm-compute overlap", None) in names and ("trace idle share, rank 1", 1) in names
    assert main(["show", "1", "--db", str(db)]) == 0
    assert "trace compute share" in capsys.readouterr().out
    assert main(["report", "1", "--db", str(db), "-o", str(tmp_path / "r.html")]) == 0
    assert "theirs" in (tmp_path / "r.html").read_text()


# ---------------------------------------------------------------------------- a hand-made host trace
def _write(path: Path, events: list[dict[str, Any]], **header: Any) -> Path:
    # indent: HTA finds a file's rank with the regex `"rank":\s+(\d+)`, as Kineto writes it
    path.write_text(json.dumps({"schemaVersion": 1, **header, "traceEvents": events}, indent=1))
    return path


def _x(name: str, cat: str, ts: float, dur: float, tid: Any = 1, pid: Any = 100, **args: Any) -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur,
            **({"args": args} if args else {})}


def test_a_hand_made_host_trace(tmp_path: Path):
    """Step 0-100 us. Main thread: forward op 0-20, backward 20-60 holding an all-reduce call 40-55 and
    a copy 56-58, optimizer 70-80; gloo's thread: all-reduce 30-65. Compute: 0-40, 55-56, 58-60, 70-80 =
    53; communication 30-65 = 35, overlap 30-40 + 55-56 + 58-60 = 13; exposed copy 0 (inside the
    all-reduce); idle 65-70 + 80-100 = 25."""
    events = [_x("ProfilerStep#7", "user_annotation", 0, 100),
              _x("aten::addmm", "cpu_op", 0, 20),
              _x("autograd::engine::evaluate_function: AddmmBackward0", "cpu_op", 20, 40),
              _x("c10d::allreduce_", "cpu_op", 40, 15),
              _x("aten::copy_", "cpu_op", 56, 2),
              _x("Optimizer.step#SGD.step", "user_annotation", 70, 10),
              _x("aten::add_", "cpu_op", 70, 10),
              _x("gloo:all_reduce", "user_annotation", 30, 35, tid=2)]
    _write(tmp_path / "only.json", events)
    [trace] = load_rank_traces(tmp_path)
    assert (trace.rank, trace.world_size, trace.rank_from) == (0, 1, "the only file")
    [s] = trace.steps
    us = 1e-6
    assert s.step == 7 and s.step_s == pytest.approx(100 * us)
    assert s.compute_s == pytest.approx(53 * us) and s.comm_s == pytest.approx(35 * us)
    assert s.overlap_s == pytest.approx(13 * us) and s.exposed_comm_s == pytest.approx(22 * us)
    assert s.memory_s == pytest.approx(2 * us) and s.exposed_memory_s == pytest.approx(0.0)
    assert s.idle_s == pytest.approx(25 * us)
    assert (s.forward_s, s.backward_s, s.optimizer_s) == pytest.approx((20 * us, 23 * us, 10 * us))
    assert trace.totals()["overlap_fraction"] == pytest.approx(13 / 35)


def test_interval_sets():
    a = merged([0, 5, 3, 20], [4, 8, 6, 30])
    assert a[0].tolist() == [0, 20] and a[1].tolist() == [8, 30]
    b = merged([7], [25])
    assert length(combine(lambda x, y: x & y, a, b)) == 1 + 5
    assert length(combine(lambda x, y: x & ~y, a, b)) == 7 + 5
    assert length(combine(lambda x, y: ~(x | y), a, b, window=(-2, 40))) == 2 + 10


# ---------------------------------------------------------------------------- GPU traces and HTA
COMPUTE_KERNELS = ("ampere_sgemm_128x64_tn",
                   "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, "
                   "at::detail::Array<char*, 3> >(int, at::native::CUDAFunctor_add<float>, at::detail::Array<char*, 3>)",
                   "void cutlass::Kernel2<cutlass_80_tensorop_s1688gemm_64x64_16x6_tn_align4>(cutlass_80_tensorop_"
                   "s1688gemm_64x64_16x6_tn_align4::Params)")
NCCL_KERNEL = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)"
OPTIMIZER_KERNEL = ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous "
                    "namespace)::TensorListMetadata<2>, at::native::(anonymous namespace)::BinaryOpListAlphaFunctor"
                    "<float, 2, 2, 0>, std::plus<float>, float>(...)")


def gpu_trace(rank: int, world: int = 2, steps: int = 4) -> dict[str, Any]:
    """A Kineto trace of a DDP step on one GPU, as torch.profiler writes it (its fields and categories),
    with made-up times: per step an input copy and memset, forward kernels launched by the main thread,
    backward kernels launched by the autograd thread with NCCL all-reduces on their own stream that
    overlap backward, then the optimizer; gaps between kernels (launch latency, the data loader) idle."""
    rng = random.Random(rank)
    pid, main_tid, autograd_tid, compute_stream, nccl_stream = 4242, 4242, 4250, 7, 20
    events: list[dict[str, Any]] = []
    corr = [1000]
    host_t, device_t = 1_000, 1_050

    def launch(tid: int, at: int, name: str, cat: str, stream: int, start: int, dur: int) -> int:
        corr[0] += 1
        c = corr[0]
        events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel" if cat == "kernel" else
                       "cudaMemcpyAsync", "pid": pid, "tid": tid, "ts": at, "dur": 4,
                       "args": {"External id": c, "cbid": 211, "correlation": c}})
        events.append({"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream, "ts": start, "dur": dur,
                       "args": {"External id": c, "device": 0, "context": 1, "stream": stream, "correlation": c,
                                "registers per thread": 32, "grid": [1, 1, 1], "block": [128, 1, 1]}})
        events.append({"ph": "s", "id": c, "pid": pid, "tid": tid, "ts": at, "cat": "ac2g", "name": "ac2g"})
        events.append({"ph": "f", "id": c, "pid": 0, "tid": stream, "ts": start, "cat": "ac2g", "name": "ac2g",
                       "bp": "e"})
        return start + dur

    for n in range(steps):
        step_start = host_t
        h = host_t + 5
        d = max(device_t, h + 10)
        d = launch(main_tid, h, "Memcpy HtoD (Pageable -> Device)", "gpu_memcpy", compute_stream, d, 30 + rng.randint(0, 20))
        h += 8
        d = launch(main_tid, h, "Memset (Device)", "gpu_memset", compute_stream, d + 2, 3)
        events.append({"ph": "X", "cat": "user_annotation", "name": "DistributedDataParallel.forward", "pid": pid,
                       "tid": main_tid, "ts": h + 2, "dur": 200})
        for i in range(6):
            h += 20
            d = launch(main_tid, h, COMPUTE_KERNELS[i % 3], "kernel", compute_stream, max(d + rng.randint(1, 8), h + 5),
                       rng.randint(40, 120))
        bwd_host = h + 220
        backward_end_host = bwd_host
        for i in range(6):
            op_ts = bwd_host + i * 30
            events.append({"ph": "X", "cat": "cpu_op", "name": "autograd::engine::evaluate_function: AddmmBackward0",
                           "pid": pid, "tid": autograd_tid, "ts": op_ts, "dur": 25})
            d = launch(autograd_tid, op_ts + 5, COMPUTE_KERNELS[i % 3], "kernel", compute_stream,
                       max(d + rng.randint(1, 6), op_ts + 10), rng.randint(60, 150))
            if i in (2, 5):  # a bucket is ready: its all-reduce on the NCCL stream, overlapping what follows
                launch(autograd_tid, op_ts + 12, NCCL_KERNEL, "kernel", nccl_stream, d - rng.randint(0, 30),
                       rng.randint(150, 400))
            backward_end_host = op_ts + 25
        nccl_end = max(e["ts"] + e["dur"] for e in events if e["ph"] == "X" and e["tid"] == nccl_stream and e["pid"] == 0)
        h = backward_end_host + 40
        events.append({"ph": "X", "cat": "user_annotation", "name": "Optimizer.step#SGD.step", "pid": pid,
                       "tid": main_tid, "ts": h, "dur": 60})
        for i in range(2):
            h += 20
            d = launch(main_tid, h, OPTIMIZER_KERNEL, "kernel", compute_stream, max(d, nccl_end) + rng.randint(2, 9),
                       rng.randint(20, 50))
        host_t = h + 40 + rng.randint(0, 100)  # the next batch: host work that leaves the device idle
        events.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{n + 3}", "pid": pid,
                       "tid": main_tid, "ts": step_start, "dur": host_t - step_start})
        device_t = d
    events += [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": "python3"}},
               {"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "python3"}},
               {"ph": "M", "name": "thread_name", "pid": 0, "tid": compute_stream, "args": {"name": "stream 7"}},
               {"ph": "M", "name": "thread_name", "pid": 0, "tid": nccl_stream, "args": {"name": "stream 20"}}]
    return {"schemaVersion": 1,
            "deviceProperties": [{"id": 0, "name": "NVIDIA H100 80GB HBM3", "totalGlobalMem": 85029158912,
                                  "computeMajor": 9, "computeMinor": 0, "numSms": 132}],
            "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": world},
            "traceEvents": events, "traceName": f"rank{rank}.pt.trace.json", "displayTimeUnit": "ms",
            "baseTimeNanoseconds": 1700000000000000000}


@pytest.fixture(scope="module")
def gpu_traces(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gpu-traces")
    for rank in range(2):
        (out / f"host_{rank}.pt.trace.json").write_text(json.dumps(gpu_trace(rank), indent=1))
    return out


def test_gpu_trace_is_read_on_the_device(gpu_traces: Path):
    traces = load_rank_traces(gpu_traces)
    assert [(t.rank, t.device, t.backend) for t in traces] == [(0, "cuda", "nccl"), (1, "cuda", "nccl")]
    for trace in traces:
        raw = gpu_trace(trace.rank)["traceEvents"]
        kernels = [e for e in raw if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
        nccl = [e for e in kernels if e["name"].startswith("ncclDevKernel")]
        compute = [e for e in kernels if e["cat"] == "kernel" and e not in nccl]
        assert [s.step for s in trace.steps] == [3, 4, 5, 6]
        end = max(e["ts"] + e["dur"] for e in kernels)
        assert sum(s.step_s for s in trace.steps) == pytest.approx((end - min(e["ts"] for e in kernels)) * 1e-6)
        totals = trace.totals()
        assert totals["comm_s"] == pytest.approx(length(merged([e["ts"] for e in nccl],
                                                               [e["ts"] + e["dur"] for e in nccl])) * 1e-6)
        assert totals["compute_s"] == pytest.approx(length(merged([e["ts"] for e in compute],
                                                                  [e["ts"] + e["dur"] for e in compute])) * 1e-6)
        assert 0 < totals["overlap_fraction"] < 1 and totals["idle_s"] > 0 and totals["memory_s"] > 0
        for s in trace.steps:  # launched by the autograd thread inside evaluate_function: backward
            assert s.backward_s > 0 and s.forward_s > 0 and s.optimizer_s > 0


def test_gpu_traces_agree_with_holistic_trace_analysis(gpu_traces: Path):
    hta = pytest.importorskip("hta.trace_analysis", reason="the test extra installs holistictraceanalysis")
    analysis = hta.TraceAnalysis(trace_dir=str(gpu_traces), include_last_profiler_step=True)
    breakdown = analysis.get_temporal_breakdown(visualize=False).set_index("rank")
    overlap = analysis.get_comm_comp_overlap(visualize=False).set_index("rank")
    for trace in load_rank_traces(gpu_traces):
        mine, theirs = trace.totals(), breakdown.loc[trace.rank]
        us = 1e6
        assert mine["step_s"] * us == pytest.approx(theirs["kernel_time(us)"], rel=0.02)
        assert mine["idle_s"] * us == pytest.approx(theirs["idle_time(us)"], rel=0.02)
        assert mine["compute_s"] * us == pytest.approx(theirs["compute_time(us)"], rel=0.02)
        assert (mine["exposed_comm_s"] + mine["exposed_memory_s"]) * us == \
            pytest.approx(theirs["non_compute_time(us)"], rel=0.02)
        # HTA rounds its overlap to hundredths of a percent
        assert mine["overlap_fraction"] * 100 == pytest.approx(overlap.loc[trace.rank, "comp_comm_overlap_pctg"], rel=0.02)


# ---------------------------------------------------------------------------- which file is which rank
def _tiny(rank: int | None = None, world: int | None = None) -> dict[str, Any]:
    info = {} if rank is None else {"distributedInfo": {"rank": rank, **({} if world is None else {"world_size": world})}}
    return {**info, "traceEvents": [_x("ProfilerStep#1", "user_annotation", 0, 10), _x("aten::mm", "cpu_op", 1, 5)]}


def test_rank_from_the_file_name_and_the_errors(tmp_path: Path):
    named = tmp_path / "named"
    named.mkdir()
    for r in (1, 0):
        (named / f"trace_rank-{r}.json").write_text(json.dumps(_tiny()))
    assert [(t.rank, t.world_size, t.rank_from) for t in load_rank_traces(named)] == \
        [(0, 2, "the file name"), (1, 2, "the file name")]
    ambiguous = tmp_path / "ambiguous"
    ambiguous.mkdir()
    (ambiguous / "a.json").write_text(json.dumps(_tiny()))
    (ambiguous / "b.json").write_text(json.dumps(_tiny()))
    with pytest.raises(TraceImportError, match="ambiguous"):
        load_rank_traces(ambiguous)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "x.json").write_text(json.dumps(_tiny(0, 2)))
    (mixed / "rank1.json").write_text(json.dumps(_tiny()))  # no distributedInfo: the name says rank 1
    assert [t.rank for t in load_rank_traces(mixed)] == [0, 1]
