"""Bad input is refused before any process starts: one line on stderr naming what is wrong, exit 2, nothing
stored. `CASES` is the table docs/bad-input.md lists (its test ids are `test_bad_input[ID]`); most run the
typer app in this process (fast), a few a real `ddlscope` process, as a user would."""

from __future__ import annotations

import json
import os
import sqlite3
import stat
import sys
from pathlib import Path

import pytest

from ddlscope.cli import main
from ddlscope.store import Store

MODEL = ["--hidden", "4096", "--heads", "32", "--layers", "32", "--seq", "2048", "--vocab", "50000",
         "--global-batch", "64"]
SLURM = ["ok.toml", "--nodes", "2", "--procs-per-node", "2"]
EVIL_NAMES = ("[/]", "[bold]x", "<script>alert(1)</script>")

# id: (argv, what the one line must name). Files the cases read are made by `workdir` below:
# ok.toml, bad.toml (TOML syntax), garbage.toml (binary bytes), garbage.json, garbage.db (not SQLite),
# dir.db (a folder), sweep-big.toml, and s.db, a store holding runs 1 (two) to 4 (the EVIL_NAMES).
CASES: dict[str, tuple[list[str], str]] = {
    # ---- run: config files
    "run-missing-config": (["run", "nope.toml"], "nope.toml"),
    "run-toml-syntax": (["run", "bad.toml"], "not valid TOML"),
    "run-toml-binary": (["run", "garbage.toml"], "not valid TOML"),
    "run-config-is-folder": (["run", "dir.db"], "dir.db"),
    "run-unknown-top-key": (["run", "unknown-key.toml"], "optimizer"),
    # ---- run: --set syntax
    "set-no-equals": (["run", "--set", "foo"], "--set 'foo'"),
    "set-empty-key": (["run", "--set", "=1"], "--set '=1'"),
    "set-unknown-section": (["run", "--set", "a.b.c.d=1"], "unknown section 'a'"),
    "set-unknown-field": (["run", "--set", "strategy.bucket_size=5"], "strategy.bucket_size"),
    "set-too-deep": (["run", "--set", "workload.lr.x=1"], "workload.lr"),
    "set-section-not-table": (["run", "--set", "cluster=1"], "cluster = 1"),
    "set-line-break-in-key": (["run", "--set", "a\nb=1"], "a\\nb"),
    "set-huge-int": (["run", "--set", "workload.steps=1e99"], "workload.steps"),
    # ---- run: wrong types and values
    "wrong-type": (["run", "--set", "workload.batch_size=\"many\""], "workload.batch_size"),
    "option-not-int": (["run", "--world-size", "four"], "--world-size"),
    "option-missing-value": (["run", "--world-size"], "--world-size"),
    "lr-inf": (["run", "--set", "workload.lr=inf"], "workload.lr = inf"),
    "lr-nan": (["run", "--set", "workload.lr=nan"], "workload.lr = nan"),
    "slowdown-inf": (["run", "--set", "cluster.slowdown=[1, inf]"], "cluster.slowdown"),
    "negative-bucket": (["run", "--set", "strategy.bucket_mb=-1"], "strategy.bucket_mb"),
    "bad-comm-hook": (["run", "--set", "strategy.comm_hook=int8"], "strategy.comm_hook"),
    "localsgd-period-zero": (["run", "--strategy", "localsgd", "--set", "strategy.period=0"], "strategy.period = 0"),
    "localsgd-group-period-not-below": (["run", "--strategy", "localsgd", "--set", "strategy.period=4", "--set",
                                         "strategy.group_period=4"], "group_period = 4"),
    "diloco-outer-momentum-one": (["run", "--strategy", "diloco", "--set", "strategy.outer_momentum=1"],
                                  "strategy.outer_momentum = 1"),
    "hpsgd-staleness-negative": (["run", "--strategy", "hpsgd", "--set", "strategy.staleness=-1"],
                                 "strategy.staleness = -1"),
    "osp-fraction-zero": (["run", "--strategy", "osp", "--set", "strategy.fraction=0"], "strategy.fraction = 0"),
    "gossip-unknown-topology": (["run", "--strategy", "gossip", "--set", "strategy.topology=star"],
                                "strategy.topology = 'star'"),
    "omnivore-groups-zero": (["run", "--strategy", "omnivore", "--set", "strategy.groups=0"], "strategy.groups = 0"),
    "omnivore-groups-over-workers": (["run", "--strategy", "omnivore", "--world-size", "4", "--set",
                                      "strategy.groups=8"], "strategy.groups = 8"),
    "omnivore-groups-not-dividing": (["run", "--strategy", "omnivore", "--world-size", "4", "--set",
                                      "strategy.groups=3"], "strategy.groups = 3"),
    "bad-optimizer": (["run", "--set", "workload.optimizer=adam"], "workload.optimizer"),
    "unknown-strategy": (["run", "--strategy", "horovod"], "strategy.name"),
    # ---- run: model sources (workloads/sources.py), refused before any process starts
    "source-unknown-torchvision-model": (["run", "--workload", "torchvision:resnt50"], "workload.name"),
    "source-unknown-timm-model": (["run", "--workload", "timm:nosuch"], "workload.name"),
    "source-unknown-hf-arch": (["run", "--workload", "hf:nosuch"], "workload.name"),
    "source-no-model-name": (["run", "--workload", "torchvision:"], "torchvision:NAME"),
    "source-hf-knob-the-arch-lacks": (["run", "--workload", "hf:gpt2", "--set", "workload.kv_heads=2"],
                                      "workload.kv_heads"),
    "source-hf-heads-not-dividing": (["run", "--workload", "hf:llama", "--set", "workload.heads=5"], "heads 5"),
    "source-image-too-small": (["run", "--workload", "torchvision:inception_v3"], "workload.image_size"),
    "source-knob-of-another-source": (["run", "--workload", "timm:resnet18", "--set", "workload.hidden=3"],
                                      "workload.hidden"),
    "source-module-not-importable": (["run", "--workload", "module:nosuchpkg.mod:build"], "nosuchpkg.mod"),
    "source-module-no-factory": (["run", "--workload", "module:json:nosuch"], "'nosuch'"),
    "source-module-no-factory-named": (["run", "--workload", "module:json"], "module:PACKAGE.MODULE:FACTORY"),
    "source-module-factory-refuses-args": (["run", "--workload", "module:json:dumps"], "workload.args"),
    "source-dataset-without-folder": (["run", "--workload", "torchvision:resnet18", "--set", "workload.dataset=cifar10"],
                                      "workload.data_dir"),
    "source-dataset-folder-missing": (["run", "--workload", "torchvision:resnet18", "--set", "workload.dataset=mnist", "--set", "workload.data_dir=nope"],
                                      "workload.data_dir = 'nope'"),
    "source-dataset-folder-empty": (["run", "--workload", "torchvision:resnet18", "--set", "workload.dataset=cifar10", "--set", "workload.data_dir=dir.db"],
                                    "no cifar10 in it"),
    "fsdp-wrap-class-unknown": (["run", "--workload", "torchvision:resnet18", "--strategy", "fsdp", "--set", "strategy.wrap_class=Nope"],
                                "strategy.wrap_class"),
    # ---- predict: model sources
    "predict-hf-encoder": (["predict", "--model", "hf:bert", "--hidden", "64", "--heads", "4", "--layers", "2", "--seq", "64", "--vocab", "256", "--global-batch", "8", "--cluster", "h100:1x8"],
                         "an encoder"),
    "predict-hf-gated-flag": (["predict", "--model", "hf:llama", "--gated-mlp", "--hidden", "64", "--heads", "4", "--layers", "2", "--seq", "64", "--vocab", "256", "--global-batch", "8", "--cluster", "h100:1x8"],
                            "--gated-mlp"),
    "predict-hf-unknown-arch": (["predict", "--model", "hf:nosuch", "--hidden", "64", "--heads", "4", "--layers", "2", "--seq", "64", "--vocab", "256", "--global-batch", "8", "--cluster", "h100:1x8"],
                              "hf:nosuch"),
    "predict-unknown-torchvision-model": (["predict", "--model", "torchvision:resnt50", "--global-batch", "8", "--cluster", "h100:1x8"],
                                        "resnt50"),
    "predict-source-image-size": (["predict", "--model", "torchvision:resnet50", "--image-size", "4", "--global-batch", "8", "--cluster", "h100:1x8"],
                                "--image-size = 4"),
    # ---- memory and study paper --models
    # ---- launch: the script is checked before any process starts
    "launch-missing-script": (["launch", "--nproc", "2", "missing.py"], "missing.py: no such file"),
    "launch-script-is-folder": (["launch", "dir.db"], "dir.db: not a file"),
    "launch-not-python": (["launch", "ok.toml"], "ok.toml: not a Python script"),
    "launch-zero-procs": (["launch", "--nproc", "0", "ok.toml"], "--nproc"),
    # ---- run / launch --log: sinks (runtime/sinks.py), checked before any process starts
    "run-log-unknown-sink": (["run", "--log", "tensorboard,comet"], "--log = 'comet'"),
    "run-log-library-missing": (["run", "--log", "wandb"], "pip install wandb"),  # HIDDEN_PACKAGES hides it
    "run-log-dir-missing-parent": (["run", "--log", "tensorboard", "--log-dir", "missing/logs"], "--log-dir missing/logs"),
    "run-log-dir-without-log": (["run", "--log-dir", "logs"], "--log-dir logs"),
    "launch-log-unknown-sink": (["launch", "--log", "comet", "script.py"], "--log = 'comet'"),
    "memory-world-size-zero": (["memory", "torchvision:resnet18", "--world-size", "0"],
                             "--world-size = 0"),
    "memory-world-size-disagrees": (["memory", "torchvision:resnet18", "--cluster", "h100:1x8", "--world-size", "4"],
                                  "--world-size = 4"),
    "memory-local-two-nodes": (["memory", "torchvision:resnet18", "--cluster", "local:2x2"],
                             "--cluster local:2x2"),
    "memory-name-in-set": (["memory", "torchvision:resnet18", "--set", "workload.name=x"],
                         "workload.name=x"),
    "memory-unknown-cluster": (["memory", "torchvision:resnet18", "--cluster", "nope:1x8"],
                             "nope:1x8"),
    "memory-batch-not-dividing": (["memory", "torchvision:resnet18", "-b", "7", "-s", "ddp"],
                                "workload.batch_size = 7"),
    "memory-hf-knob-the-arch-lacks": (["memory", "hf:gpt2", "--set", "workload.kv_heads=2"],
                                    "workload.kv_heads"),
    "memory-unknown-strategy": (["memory", "torchvision:resnet18", "-s", "nope"],
                              "strategy.name"),
    "study-models-unknown": (["study", "paper", "--quick", "--models", "nosuch"],
                           "--models nosuch"),
    "study-models-empty-name": (["study", "paper", "--models", "resnet50,,vgg16"],
                              "--models"),
    "study-models-twice": (["study", "paper", "--models", "resnet50,resnet50"],
                         "given twice"),
    "study-models-other-source": (["study", "paper", "--models", "timm:resnet18"],
                                "timm:resnet18"),
    "study-models-wrong-study": (["study", "dataparallel", "--quick", "--models", "resnet50"],
                               "--models"),
    # ---- pipeline, partitioned and tp on model sources
    "pipeline-source-not-a-chain": (["run", "--workload", "torchvision:vit_b_16", "--strategy", "pipeline", "--world-size", "2"],
                                  "not a chain"),
    "pipeline-source-tied-weights": (["run", "--workload", "hf:gpt2", "--strategy", "pipeline", "--world-size", "2"],
                                   "tied weights"),
    "pipeline-source-encoder": (["run", "--workload", "hf:bert", "--strategy", "pipeline", "--world-size", "2"],
                              "an encoder"),
    "pipeline-source-unknown-decoder": (["run", "--workload", "hf:opt", "--strategy", "pipeline", "--world-size", "2"],
                                      "hf:opt"),
    "pipeline-source-too-many-stages": (["run", "--workload", "hf:llama", "--strategy", "pipeline", "--world-size", "2", "--set", "strategy.schedule=interleaved", "--set", "strategy.chunks=3", "--set", "strategy.micro_batches=4"],
                                      "6 stages"),
    "pipeline-source-partition-out-of-range": (["run", "--workload", "torchvision:resnet18", "--strategy", "pipeline", "--world-size", "2", "--set", "strategy.partition=[40]"],
                                             "strategy.partition = [40]"),
    "pipeline-source-partition-count": (["run", "--workload", "torchvision:resnet18", "--strategy", "pipeline", "--world-size", "2", "--set", "strategy.partition=[3,5]"],
                                      "strategy.partition = [3, 5]"),
    "partitioned-source-not-a-chain": (["run", "--workload", "torchvision:vit_b_16", "--strategy", "partitioned", "--world-size", "2"],
                                     "not a chain"),
    "tp-source-not-a-transformer": (["run", "--workload", "torchvision:resnet18", "--strategy", "tp", "--world-size", "2"],
                                  "strategy tp"),
    "tp-source-kv-heads": (["run", "--workload", "hf:llama", "--strategy", "tp", "--world-size", "2", "--set", "workload.kv_heads=1"],
                         "workload.kv_heads = 1"),
    "unknown-workload": (["run", "--workload", "imagenet"], "workload.name"),
    "unknown-network": (["run", "--set", "cluster.network.profile=nope"], "cluster.network.profile"),
    "negative-trace-steps": (["run", "--set", "trace_steps=-1"], "trace_steps"),
    "steps-zero": (["run", "--steps", "0"], "workload.steps"),
    "seed-overflow": (["run", "--seed", "1180591620717411303424"], "seed"),
    "batch-absurd": (["run", "--batch-size", str(10**12)], "workload.batch_size"),
    "name-line-break": (["run", "--name", "a\nb"], "name"),
    # ---- run: impossible combinations
    "world-size-zero": (["run", "--world-size", "0"], "cluster.world_size"),
    "batch-not-divisible": (["run", "--world-size", "3", "--batch-size", "64"], "workload.batch_size"),
    "single-several-ranks": (["run", "--strategy", "single", "--world-size", "2"], "cluster.world_size"),
    "pipeline-not-a-transformer": (["run", "--strategy", "pipeline"], "workload.name"),
    "pipeline-stages-over-layers": (["run", "--strategy", "pipeline", "--workload", "gpt-synthetic", "--world-size",
                                     "8", "--set", "workload.layers=4"], "cluster.world_size"),
    "pipeline-partition-not-increasing": (["run", "--strategy", "pipeline", "--workload", "gpt-synthetic",
                                           "--set", "workload.layers=4", "--set", "strategy.partition=[3, 2, 4]",
                                           "--set", "strategy.chunks=2",
                                           "--set", "strategy.schedule=interleaved"], "strategy.partition"),
    "pipeline-micro-batches-split": (["run", "--strategy", "pipeline", "--workload", "gpt-synthetic",
                                      "--set", "strategy.micro_batches=5"], "strategy.micro_batches"),
    "ddp-topk-ratio-zero": (["run", "--strategy", "ddp", "--set", "strategy.topk_ratio=0"], "strategy.topk_ratio"),
    "ddp-qsgd-levels-over-127": (["run", "--strategy", "ddp", "--set", "strategy.qsgd_levels=200"],
                                 "strategy.qsgd_levels"),
    "ddp-unknown-bucket-plan": (["run", "--strategy", "ddp", "--set", "strategy.buckets=optimal"], "strategy.buckets"),
    "buckets-unknown-run": (["buckets", "42", "--db", "s.db"], "'42'"),
    "localsgd-unknown-compression": (["run", "--strategy", "localsgd", "--set", "strategy.compression=int8"],
                                     "strategy.compression"),
    "localsgd-compressed-hierarchical": (["run", "--strategy", "localsgd", "--set", "strategy.group_period=2",
                                          "--set", "strategy.compression=bf16"], "group_period"),
    "partition-bad-size": (["partition", "--workload", "gpt-synthetic", "--memory-limit", "lots"], "--memory-limit"),
    "partition-stages-over-blocks": (["partition", "--workload", "gpt-synthetic", "--stages", "3"], "--stages 3"),
    "pipeline-checkpoints": (["run", "--strategy", "pipeline", "--workload", "gpt-synthetic",
                              "--set", "checkpoint_every=2"], "checkpoint_every"),
    "tp-heads-not-divisible": (["run", "--strategy", "tp", "--workload", "gpt-synthetic", "--world-size", "3",
                                "--batch-size", "33"], "cluster.world_size"),
    "interleaved-one-chunk": (["run", "--strategy", "pipeline", "--set", "strategy.schedule=interleaved"],
                              "chunks >= 2"),
    "heads-not-dividing-hidden": (["run", "-w", "gpt-synthetic", "--set", "workload.heads=3"], "heads = 3"),
    "world-not-multiple-of-nodes": (["run", "--world-size", "3", "--nnodes", "2"], "nnodes 2"),
    "node-rank-too-big": (["run", "--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1"], "node_rank 2"),
    "several-nodes-no-endpoint": (["run", "--nnodes", "2"], "rdzv_endpoint"),
    "bad-endpoint": (["run", "--set", "cluster.rdzv_endpoint=foo"], "rdzv_endpoint 'foo'"),
    "slowdown-wrong-length": (["run", "--set", "cluster.slowdown=[1]"], "slowdown"),
    "fault-outside-ranks": (["run", "--set", "cluster.faults=[{rank=5,step=1}]"], "fault"),
    "procs-per-node-zero": (["run", "--procs-per-node", "0"], "--procs-per-node"),
    "procs-disagree": (["run", "--world-size", "4", "--procs-per-node", "3"], "--world-size = 4"),
    "world-size-past-machine": (["run", "--world-size", "10000", "--batch-size", "10000"], "cluster.world_size = 10000"),
    "world-size-absurd": (["run", "--world-size", str(2**40), "--batch-size", "64"], "cluster.world_size"),
    "save-model-missing-folder": (["run", "--set", "save_model_path=\"missing/x.pt\""], "save_model_path"),
    "checkpoint-missing-parent": (["run", "--set", "checkpoint_dir=\"missing/ck\""], "checkpoint_dir"),
    "run-db-missing-folder": (["run", "--db", "missing/x.db"], "--db missing/x.db"),
    # ---- stores (the store's own checks: record the behaviour)
    "run-db-is-folder": (["run", "--db", "dir.db"], "dir.db"),
    "show-db-garbage": (["show", "1", "--db", "garbage.db"], "garbage.db"),
    "show-db-missing": (["show", "1", "--db", "none.db"], "none.db"),
    # another program's SQLite database, a named pipe, a device: refused before anything is written or read
    "runs-db-foreign-sqlite": (["runs", "--db", "foreign.db"], "foreign.db"),
    "run-db-foreign-sqlite": (["run", "--db", "foreign.db"], "foreign.db"),
    "runs-db-fifo": (["runs", "--db", "fifo.db"], "fifo.db"),
    "runs-db-dev-null": (["runs", "--db", "/dev/null"], "/dev/null"),
    # ---- runs / show / export / trace / scaling
    "runs-limit-negative": (["runs", "--limit", "-1", "--db", "s.db"], "--limit"),
    "show-unknown-run": (["show", "42", "--db", "s.db"], "'42'"),
    "show-no-run": (["show", "--db", "s.db"], "RUN"),
    "export-missing-folder": (["export", "1", "-o", "missing_dir/x.csv", "--db", "s.db"], "missing_dir"),
    "export-output-is-folder": (["export", "1", "-o", "dir.db", "--db", "s.db"], "dir.db"),
    "export-bad-format": (["export", "1", "--format", "xml", "--db", "s.db"], "--format = 'xml'"),
    "export-bad-table": (["export", "1", "--table", "nope", "--db", "s.db"], "--table = 'nope'"),
    "trace-no-traces": (["trace", "1", "--db", "s.db"], "no traces"),
    "trace-missing-folder": (["trace", "1", "-o", "missing/t.json", "--db", "s.db"], "missing"),
    "scaling-nothing-chosen": (["scaling", "--db", "s.db"], "--workload"),
    # ---- report
    "report-unknown-run": (["report", "99", "--db", "s.db"], "'99'"),
    "report-missing-folder": (["report", "1", "-o", "missing/r.html", "--db", "s.db"], "missing"),
    "report-output-is-folder": (["report", "1", "-o", "dir.db", "--db", "s.db"], "dir.db"),
    "report-output-device": (["report", "1", "-o", "null-device", "--db", "s.db"], "null-device"),
    "export-output-device": (["export", "1", "-o", "null-device", "--db", "s.db"], "null-device"),
    "report-no-store": (["report", "1"], "no store"),
    # ---- import-trace (traces-* folders: see _make_traces)
    "import-trace-missing-folder": (["import-trace", "nope", "--db", "s.db"], "nope"),
    "import-trace-no-traces": (["import-trace", "dir.db", "--db", "s.db"], "no trace files"),
    "import-trace-not-json": (["import-trace", "traces-garbage", "--db", "s.db"], "not JSON"),
    "import-trace-rank-twice": (["import-trace", "traces-twice", "--db", "s.db"], "rank 0"),
    "import-trace-world-sizes-disagree": (["import-trace", "traces-worlds", "--db", "s.db"], "world sizes"),
    "import-trace-rank-missing": (["import-trace", "traces-gap", "--db", "s.db"], "rank 1"),
    # ---- study / sweep
    "study-unknown": (["study", "nope"], "'nope'"),
    "study-repeats-zero": (["study", "paper", "--quick", "--repeats", "0"], "--repeats"),
    "study-repeats-too-many": (["study", "paper", "--quick", "--repeats", "11"], "--repeats"),
    "study-db-missing-folder": (["study", "paper", "--db", "missing/x.db"], "missing"),
    "study-unknown-workload": (["study", "paper", "--workload", "mlp-digits"], "--workload"),
    "sweep-binary": (["sweep", "garbage.toml"], "not valid TOML"),
    "sweep-missing": (["sweep", "nope.toml"], "nope.toml"),
    "sweep-no-name": (["sweep", "ok.toml"], "name"),
    "sweep-past-machine": (["sweep", "sweep-big.toml"], "cluster.world_size = 10000"),
    # ---- predict / plan: cluster strings
    "cluster-zero-nodes": (["predict", "--cluster", "h100:0x8", *MODEL], "h100:0x8"),
    "cluster-no-x": (["predict", "--cluster", "h100:8", *MODEL], "h100:8"),
    "cluster-unknown": (["predict", "--cluster", "nope:1x8", *MODEL], "'nope'"),
    "cluster-three-parts": (["predict", "--cluster", "h100:1x8x3", *MODEL], "h100:1x8x3"),
    "cluster-too-many-gpus": (["predict", "--cluster", "h100:1x100", *MODEL], "at most 8 GPUs"),
    "cluster-too-many-nodes": (["plan", "--cluster", f"h100:{10**7}x8", *MODEL], "nodes"),
    "cluster-missing": (["predict", *MODEL], "--cluster"),
    # ---- predict / plan: models and parallel layouts
    "predict-missing-hidden": (["predict", "--cluster", "h100:1x8"], "--hidden"),
    "predict-unknown-model": (["predict", "--cluster", "a100-80gb:1x4", "--model", "nope", "--global-batch", "8"],
                              "--model"),
    "predict-workload-image-size": (["predict", "--cluster", "a100-80gb:1x4", "--model", "resnet-cifar",
                                     "--global-batch", "8", "--image-size", "224"], "--image-size"),
    "predict-negative-hidden": (["predict", "--cluster", "h100:1x8", *MODEL, "--hidden", "-5"], "--hidden = -5"),
    "predict-tp-not-dividing-gpus": (["predict", "--cluster", "h100:1x8", *MODEL, "--tp", "3"], "tp x pp"),
    "predict-pp-over-layers": (["predict", "--cluster", "h100:1x8", *MODEL, "--layers", "2", "--pp", "4"], "pp = 4"),
    "predict-heads-not-dividing-tp": (["predict", "--cluster", "h100:1x8", *MODEL, "--heads", "12", "--hidden", "4092",
                                       "--tp", "8"], "tp = 8"),
    "predict-batch-not-divisible": (["predict", "--cluster", "h100:1x8", *MODEL, "--global-batch", "60"],
                                    "global_batch = 60"),
    "predict-bad-zero": (["predict", "--cluster", "h100:1x8", *MODEL, "--zero", "4"], "--zero"),
    "predict-sustained-nan": (["predict", "--cluster", "h100:1x8", *MODEL, "--sustained-fraction", "nan"],
                              "sustained_fraction"),
    "predict-unknown-stack": (["predict", "--cluster", "h100:1x8", *MODEL, "--stack", "nosuch"], "--stack = 'nosuch'"),
    "predict-cp-unfused": (["predict", "--cluster", "h100:1x8", *MODEL, "--cp", "2", "--attention", "unfused"],
                           "cp = 2"),
    "predict-ep-dense": (["predict", "--cluster", "h100:1x8", *MODEL, "--ep", "2"], "ep = 2"),
    "predict-top-k-above-experts": (["predict", "--cluster", "h100:1x8", *MODEL, "--experts", "4", "--top-k", "8"],
                                    "top_k = 8"),
    "predict-capacity-below-one": (["predict", "--cluster", "h100:1x8", *MODEL, "--experts", "4",
                                    "--capacity-factor", "0.5"], "capacity_factor = 0.5"),
    "predict-cp-not-dividing": (["predict", "--cluster", "h100:1x8", *MODEL, "--cp", "3"], "tp x cp x pp"),
    "predict-ep-not-dividing-experts": (["predict", "--cluster", "h100:1x8", *MODEL, "--experts", "6", "--ep", "4"],
                                        "ep = 4"),
    "predict-measured-negative": (["predict", "--cluster", "h100:1x8", *MODEL, "--measured-step-s", "-1"],
                                  "measured step"),
    "predict-toml-binary": (["predict", "garbage.toml", "--cluster", "h100:1x8"], "not valid TOML"),
    "predict-calibration-garbage-json": (["predict", "--cluster", "local:1x2", "--calibration", "garbage.json",
                                          *MODEL], "garbage.json"),
    "predict-calibration-binary": (["predict", "--cluster", "local:1x2", "--calibration", "garbage.toml", *MODEL],
                                   "garbage.toml"),
    "predict-against-unknown": (["predict", "--against", "99", "--db", "s.db"], "'99'"),
    "plan-hidden-not-divisible": (["plan", "--cluster", "h100:1x8", *MODEL, "--hidden", "1000", "--heads", "64"],
                                  "hidden = 1000"),
    "plan-heads-30": (["plan", "--cluster", "h100:1x8", *MODEL, "--heads", "30"], "heads = 30"),
    "plan-kv-heads": (["plan", "--cluster", "h100:1x8", *MODEL, "--kv-heads", "5"], "kv_heads = 5"),
    "plan-huge-batch": (["plan", "--cluster", "h100:1x8", *MODEL, "--global-batch", str(10**22)], "global_batch"),
    "plan-top-zero": (["plan", "--cluster", "h100:1x8", *MODEL, "--top", "0"], "top = 0"),
    "plan-bad-by": (["plan", "--cluster", "h100:1x8", *MODEL, "--by", "speed"], "--by = 'speed'"),
    "plan-bad-dtype": (["plan", "--cluster", "h100:1x8", *MODEL, "--dtype", "fp8"], "--dtype = 'fp8'"),
    "predict-run-unknown": (["predict-run", "99", "--db", "s.db"], "'99'"),
    "predict-run-calibration-garbage": (["predict-run", "1", "--db", "s.db", "--calibration", "garbage.json"],
                                        "garbage.json"),
    # ---- advise
    "advise-no-cluster": (["advise"], "--cluster"),
    "advise-unknown-cluster": (["advise", "--cluster", "nope:1x8"], "'nope'"),
    "advise-batch-below-gpus": (["advise", "--cluster", "h100:1x8", "--batch-size", "7"], "workload.batch_size = 7"),
    "advise-batch-not-multiple": (["advise", "--cluster", "h100:1x8", "--batch-size", "12"], "workload.batch_size = 12"),
    "advise-stragglers-below-1": (["advise", "--cluster", "h100:1x8", "--stragglers", "0.5"], "--stragglers"),
    "advise-lr-inf": (["advise", "--cluster", "h100:1x8", "--set", "workload.lr=inf"], "workload.lr"),
    # ---- calibrate
    "calibrate-world-size-one": (["calibrate", "--world-sizes", "1"], "--world-sizes"),
    "calibrate-not-ints": (["calibrate", "--world-sizes", "a,b"], "--world-sizes"),
    "calibrate-past-machine": (["calibrate", "--world-sizes", "100000"], "--world-sizes"),
    "calibrate-missing-folder": (["calibrate", "-o", "missing/c.toml"], "missing"),
    "calibrate-db-is-folder": (["calibrate", "--db", "dir.db"], "dir.db"),
    "calibrate-model-unknown": (["calibrate", "--model", "nosuch"], "workload.name"),
    "calibrate-model-batch-zero": (["calibrate", "--model", "gpt-synthetic", "--batch", "0"], "--batch"),
    "predict-profile-missing": (["predict", "--profile", "nope.toml"], "--profile"),
    "predict-profile-not-a-profile": (["predict", "--profile", "ok.toml"], "--profile"),
    # issue 38 part 3: predict --profile takes run's checks and refuses the flags it does not use
    "predict-profile-gossip-one-rank": (["predict", "--profile", "profile.toml", "--strategy", "gossip",
                                         "--world-size", "1"], "cluster.world_size"),
    "predict-profile-cpu-on-gpus": (["predict", "--profile", "profile.toml", "--cluster", "a100-80gb:1x2"],
                                    "not on a catalogue GPU"),
    "predict-profile-unused-flags": (["predict", "--profile", "profile.toml", "--stack", "ideal", "--zero", "1"],
                                     "--stack"),
    "predict-steps-without-profile": (["predict", "--steps", "12", "--hidden", "8"], "--steps"),
    "calibrate-model-quick": (["calibrate", "--model", "gpt-synthetic", "--quick"], "--quick"),
    "calibrate-model-db": (["calibrate", "--model", "gpt-synthetic", "--db", "s.db"], "--db"),
    # ---- slurm
    "slurm-zero-nodes": (["slurm", "ok.toml", "--nodes", "0", "--procs-per-node", "2"], "--nodes 0"),
    "slurm-job-name-newline": (["slurm", *SLURM, "--job-name", "a\nb"], "--job-name"),
    "slurm-job-name-shell": (["slurm", *SLURM, "--job-name", "x;rm -rf ~"], "--job-name"),
    "slurm-time-newline": (["slurm", *SLURM, "--time", "1:00\nrm -rf /"], "--time"),
    "slurm-bad-port": (["slurm", *SLURM, "--port", "70000"], "--port 70000"),
    "slurm-missing-folder": (["slurm", *SLURM, "-o", "missing/x.sh"], "missing"),
    "slurm-set-newline": (["slurm", *SLURM, "--set", "name=\"a\nb\""], "--set"),
    "slurm-binary-config": (["slurm", "garbage.toml", "--nodes", "2", "--procs-per-node", "2"], "not valid TOML"),
    "slurm-bad-config": (["slurm", "indivisible.toml", "--nodes", "2", "--procs-per-node", "4"], "divisible"),
    # ---- issue 40: references the store cannot look up, text that is not UTF-8, names past a bound
    "show-run-id-past-int64": (["show", "99999999999999999999", "--db", "s.db"], "RUN = '99999999999999999999'"),
    "export-run-id-past-int64": (["export", "99999999999999999999", "--db", "s.db"], "RUN = '99999999999999999999'"),
    "runs-limit-past-int64": (["runs", "--limit", "99999999999999999999", "--db", "s.db"], "--limit"),
    "show-superscript-digit": (["show", "²", "--db", "s.db"], "RUN = '²'"),
    "show-empty-run": (["show", "", "--db", "s.db"], "RUN = ''"),
    "export-empty-run": (["export", "", "--db", "s.db"], "RUN = ''"),
    "report-empty-run": (["report", "", "--db", "s.db"], "RUN = ''"),
    "resume-empty-run": (["run", "--resume", "", "--db", "s.db"], "--resume = ''"),
    "show-not-utf8": (["show", "\udcff", "--db", "s.db"], "RUN = '\\xff'"),
    "run-name-not-utf8": (["run", "--name", "\udcff"], "--name = '\\xff'"),
    "report-title-not-utf8": (["report", "1", "--title", "\udcff", "--db", "s.db"], "--title = '\\xff'"),
    "name-too-long": (["run", "--name", "x" * 100_000], "name"),
    "launch-name-too-long": (["launch", "script.py", "--name", "x" * 300], "--name"),
    "sweep-name-too-long": (["sweep", "sweep-long-name.toml"], "name: 300 characters"),
    # ---- issue 40: config files that are not regular files
    "run-config-fifo": (["run", "fifo.toml"], "fifo.toml is a FIFO"),
    "run-config-device": (["run", "/dev/zero"], "/dev/zero is a device"),
    "run-config-symlink-loop": (["run", "loop.toml"], "loop.toml is a symbolic link that loops"),
    # ---- issue 40: values past a physical bound (docs/bad-input.md, Limits), accepted before, then failing
    # or hanging inside the ranks
    "network-bandwidth-tiny": (["run", "--set", "cluster.network.profile=custom", "--set", "cluster.network.alpha_us=1",
                                "--set", "cluster.network.bandwidth_gbps=5e-324"], "cluster.network.bandwidth_gbps"),
    "network-alpha-huge": (["run", "--set", "cluster.network.profile=custom", "--set", "cluster.network.alpha_us=1e308",
                            "--set", "cluster.network.bandwidth_gbps=10"], "cluster.network.alpha_us"),
    "lr-huge": (["run", "--set", "workload.lr=1e308"], "workload.lr"),
    "weight-decay-huge": (["run", "--set", "workload.weight_decay=1e308"], "workload.weight_decay"),
    "diloco-outer-lr-huge": (["run", "--strategy", "diloco", "--set", "strategy.outer_lr=1e308"], "strategy.outer_lr"),
    "slowdown-huge": (["run", "--set", "cluster.slowdown=[1e308, 1]"], "slowdown"),
    "start-delay-huge": (["run", "--set", "cluster.start_delay_s=[1e308, 0]"], "start delays"),
    "bucket-huge": (["run", "--set", "strategy.bucket_mb=1e308"], "strategy.bucket_mb"),
    "threads-per-rank-huge": (["run", "--set", f"cluster.threads_per_rank={2**63}"], "cluster.threads_per_rank"),
    "worker-speeds-huge": (["run", "--set", "strategy.batch_split=\"declared\"", "--set",
                            "strategy.worker_speeds=[1e308, 1e308]"], "strategy.worker_speeds"),
    "mlp-hidden-huge": (["run", "--set", f"workload.hidden={2**40}"], "workload.hidden"),
    "graph-degree-huge": (["run", "--workload", "graph-transformer", "--set", f"workload.degree_in={2**62}"],
                          "degree_in"),
    "gossip-dp-noise-tiny": (["run", "--strategy", "gossip", "--set", "strategy.dp_noise_multiplier=1e-300"],
                             "strategy.dp_noise_multiplier"),
    "powersgd-rank-huge": (["run", "--set", "strategy.comm_hook=powersgd", "--set", "strategy.powersgd_rank=1000000000"],
                           "strategy.powersgd_rank"),
    "partitioned-target-scale-huge": (["run", "--strategy", "partitioned", "--set", "strategy.target_scale=1e308"],
                                      "strategy.target_scale"),
    "gossip-dp-clip-huge": (["run", "--strategy", "gossip", "--set", "strategy.dp_noise_multiplier=1",
                             "--set", "strategy.dp_clip_norm=1e308"], "strategy.dp_clip_norm"),
    "hang-timeout-huge": (["run", "--set", "cluster.hang_timeout_s=1e308"], "cluster.hang_timeout_s"),
    "launch-hang-timeout-huge": (["launch", "--hang-timeout", "1e308", "x.py"], "--hang-timeout"),
    # ---- issue 40: combinations, and what this machine must have, known before launch
    "localsgd-group-size-over-world": (["run", "--strategy", "localsgd", "--set", "strategy.period=4", "--set",
                                        "strategy.group_period=2", "--set", "strategy.group_size=4"],
                                       "strategy.group_size = 4"),
    "gossip-one-rank": (["run", "--strategy", "gossip", "--world-size", "1"], "cluster.world_size = 1"),
    "fedavg-parquet": (["run", "--strategy", "fedavg", "--set", "workload.data=parquet"], "workload.data"),
    "fedavg-empty-blocks": (["run", "--strategy", "fedavg", "--workload", "graph-transformer", "--set",
                             "strategy.partition=block-cyclic", "--set", "strategy.blocks=5"], "strategy.blocks = 5"),
    "pipeline-batch-not-dividing-dp": (["run", "--strategy", "pipeline", "--workload", "gpt-synthetic", "--world-size",
                                        "4", "--set", "strategy.dp=2", "--batch-size", "36"], "strategy.dp"),
    "backend-nccl-without-gpu": (["run", "--set", "cluster.backend=nccl"], "cluster.backend = 'nccl'"),
    "device-cuda-without-gpu": (["run", "--set", "cluster.device=cuda"], "cluster.device = 'cuda'"),
    "save-model-to-device": (["run", "--set", "save_model_path=\"/dev/full\""], "save_model_path"),
    "checkpoint-dir-read-only": (["run", "--set", "checkpoint_dir=\"ro/ck\""], "checkpoint_dir"),
    "cache-dir-is-file": (["run"], "DDLSCOPE_CACHE_DIR"),
    # ---- issue 40: sweeps refused before their first cell, omnivore-tune before its first probe
    "sweep-output-missing-folder": (["sweep", "sweep-ok.toml", "-o", "missing/r.html"], "--output missing/r.html"),
    "sweep-too-many-cells": (["sweep", "sweep-huge.toml"], "1,000,000 cells"),
    "sweep-same-cell-twice": (["sweep", "sweep-twice.toml"], "the same experiment"),
    "sweep-shared-checkpoint-dir": (["sweep", "sweep-checkpoints.toml"], "checkpoint_dir"),
    "omnivore-tune-groups-zero": (["omnivore-tune", "--groups", "0"], "--groups = 0"),
    "omnivore-tune-workers-zero": (["omnivore-tune", "--workers", "0"], "--workers = 0"),
    "omnivore-tune-target-nan": (["omnivore-tune", "--target-loss", "nan"], "--target-loss = nan"),
    # ---- issue 40: predict values that priced a step of nan seconds
    "predict-capacity-factor-huge": (["predict", "--cluster", "h100:1x8", *MODEL, "--experts", "4",
                                      "--capacity-factor", "1e300"], "capacity_factor"),
    "predict-expert-imbalance-huge": (["predict", "--cluster", "h100:1x8", *MODEL, "--experts", "4",
                                       "--expert-imbalance", "1e300"], "expert_imbalance"),
    # ---- commands and options
    "unknown-command": (["nope"], "nope"),
    "unknown-option": (["strategies", "--nope"], "--nope"),
}


# Cases that need a package to be missing: it is hidden from imports (sys.modules[name] = None) for the case.
HIDDEN_PACKAGES = {"run-log-library-missing": "wandb"}
# Cases that need an environment variable set.
ENVIRONMENT = {"cache-dir-is-file": {"DDLSCOPE_CACHE_DIR": "ok.toml"}}
# Cases refused because this machine has no GPU: where torch finds one, they are valid runs.
WITHOUT_CUDA = ("backend-nccl-without-gpu", "device-cuda-without-gpu")
# The folder `workdir` makes read-only. Root writes through a folder's mode, so for root the test makes the
# folder read-only to os.access too (what the check asks, and what a read-only mount answers root).
READ_ONLY = "ro"


def _make_store(db: Path) -> None:
    """Runs 1 (`two`), 2 (`[/]`), 3 (`[bold]x`) and 4 (a script tag): three steps of two ranks each."""
    with Store(db) as store:
        for i, name in enumerate(("two", *EVIL_NAMES)):
            run_id = store.create_run(uuid=f"{i}" * 32, name=name, workload="mlp-digits", strategy="ddp",
                                      world_size=2, config={"name": name, "workload": {"name": "mlp-digits"},
                                                            "strategy": {"name": "ddp"}},
                                      code_version="test", seed=0, environment={})
            store.mark_running(run_id)
            store.ingest(run_id, [
                {"kind": "step", "rank": rank, "step": step, "t_s": 0.01 * step, "data_s": 0.001,
                 "forward_s": 0.002, "backward_s": 0.003, "comm_wait_s": 0.0005, "optimizer_s": 0.001,
                 "step_s": 0.0075, "comm_s": 0.001, "compute_cpu_s": 0.005, "samples": 32,
                 "loss": 2.0 - 0.25 * step, "bytes_sent": 1000}
                for rank in range(2) for step in range(3)])
            store.mark_done(run_id, "finished", error="[red]boom[/]" if name == "[/]" else None)


def _make_traces(root: Path) -> None:
    """Trace folders import-trace refuses: a file that is not JSON, two files of rank 0, world sizes that
    disagree, and rank 1 of 3 missing."""
    def trace(rank: int, world: int) -> str:
        return json.dumps({"distributedInfo": {"rank": rank, "world_size": world}, "traceEvents": [
            {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 1, "ts": 0, "dur": 9}]})

    folders = {"traces-garbage": {"rank0.json": trace(0, 2), "rank1.json": "{\"traceEvents\": [oops"},
               "traces-twice": {"a.json": trace(0, 2), "b.json": trace(0, 2)},
               "traces-worlds": {"a.json": trace(0, 2), "b.json": trace(1, 4)},
               "traces-gap": {"a.json": trace(0, 3), "c.json": trace(2, 3)}}
    for folder, files in folders.items():
        (root / folder).mkdir()
        for name, text in files.items():
            (root / folder / name).write_text(text)


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "ok.toml").write_text('[workload]\nname = "mlp-digits"\n')
    (tmp_path / "bad.toml").write_text("[workload\nname = 1\n")
    (tmp_path / "garbage.toml").write_bytes(bytes(range(128, 256)) * 2)
    (tmp_path / "unknown-key.toml").write_text("[optimizer]\nlr = 1\n")
    (tmp_path / "indivisible.toml").write_text('[workload]\nname = "mlp-digits"\nbatch_size = 30\n')
    (tmp_path / "sweep-big.toml").write_text(
        'name = "big"\n[base.workload]\nname = "mlp-digits"\nbatch_size = 10000\n'
        '[grid]\n"cluster.world_size" = [10000]\n')
    (tmp_path / "garbage.json").write_bytes(b"\x00\x01garbage{")
    (tmp_path / "garbage.db").write_bytes(b"not a database, just bytes " * 100)
    (tmp_path / "dir.db").mkdir()
    with sqlite3.connect(tmp_path / "foreign.db") as foreign:  # another program's database, with a `runs` table
        foreign.execute("CREATE TABLE runs (id INTEGER PRIMARY KEY, who TEXT)")
    foreign.close()
    os.mkfifo(tmp_path / "fifo.db")
    # a character device like /dev/null, made here (as root) so that a regression replaces this node, not /dev/null
    os.mknod(tmp_path / "null-device", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    (tmp_path / READ_ONLY).mkdir(mode=0o555)
    os.mkfifo(tmp_path / "fifo.toml")
    (tmp_path / "loop.toml").symlink_to("loop.toml")
    sweep = 'name = "s"\n[base.workload]\nname = "mlp-digits"\nsteps = 2\n'
    (tmp_path / "sweep-ok.toml").write_text(sweep + '[grid]\n"strategy.name" = ["ddp"]\n')
    values = ", ".join(str(v) for v in range(1, 101))
    (tmp_path / "sweep-huge.toml").write_text(
        sweep.replace("steps = 2\n", "") + "[grid]\n" + "".join(f'"workload.{f}" = [{values}]\n'
                                                               for f in ("steps", "eval_every", "eval_batches")))
    (tmp_path / "sweep-long-name.toml").write_text(sweep.replace('"s"', '"' + "x" * 300 + '"') + '[grid]\n"strategy.name" = ["ddp"]\n')
    (tmp_path / "sweep-twice.toml").write_text(sweep + '[grid]\n"strategy.bucket_mb" = [1, 1.0]\n')
    (tmp_path / "sweep-checkpoints.toml").write_text(
        'name = "s"\n[base]\ncheckpoint_dir = "ck"\n[base.workload]\nname = "mlp-digits"\nsteps = 2\n'
        '[grid]\n"strategy.name" = ["ddp", "localsgd"]\n')
    (tmp_path / "script.py").write_text("raise SystemExit('a bad-input case ran the script')\n")
    (tmp_path / "profile.toml").write_text(  # a model profile (calibrate --model) of a CPU, its tables empty
        'kind = "ddlscope model profile"\nbatch = 16\nstep = {}\nstep_by_batch = {}\nfacts = {}\n'
        'meta = { device_type = "cpu" }\ndevice = { name = "cpu: X" }\n'
        'workload = { name = "mlp-digits", batch_size = 16 }\n')
    _make_store(tmp_path / "s.db")
    _make_traces(tmp_path)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _listing(root: Path) -> dict[str, float]:
    # lstat: loop.toml is a link to itself
    return {str(p.relative_to(root)): p.lstat().st_mtime for p in root.rglob("*")
            if not p.name.endswith(("-wal", "-shm"))}


def _runs(db: Path) -> int:
    with sqlite3.connect(db) as conn:
        return conn.execute("SELECT count(*) FROM runs").fetchone()[0]


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input(case: str, workdir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    argv, names = CASES[case]
    if case in HIDDEN_PACKAGES:
        monkeypatch.setitem(sys.modules, HIDDEN_PACKAGES[case], None)
    for key, value in ENVIRONMENT.get(case, {}).items():
        monkeypatch.setenv(key, value)
    if case in WITHOUT_CUDA:
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has a GPU: the run is valid here")
    if os.geteuid() == 0:
        _read_only_for_root(workdir / READ_ONLY, monkeypatch)
    before = _listing(workdir)
    rc = main(argv)
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2, (rc, err)
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and names in lines[0], lines[0]
    assert "Traceback" not in out + err
    assert _listing(workdir) == before, "refused input may write nothing: no store, no file"
    assert _runs(workdir / "s.db") == 4
    documented = _documented_message(case)
    assert documented == lines[0].replace(str(workdir), "$PWD").replace("|", "\\|"), \
        f"docs/bad-input.md shows another message for {case}: {documented}"


def _read_only_for_root(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    access = os.access

    def read_only(path: object, mode: int, **kwargs: object) -> bool:
        inside = Path(str(path)).resolve() == folder.resolve() or folder.resolve() in Path(str(path)).resolve().parents
        return False if inside and mode & os.W_OK else access(path, mode, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "access", read_only)


def _documented_message(case: str) -> str:
    """The message column of the case's row in docs/bad-input.md (| command | input | message | id |)."""
    table = (Path(__file__).resolve().parents[1] / "docs" / "bad-input.md").read_text()
    row = next(line for line in table.splitlines() if line.endswith(f" | `test_bad_input[{case}]` |"))
    return row.split(" | ")[2]


# ---------------------------------------------------------------------------- as a user runs it
@pytest.mark.parametrize("case", ["run-toml-binary", "seed-overflow", "export-missing-folder", "set-line-break-in-key",
                                  "slurm-time-newline", "run-name-not-utf8"])
def test_bad_input_in_a_real_process(case: str, cli, tmp_path: Path) -> None:
    """The same refusals from a `ddlscope` process: what a terminal shows, no traceback, no store."""
    (tmp_path / "garbage.toml").write_bytes(bytes(range(128, 256)) * 2)
    (tmp_path / "ok.toml").write_text('[workload]\nname = "mlp-digits"\n')
    _make_store(tmp_path / "s.db")
    argv, names = CASES[case]
    result = cli(*argv, timeout_s=60)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1 and names in lines[0], result
    assert "Traceback" not in result.stderr + result.stdout
    assert not (tmp_path / "ddlscope.db").exists()


def test_there_are_at_least_fifty_cases_over_every_command():
    commands = {argv[0] for argv, _ in CASES.values()}
    assert len(CASES) >= 50
    assert {"run", "show", "export", "report", "trace", "study", "predict", "plan", "advise", "calibrate",
            "predict-run", "slurm", "sweep", "runs"} <= commands


def test_docs_table_lists_every_case():
    table = (Path(__file__).resolve().parents[1] / "docs" / "bad-input.md").read_text()
    missing = [case for case in CASES if f"`test_bad_input[{case}]`" not in table]
    assert not missing, f"docs/bad-input.md lacks {missing}"


def test_message_names_value_and_what_is_allowed(capsys):
    assert main(["run", "--set", "strategy.comm_hook=int8"]) == 2
    err = capsys.readouterr().err
    assert "'int8'" in err and "fp16" in err and "powersgd" in err
    assert main(["run", "--strategy", "horovod"]) == 2
    err = capsys.readouterr().err
    assert "'horovod'" in err and "ddp" in err and "single" in err
    assert main(["run", "--set", "strategy.bucket_size=5"]) == 2
    assert "bucket_mb" in capsys.readouterr().err  # the allowed fields are listed


# ---------------------------------------------------------------------------- safe by default
def test_run_names_with_markup_or_html_print_as_typed(workdir: Path, capsys):
    """Rich markup in a stored name is the user's text: `runs`, `show` print it as typed, never crash."""
    assert main(["runs", "--db", "s.db"]) == 0
    out = capsys.readouterr().out
    assert all(name in out.replace("\n", "") or name[:10] in out for name in EVIL_NAMES)
    assert "[bold]x" in out and "[/]" in out
    for run_id, name in ((2, "[/]"), (3, "[bold]x"), (4, "<script>")):
        assert main(["show", str(run_id), "--db", "s.db"]) == 0
        out = capsys.readouterr().out
        assert name in out
    assert main(["show", "2", "--db", "s.db"]) == 0
    assert "[red]boom[/]" in capsys.readouterr().out  # the error, as stored


def test_report_escapes_every_user_string(workdir: Path, capsys):
    assert main(["report", "1", "2", "3", "4", "--db", "s.db", "-o", "r.html", "--title", "<b>t</b>"]) == 0
    page = (workdir / "r.html").read_text()
    assert "<script>alert(1)</script>" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "<b>t</b>" not in page


def test_slurm_script_quotes_user_values(cli, tmp_path: Path):
    """A config path and --set values with spaces, quotes and $(...) reach `ddlscope run` as typed."""
    import shlex
    import shutil
    import subprocess

    cfg = tmp_path / "my exp's $(id).toml"
    cfg.write_text('[workload]\nname = "mlp-digits"\n')
    evil = "name=\"x'; $(touch pwned) `id`\""
    result = cli("slurm", cfg.name, "--nodes", "2", "--procs-per-node", "2", "--set", evil, "-o", "job.sh",
                 timeout_s=60)
    assert result.returncode == 0, result.stderr
    script = (tmp_path / "job.sh").read_text()
    if shutil.which("bash"):
        assert subprocess.run(["bash", "-n", str(tmp_path / "job.sh")]).returncode == 0
    # The srun line's inner `bash -c '...'` program: the words it passes, exactly as the user gave them.
    inner = script.split("bash -c '", 1)[1].rsplit("'", 1)[0].replace("'\"'\"'", "'").replace("\\\n", " ")
    words = shlex.split(inner)
    assert str(cfg.resolve()) in words and evil in words
    assert not (tmp_path / "pwned").exists()


def test_sql_values_are_parameters(workdir: Path, capsys):
    """A name that would end an SQL string is stored and found as typed."""
    name = "x'); DROP TABLE runs; --"
    with Store(workdir / "s.db") as store:
        store.create_run(uuid="9" * 32, name=name, workload="mlp-digits", strategy="ddp", world_size=2,
                         config={"name": name}, code_version="test", seed=0, environment={})
        assert store.get_run(name).name == name
    assert _runs(workdir / "s.db") == 5
    assert main(["runs", "--db", "s.db"]) == 0
    assert "DROP TABLE" in capsys.readouterr().out


@pytest.mark.parametrize("message, one_line", [("database is locked", True), ("no such table: steps", False)])
def test_a_read_that_finds_the_store_locked_past_the_busy_timeout_is_one_line(message, one_line, capsys):
    """Reads do not retry (only writes do, Store._retrying): one that a writer through a rollback journal (a
    large ingest) kept waiting past sqlite's busy timeout ends in one line; any other sqlite error is a bug."""
    import typer

    from ddlscope.cli.common import run_app

    app = typer.Typer()

    @app.command()
    def show() -> None:
        raise sqlite3.OperationalError(message)

    if not one_line:
        with pytest.raises(sqlite3.OperationalError):
            run_app(app, [])
        return
    assert run_app(app, []) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "locked by another process" in err and "Traceback" not in err


def test_a_cuda_backend_or_device_is_refused_only_where_torch_finds_no_gpu(monkeypatch: pytest.MonkeyPatch):
    """The check asks torch when the run starts: the same config runs unchanged on a machine with CUDA."""
    import torch

    from ddlscope.cli.common import UserError, check_devices
    from ddlscope.runtime.config import load_experiment

    exp = load_experiment(None, {"cluster.backend": "nccl", "cluster.device": "cuda"})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    check_devices(exp)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match="cluster.backend = 'nccl'"):
        check_devices(exp)


def test_sweep_help_shows_the_sections_of_a_sweep_file(capsys: pytest.CaptureFixture[str]):
    """Rich markup read `[base]` and `[grid]` in the help as tags and dropped them."""
    assert main(["sweep", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "[base]" in out and "[grid]" in out
