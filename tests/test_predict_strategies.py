"""Data-parallel strategy models of the main study: DDP, FSDP, parameter servers, local SGD, compression."""

from types import SimpleNamespace

import pytest

from ddlscope.predict import parse_cluster
from ddlscope.predict.estimators.ddp import compressed_ddp, ddp
from ddlscope.predict.estimators.fsdp import fsdp
from ddlscope.predict.estimators.localsgd import local_sgd
from ddlscope.predict.estimators.ps import parameter_server
from ddlscope.predict.estimators.single import single
from ddlscope.predict.strategies import ServerSpec, image_workload
from ddlscope.specs import ConfigError

# each model lives in its strategy's estimator; the shared workload and servers in predict.strategies
st = SimpleNamespace(ddp=ddp, compressed_ddp=compressed_ddp, fsdp=fsdp, local_sgd=local_sgd,
                     parameter_server=parameter_server, single=single, ServerSpec=ServerSpec,
                     image_workload=image_workload)

FAST = parse_cluster("a100-80gb:1x4")  # NVSwitch inside one node
SLOW = parse_cluster("a10g:4x1")  # one A10G per node on 40 Gb/s Ethernet


def test_ddp_overlaps_the_all_reduce_with_backward():
    w = st.image_workload("resnet50", 64)
    est = st.ddp(w, FAST)
    assert est.exposed_comm_s < est.comm_s
    assert 0.9 < est.scaling_efficiency <= 1.0
    assert est.speedup_vs_single == pytest.approx(est.samples_per_s / st.single(w, FAST).samples_per_s)


def test_ddp_speedup_on_the_fast_cluster_beats_the_slow_one():
    w = st.image_workload("resnet50", 64, resolution=32)  # CIFAR-10-sized inputs
    fast, slow = st.ddp(w, FAST), st.ddp(w, SLOW)
    assert fast.speedup_vs_single > slow.speedup_vs_single
    assert 1.5 < fast.speedup_vs_single < 4  # the study's 2-3x on 4 GPUs sits in here


def test_fsdp_saves_memory_but_is_slower_on_a_slow_network():
    w = st.image_workload("vgg16", 32, resolution=32)
    cluster = parse_cluster("a10g:2x4")
    ddp, fsdp = st.ddp(w, cluster), st.fsdp(w, cluster)
    assert ddp.memory_bytes_per_gpu / fsdp.memory_bytes_per_gpu > 3
    assert fsdp.step_s > ddp.step_s
    assert st.fsdp(w, cluster, zero_stage=1).memory_bytes_per_gpu > fsdp.memory_bytes_per_gpu


def test_vgg_scales_worse_than_resnet101():
    """Horovod (REFERENCE.md): VGG-16's large fully connected layers send more bytes per FLOP."""
    cluster = parse_cluster("a10g:128x4")  # 512 GPUs on 40 Gb/s Ethernet: the network is the limit
    vgg = st.ddp(st.image_workload("vgg16", 64), cluster)
    resnet = st.ddp(st.image_workload("resnet101", 64), cluster)
    inception = st.ddp(st.image_workload("inception_v3", 64), cluster)
    assert vgg.scaling_efficiency < resnet.scaling_efficiency
    assert vgg.scaling_efficiency < inception.scaling_efficiency
    assert vgg.exposed_comm_s > resnet.exposed_comm_s


def test_async_parameter_server_beats_sync_with_stragglers_and_pays_in_staleness():
    w = st.image_workload("resnet50", 64)
    cluster = parse_cluster("a100-80gb:2x4")
    slow = [1.0] * 7 + [2.0]
    server = st.ServerSpec(servers=4, link_gb_per_s=25, aggregate_gb_per_s=50)
    sync = st.parameter_server(w, cluster, "sync", server, jitter_cv=0.1, slowdowns=slow)
    async_ = st.parameter_server(w, cluster, "async", server, jitter_cv=0.1, slowdowns=slow)
    ssp = st.parameter_server(w, cluster, "ssp", server, staleness=3, jitter_cv=0.1, slowdowns=slow)
    assert async_.samples_per_s > ssp.samples_per_s and async_.samples_per_s > sync.samples_per_s
    assert async_.mean_staleness_steps > 0 and sync.mean_staleness_steps == 0
    assert ssp.mean_staleness_steps <= 3


def test_ssp_absorbs_jitter_but_not_a_persistent_straggler():
    w = st.image_workload("resnet50", 64)
    cluster = parse_cluster("a100-80gb:2x4")
    server = st.ServerSpec(servers=8, link_gb_per_s=50, aggregate_gb_per_s=100)
    sync = st.parameter_server(w, cluster, "sync", server, jitter_cv=0.3)
    ssp = st.parameter_server(w, cluster, "ssp", server, staleness=8, jitter_cv=0.3)
    assert ssp.samples_per_s > sync.samples_per_s


def test_cpu_bound_server_caps_the_update_rate():
    w = st.image_workload("vgg16", 64)
    weak = st.parameter_server(w, FAST, "async", st.ServerSpec(servers=1, aggregate_gb_per_s=1))
    strong = st.parameter_server(w, FAST, "async", st.ServerSpec(servers=4, aggregate_gb_per_s=20))
    assert weak.samples_per_s < strong.samples_per_s
    assert any("server-bound" in n for n in weak.notes)


def test_block_cyclic_async_moves_a_block_per_update():
    w = st.image_workload("vgg16", 32, resolution=32)  # bandwidth-bound on the slow cluster
    servers = st.ServerSpec(servers=4, link_gb_per_s=1.25)
    plain = st.parameter_server(w, SLOW, "async", servers)
    cyclic = st.parameter_server(w, SLOW, "async", servers, block_cyclic=True)
    assert cyclic.comm_s < plain.comm_s and cyclic.samples_per_s > plain.samples_per_s
    one = st.ServerSpec(servers=1, link_gb_per_s=1.25)  # one block: the same protocol
    assert st.parameter_server(w, SLOW, "async", one, block_cyclic=True).step_s == pytest.approx(
        st.parameter_server(w, SLOW, "async", one).step_s)
    with pytest.raises(ConfigError):
        st.parameter_server(w, SLOW, "sync", servers, block_cyclic=True)


def test_local_sgd_amortizes_and_cocod_hides_the_average():
    w = st.image_workload("vgg16", 32, resolution=32)
    every, rare = st.local_sgd(w, SLOW, period=1), st.local_sgd(w, SLOW, period=16)
    assert rare.step_s < every.step_s
    assert st.local_sgd(w, SLOW, period=16, overlap=True).step_s <= rare.step_s


def test_compression_trades_bytes_for_compute():
    w = st.image_workload("vgg16", 32, resolution=32)
    plain = st.ddp(w, SLOW)
    for method in ("fp16", "powersgd", "topk"):
        est = st.compressed_ddp(w, SLOW, method)
        assert est.step_s < plain.step_s, method
    assert st.compressed_ddp(w, SLOW, "fp16").comm_s == pytest.approx(plain.comm_s / 2, rel=0.05)
    with pytest.raises(ConfigError):
        st.compressed_ddp(w, SLOW, "zip")


def test_bad_strategy_arguments():
    w = st.image_workload("resnet50")
    with pytest.raises(ConfigError):
        st.parameter_server(w, FAST, "gossip")
    with pytest.raises(ConfigError):
        st.parameter_server(w, FAST, "sync", slowdowns=[1.0, 2.0])
    with pytest.raises(ConfigError):
        st.image_workload("alexnet")
