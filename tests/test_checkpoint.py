"""Checkpoint files, row files and the watchdog on their own, without launching a run."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import torch

from ddlscope.runtime.checkpoint import (KEEP, CheckpointError, complete_steps, latest_checkpoint, params_sha256,
                                         partial_dir, seal, step_dir, write_atomically)
from ddlscope.runtime.config import load_experiment
from ddlscope.runtime.heartbeat import Heartbeat, Watchdog
from ddlscope.runtime.rows import RowWriter, read_records


@pytest.fixture
def exp():
    return load_experiment(None, {"workload.steps": 50, "checkpoint_every": 5})


KEY = b"k" * 32


def fake_checkpoint(root, step, exp, payload=b"x" * 100):
    folder = partial_dir(root, step)
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(payload)
    write_atomically(folder / "rank-0.pt", {"step": step})
    return seal(root, step, exp, KEY)


def test_only_sealed_checkpoints_count_and_the_newest_wins(tmp_path, exp):
    fake_checkpoint(tmp_path, 5, exp)
    fake_checkpoint(tmp_path, 10, exp)
    partial_dir(tmp_path, 15).mkdir()  # a crash mid-write: ignored
    (partial_dir(tmp_path, 15) / "__0_0.distcp").write_bytes(b"half")
    found = latest_checkpoint(tmp_path, exp)
    assert found is not None and found.step == 10 and found.folder == step_dir(tmp_path, 10)


def test_old_checkpoints_are_pruned_to_keep(tmp_path, exp):
    for step in (5, 10, 15, 20):
        fake_checkpoint(tmp_path, step, exp)
    assert complete_steps(tmp_path) == [20 - 5 * i for i in range(KEEP)][::-1]


def test_a_corrupt_checkpoint_is_refused_in_one_line(tmp_path, exp):
    folder = fake_checkpoint(tmp_path, 5, exp)
    data = bytearray((folder / "__0_0.distcp").read_bytes())
    data[10] ^= 0xFF  # one flipped byte, same size
    (folder / "__0_0.distcp").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="does not match its manifest") as error:
        latest_checkpoint(tmp_path, exp)
    assert "\n" not in str(error.value)


def test_a_truncated_checkpoint_file_is_refused(tmp_path, exp):
    folder = fake_checkpoint(tmp_path, 5, exp)
    (folder / "rank-0.pt").write_bytes((folder / "rank-0.pt").read_bytes()[:20])
    with pytest.raises(CheckpointError, match="rank-0.pt"):
        latest_checkpoint(tmp_path, exp)


def test_a_checkpoint_of_another_experiment_is_refused(tmp_path, exp):
    fake_checkpoint(tmp_path, 5, exp)
    other = load_experiment(None, {"workload.steps": 50, "checkpoint_every": 5, "seed": 1})
    with pytest.raises(CheckpointError, match="another experiment"):
        latest_checkpoint(tmp_path, other)
    # knobs that do not change the training may differ: the name, the restart and watchdog settings
    same = load_experiment(None, {"workload.steps": 50, "checkpoint_every": 10, "name": "again",
                                  "cluster.max_restarts": 3, "cluster.hang_timeout_s": 5})
    assert latest_checkpoint(tmp_path, same).step == 5


def test_a_manifest_that_is_not_json_is_refused(tmp_path, exp):
    folder = fake_checkpoint(tmp_path, 5, exp)
    (folder / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="manifest"):
        latest_checkpoint(tmp_path, exp)


def test_params_hash_depends_on_every_bit_and_name_but_not_on_order():
    state = {"b": torch.ones(3), "a": torch.arange(4.0).reshape(2, 2), "scalar": torch.tensor(2.0)}
    reordered = {k: state[k].clone() for k in reversed(list(state))}
    assert params_sha256(state) == params_sha256(reordered)
    flipped = {k: v.clone() for k, v in state.items()}
    flipped["a"].view(-1)[3] = torch.nextafter(flipped["a"].view(-1)[3], torch.tensor(10.0))
    assert params_sha256(flipped) != params_sha256(state)
    renamed = {("c" if k == "b" else k): v for k, v in state.items()}
    assert params_sha256(renamed) != params_sha256(state)


def test_row_writer_drops_rows_after_a_checkpoint_and_continues_event_numbers(tmp_path):
    path = tmp_path / "rank-0.jsonl"
    writer = RowWriter(path, 0)
    writer.event("started")
    for step in range(6):
        writer.write("step", step=step, loss=float(step))
    writer.write("eval", step=5, metric=1.0)
    writer.write("update", seq=7, worker=0)
    writer.write("memory", bytes={"parameters": 4})
    writer.event("fault", "crash")
    writer.close()

    again = RowWriter(path, 0)  # a restarted attempt
    dropped = again.drop_after(4, update_seq=7)
    again.event("restored")
    again.close()
    rows = list(read_records(path))
    assert [r["step"] for r in rows if r["kind"] == "step"] == [0, 1, 2, 3]
    assert not [r for r in rows if r["kind"] in ("eval", "update", "memory")]
    assert dropped == 5
    assert [(r["seq"], r["event"]) for r in rows if r["kind"] == "event"] == [(0, "started"), (1, "fault"),
                                                                              (2, "restored")]


def test_watchdog_names_the_rank_that_stopped_beating(tmp_path):
    alive, stuck = Heartbeat(tmp_path, 0), Heartbeat(tmp_path, 1)
    for beat in (alive, stuck):
        beat.beat(step=0, phase="forward")
        beat.beat(step=1, phase="forward")
    stuck.comm("all_reduce")
    hangs: list[str] = []
    watchdog = Watchdog(tmp_path, [0, 1], timeout_s=0.5, on_hang=lambda message, pids: hangs.append(message),
                        startup_s=0.0, poll_s=0.05)
    watchdog.start()
    stop = threading.Event()

    def keep_beating() -> None:
        step = 2
        while not stop.is_set():
            alive.beat(step=step, phase="backward")
            step += 1
            time.sleep(0.01)

    beater = threading.Thread(target=keep_beating)
    beater.start()
    try:
        watchdog.join(timeout=10)
    finally:
        stop.set()
        beater.join()
    assert len(hangs) == 1
    assert "rank 1" in hangs[0] and "rank 0" not in hangs[0]
    assert "step 1" in hangs[0] and "all_reduce" in hangs[0]


def test_watchdog_stays_quiet_while_every_rank_beats(tmp_path):
    beats = [Heartbeat(tmp_path, r) for r in (0, 1)]
    hangs: list[str] = []
    watchdog = Watchdog(tmp_path, [0, 1], timeout_s=0.3, on_hang=lambda m, p: hangs.append(m), startup_s=0.0,
                        poll_s=0.05)
    watchdog.start()
    for step in range(60):
        for beat in beats:
            beat.beat(step=step, phase="forward")
        time.sleep(0.02)
    watchdog.stop()
    watchdog.join(timeout=5)
    assert hangs == []
