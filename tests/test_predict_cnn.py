"""CNNs in the predictor: layer counts against published values, the CLI, and the strategies' step."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from ddlscope import cli
from ddlscope.predict import ParallelSpec, parse_cluster
from ddlscope.predict.cnn import CNNSpec, Layer, counts, layers_of
from ddlscope.predict.cnn_predict import predict_cnn

# Published values. Parameters: the papers / torchvision model cards (25.6M, 138.4M, 8.0M; torchvision's
# exact counts 25,557,032, 138,357,544, 7,978,856). Forward cost at 224x224: torchvision lists
# "GFLOPS" 4.09, 15.47, 2.83, which are multiply-accumulates (He et al. 2016 give ResNet-50 "3.8 x 10^9
# FLOPs", also multiply-adds); forward FLOPs are twice that.
PUBLISHED = {  # name: (parameters, forward G multiply-adds at 224, torchvision's exact parameter count)
    "resnet50": (25.6e6, 4.1, 25_557_032),
    "vgg16": (138.4e6, 15.5, 138_357_544),
    "densenet121": (7.98e6, 2.9, 7_978_856),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameters_and_macs_match_published_values(name):
    params, gmacs, exact = PUBLISHED[name]
    c = counts(CNNSpec(name, global_batch=1))
    assert c.params == exact
    assert abs(c.params / params - 1) < 0.02
    assert abs(c.macs_per_sample / 1e9 / gmacs - 1) < 0.05, c.macs_per_sample
    assert c.forward_flops_per_sample == 2 * c.macs_per_sample


def test_resnet50_forward_flops_are_twice_the_quoted_4_1_g_multiply_adds():
    c = counts(CNNSpec("resnet50", global_batch=1))
    assert 4.0e9 < c.macs_per_sample < 4.2e9
    assert 8.0e9 < c.forward_flops_per_sample < 8.4e9


def test_cifar_variants():
    # ResNet-50 with the 3x3 stem and 10 classes: the 23.5M usually quoted for CIFAR-10
    c = counts(CNNSpec("resnet50", global_batch=1, image_size=32, classes=10))
    assert c.params == 23_520_842
    assert 1.2e9 < c.macs_per_sample < 1.4e9  # 32x32 from the first stage on: (224/4 / 32)^-2 of the 224 cost
    # VGG16 for CIFAR: 13 convs + one 512 -> 10 layer
    assert counts(CNNSpec("vgg16", global_batch=1, image_size=32, classes=10)).params == 14_714_688 + 5130


def test_conv_layer_counts_divide_by_groups_and_follow_the_stride():
    depthwise = Layer("conv", "dw", 0, c_in=32, c_out=32, h_in=16, h_out=8, kernel=3, stride=2, groups=32)
    assert depthwise.params == 32 * 9
    assert depthwise.macs == 8 * 8 * 32 * 9
    assert depthwise.gemm == (64, 1, 9, 32)
    # ResNet-50's spatial sizes: 112 after the stem conv, 56 after the max pool, 7 in the last stage
    layers = {layer.name: layer for layer in layers_of(CNNSpec("resnet50", global_batch=1))}
    assert layers["conv1"].h_out == 112 and layers["maxpool"].h_out == 56
    assert layers["layer4.0.conv2"].h_in == 14 and layers["layer4.0.conv2"].h_out == 7
    assert layers["fc"].c_in == 2048


def test_activation_bytes_count_each_saved_tensor_once():
    c32 = counts(CNNSpec("resnet50", global_batch=1))
    c16 = counts(CNNSpec("resnet50", global_batch=1, dtype="bf16"))
    # the max pool's int64 indices do not shrink with the dtype; everything else halves
    indices = 64 * 56 * 56 * 8
    assert c16.activation_bytes_per_sample - indices == pytest.approx((c32.activation_bytes_per_sample - indices) / 2)
    # ResNet-50 keeps ~22M fp32 values per 224x224 image (conv, norm and pool outputs)
    assert 70e6 < c32.activation_bytes_per_sample < 100e6


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_cli_predict_json_has_parameters(name):
    args = ["predict", "--json", "--cluster", "a100-80gb:1x4", "--model", name, "--global-batch", "256",
            "--micro-batch", "64", "--dp", "4"]
    result = CliRunner().invoke(cli.app, args)
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["parameters"] == PUBLISHED[name][2]
    assert out["strategy"] == "ddp" and out["fits"] and out["step_time_s"] > 0
    assert set(out["memory_breakdown_gb"]) == {"parameters", "gradients", "optimizer", "activations", "other"}
    parts = sum(v for k, v in out["breakdown_s"].items() if k != "recompute_included")
    assert parts == pytest.approx(out["step_time_s"], rel=1e-9)


def test_cli_plan_and_refusals():
    runner = CliRunner()
    result = runner.invoke(cli.app, ["plan", "--json", "--cluster", "paper-slow:2x4", "--model", "resnet50",
                                     "--global-batch", "256", "--top", "3"])
    assert result.exit_code == 0, result.output
    top = json.loads(result.stdout)["top"]
    assert len(top) == 3 and top[0]["step_time_s"] <= top[1]["step_time_s"]
    for bad, words in ((["--hidden", "64"], "GPT option"), (["--tp", "2"], "tp = 2"),
                       (["--strategy", "nope"], "allowed for a CNN"), (["--image-size", "100"], "image_size")):
        code = cli.main(["predict", "--cluster", "a100-80gb:1x4", "--model", "resnet50", "--global-batch", "256",
                         *bad])
        assert code == 2, bad


def _resnet(cluster: str, strategy: str = "ddp", **parallel):
    c = parse_cluster(cluster)
    spec = CNNSpec("resnet50", global_batch=64 * c.n_gpus)
    return predict_cnn(spec, ParallelSpec(dp=c.n_gpus, micro_batch=64, **parallel), c, strategy)


def test_ddp_step_lies_between_compute_and_compute_plus_the_whole_all_reduce():
    p = _resnet("a100-80gb:1x4")
    compute, optimizer = p.breakdown_s["compute"], p.breakdown_s["optimizer"]
    assert compute + optimizer < p.step_time_s < compute + optimizer + p.comm_s
    # the bucketed all-reduce goes out during the backward: only the last bucket sticks out
    assert p.breakdown_s["dp_grad_sync"] < 0.5 * p.comm_s


def test_without_backward_overlap_the_whole_all_reduce_shows():
    with_overlap = _resnet("paper-slow:2x4")
    without = _resnet("paper-slow:2x4", overlap_grad_reduce=False)
    assert without.breakdown_s["dp_grad_sync"] >= without.comm_s
    assert with_overlap.breakdown_s["dp_grad_sync"] < 0.5 * without.breakdown_s["dp_grad_sync"]


def test_fsdp_shards_states_and_gathers_units():
    ddp, fsdp = _resnet("paper-fast:1x8"), _resnet("paper-fast:1x8", "fsdp")
    for key in ("parameters", "gradients", "optimizer"):
        assert fsdp.memory_breakdown_gb[key] == pytest.approx(ddp.memory_breakdown_gb[key] / 8)
    assert fsdp.memory_breakdown_gb["activations"] == ddp.memory_breakdown_gb["activations"]
    assert fsdp.comm_s > ddp.comm_s  # two all-gathers + a reduce-scatter of the weights per micro-batch
    assert fsdp.fsdp_units == 18  # stem, 16 bottlenecks, the classifier


def test_parameter_server_is_bound_by_the_servers_nic_and_cpu():
    eight, sixteen = _resnet("paper-fast:1x8", "ps-sync"), _resnet("paper-fast:2x8", "ps-sync")
    # across nodes one NIC carries every worker's push and pull: twice the workers, twice the time
    four_nodes = _resnet("paper-fast:4x8", "ps-sync")
    assert four_nodes.breakdown_s["dp_grad_sync"] / sixteen.breakdown_s["dp_grad_sync"] == pytest.approx(2, rel=0.05)
    assert eight.step_time_s > _resnet("paper-fast:1x8").step_time_s
    assert eight.memory_breakdown_gb["optimizer"] == 0 and eight.server_memory_gb > 0
    # a slower host CPU (memory bandwidth) slows the server's sums and its optimizer step
    c = parse_cluster("paper-fast:2x8")
    slow_host = replace(c, node=replace(c.node, host_memory_bytes_per_s=c.node.host_memory_bytes_per_s / 20))
    spec = CNNSpec("resnet50", global_batch=1024)
    slow = predict_cnn(spec, ParallelSpec(dp=16, micro_batch=64), slow_host, "ps-sync")
    assert slow.breakdown_s["dp_grad_sync"] > 1.5 * sixteen.breakdown_s["dp_grad_sync"]


def test_paper_clusters_in_the_catalogue():
    fast, slow = parse_cluster("paper-fast:2x8"), parse_cluster("paper-slow:2x4")
    assert fast.device.key == "a100-80gb" and fast.node.intra.key == "nvlink3"
    assert fast.node.inter.key == "ib-hdr" and fast.node.nics == 8
    assert slow.device.key == "a10g" and slow.node.intra.key == "pcie4"
    assert slow.node.inter.key == "eth-40g" and slow.node.nics == 1
    # the fast cluster's DDP step of ResNet-50 beats the slow one's, by more than compute alone explains
    f, s = _resnet("paper-fast:2x4"), _resnet("paper-slow:2x4")
    assert s.breakdown_s["dp_grad_sync"] > 10 * f.breakdown_s["dp_grad_sync"]


def test_the_servers_optimizer_step_runs_at_the_hosts_memory_bandwidth():
    c = parse_cluster("paper-fast:2x8")
    parallel = ParallelSpec(dp=16, micro_batch=64)
    sgd = predict_cnn(CNNSpec("resnet50", global_batch=1024, optimizer="sgd"), parallel, c, "ps-sync")
    adam = predict_cnn(CNNSpec("resnet50", global_batch=1024, optimizer="adamw"), parallel, c, "ps-sync")
    # Adam reads and writes two more fp32 state tensors per parameter: 4 more passes of 4 bytes
    extra_s = 4 * 4 * sgd.parameters / c.node.host_memory_bytes_per_s
    assert adam.breakdown_s["dp_grad_sync"] - sgd.breakdown_s["dp_grad_sync"] == pytest.approx(extra_s, rel=1e-6)


def test_advise_takes_a_cnn_model_without_building_it():
    result = CliRunner().invoke(cli.app, ["advise", "--json", "--cluster", "paper-slow:2x4", "--model", "vgg16",
                                          "--batch-size", "256", "--db", "no-such-store.db"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["workload"]["params"] == PUBLISHED["vgg16"][2] and out["workload"]["batch_per_gpu"] == 32
    steps = {s["strategy"]: s["step_s"] for s in out["strategies"]}
    assert steps["ddp"] < steps["ps-sync"]  # 8 x 553 MB through one server's link on 40 Gb/s Ethernet


@pytest.mark.parametrize("workload", ["resnet-cifar", "vgg-cifar"])
def test_a_registered_workload_is_predicted_from_its_recorded_layers(workload):
    """`--model resnet-cifar`: the layers recorded from one real forward hold the model's exact parameter
    count, and their GEMM FLOPs per sample equal the step profiler's (forward + backward, the first
    convolution without a data gradient); the CLI prices it like any CNN."""
    import torch

    from ddlscope.cli.predict import _workload_layers
    from ddlscope.predict.cnn import hardware_flops_per_sample
    from ddlscope.runtime.profiler import profile_task
    from ddlscope.workloads import WORKLOADS

    layers = _workload_layers(workload)
    spec = CNNSpec(workload, global_batch=4, image_size=32, classes=10, layers=layers)
    task = WORKLOADS.get(workload).build(WORKLOADS.get(workload).spec_class(samples=10, test_samples=10), 0)
    assert counts(spec).params == sum(p.numel() for p in task.model.parameters())
    assert hardware_flops_per_sample(spec) * 4 == profile_task(task, 4).flops
    assert sum(layer.kind == "conv" for layer in layers) == sum(isinstance(m, torch.nn.Conv2d)
                                                                 for m in task.model.modules())
    blocks = len(task.model.blocks)  # units: the stem (0, if any), each block, the head (blocks + 1)
    assert set(range(1, blocks + 2)) <= {layer.unit for layer in layers} <= set(range(blocks + 2))
    result = CliRunner().invoke(cli.app, ["predict", "--json", "--cluster", "a100-80gb:1x4", "--model", workload,
                                          "--global-batch", "256", "--micro-batch", "64", "--dp", "4"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["parameters"] == counts(spec).params and out["model"]["layers"] == len(layers)
    assert 0 < out["step_time_s"] < 0.05
