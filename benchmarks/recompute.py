"""What activation recompute (`workload.recompute`) costs and saves, one process, on this machine.

For the GPT (none, selective, full) and the vision workloads (none, full) it prints, per option: the
activation bytes autograd keeps (the step's own meter, on a first step), the forward and backward
time (median of --steps more, unmetered, one intra-op thread), and the step's cost against no recompute beside
the formula's: full runs every block's forward once more, so it should cost about forward / (forward +
backward) of the plain step (+33% where backward is twice the forward, REFERENCE.md's 96 against 72);
selective, the attention core's forward once more.

    PYTHONPATH=src .venv/bin/python benchmarks/recompute.py [--steps 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ddlscope.runtime.config import load_experiment
from ddlscope.runtime.instrument import ActivationMeter
from ddlscope.workloads import WORKLOADS

CASES = [
    ("gpt-synthetic", {"workload.layers": 4, "workload.hidden": 256, "workload.heads": 4, "workload.seq_len": 128,
                       "workload.batch_size": 16}, ("none", "selective", "full")),
    ("resnet-cifar", {"workload.batch_size": 64, "workload.samples": 128, "workload.test_samples": 10},
     ("none", "full")),
    ("vgg-cifar", {"workload.batch_size": 64, "workload.samples": 128, "workload.test_samples": 10},
     ("none", "full")),
    ("convnext-cifar", {"workload.batch_size": 64, "workload.samples": 128, "workload.test_samples": 10},
     ("none", "full")),
]


def measure(name: str, overrides: dict, mode: str, steps: int) -> dict[str, float]:
    exp = load_experiment(None, {**overrides, "workload.name": name, "workload.recompute": mode})
    task = WORKLOADS.get(name).build(exp.workload, 0)
    x, y = task.train.get(torch.arange(exp.workload.batch_size))
    meter = ActivationMeter(task.model)
    with meter.measure():  # one step metered; the timed ones not (its hooks run per saved tensor)
        loss = task.loss_fn(task.model(x), y)
    loss.backward()
    forward_s, backward_s = [], []
    for _ in range(steps):
        task.model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        loss = task.loss_fn(task.model(x), y)
        t1 = time.perf_counter()
        loss.backward()
        forward_s.append(t1 - t0)
        backward_s.append(time.perf_counter() - t1)
    return {"kept_mib": meter.bytes / 2**20, "forward_ms": 1e3 * statistics.median(forward_s),
            "backward_ms": 1e3 * statistics.median(backward_s)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{'workload':15s} {'recompute':9s} {'kept MiB':>9s} {'fwd ms':>8s} {'bwd ms':>8s} {'step vs none':>12s} "
          f"{'formula (full)':>14s}")
    for name, overrides, modes in CASES:
        plain = measure(name, overrides, "none", args.steps)
        plain_step = plain["forward_ms"] + plain["backward_ms"]
        for mode in modes:
            m = plain if mode == "none" else measure(name, overrides, mode, args.steps)
            cost = (m["forward_ms"] + m["backward_ms"]) / plain_step - 1
            formula = f"{plain['forward_ms'] / plain_step:+.0%}" if mode == "full" else ""
            print(f"{name:15s} {mode:9s} {m['kept_mib']:9.2f} {m['forward_ms']:8.1f} {m['backward_ms']:8.1f} "
                  f"{cost:+12.0%} {formula:>14s}", flush=True)


if __name__ == "__main__":
    main()
