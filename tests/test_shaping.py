"""Shaped network mode: ranks in their own network namespaces, both directions of each link limited by tc tbf."""

import json
import os
import subprocess
import threading
import uuid

import pytest

from ddlscope.runtime.config import load_experiment
from ddlscope.runtime.emulation import resolve_link
from ddlscope.runtime.netns import PREFIX, ShapedNetwork, list_namespaces, remove_stale_namespaces


def _why_no_namespaces() -> str | None:
    """Probe: create and delete a throwaway namespace. None when shaping can be tested here."""
    if os.geteuid() != 0:
        return "shaped mode needs root (ip netns, tc); not root"
    name = f"{PREFIX}probe-{uuid.uuid4().hex[:6]}"
    try:
        added = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True, timeout=10)
    except FileNotFoundError:
        return "iproute2 (`ip`) is not installed"
    if added.returncode:
        return f"`ip netns add` is not permitted here: {added.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=10)
    return None


WHY_NOT = _why_no_namespaces()
needs_netns = pytest.mark.skipif(WHY_NOT is not None, reason=f"no network namespaces: {WHY_NOT}")

SHAPED = ("--set", "cluster.network.profile=custom", "--set", "cluster.network.alpha_us=0")


def _ours() -> set[str]:
    return {n for n in list_namespaces() if n.startswith(PREFIX)}


def _sh(*cmd: str) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=10).stdout


def test_shaped_record_leaves_only_latency_to_software():
    net = load_experiment(None, {"cluster.network.profile": "custom", "cluster.network.alpha_us": 100,
                                 "cluster.network.bandwidth_gbps": 0.008, "cluster.network.mode": "shaped"}).cluster.network
    link, record = resolve_link(net, threads=1)
    assert link.alpha_s == pytest.approx(1e-4) and link.bandwidth_bytes_per_s == float("inf")
    assert link.transfer_s("all_reduce", 10**6, 2) == pytest.approx(1e-4)
    assert record["mode"] == "shaped" and record["shaped_bandwidth_bytes_per_s"] == pytest.approx(1e6)
    assert record["latency"] == "emulated in software (this kernel has no netem)"
    scaled = net.model_copy(update={"scaled": True})
    _, record = resolve_link(scaled, threads=1)
    assert record["shaped_bandwidth_bytes_per_s"] == pytest.approx(1e6 / record["scale_factor"])


def test_shaped_mode_refuses_several_nodes(cli):
    result = cli("run", "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "127.0.0.1:29999", "--world-size", "2",
                 *SHAPED, "--set", "cluster.network.bandwidth_gbps=0.01", "--set", "cluster.network.mode=shaped",
                 timeout_s=60)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "shaped" in result.stderr and "nnodes = 2" in result.stderr


@needs_netns
def test_namespaces_veths_and_qdiscs_exist_then_go():
    with ShapedNetwork(2, 1e6) as net:
        assert set(net.namespaces) <= _ours()
        for i, rank in enumerate(net.ranks):
            assert f"10.213.0.{i + 1}/24" in _sh("ip", "-n", rank.namespace, "-br", "addr", "show", "dev", "ddl0")
            assert "tbf" in _sh("tc", "-n", rank.namespace, "qdisc", "show", "dev", "ddl0")  # rank -> bridge
            hub_side = _sh("tc", "-n", net.hub, "qdisc", "show", "dev", f"r{i}")  # bridge -> rank
            assert "tbf" in hub_side and "rate 8Mbit" in hub_side
            assert "master br0" in _sh("ip", "-n", net.hub, "link", "show", f"r{i}")
        names = set(net.namespaces)
    assert not names & _ours()

    with pytest.raises(KeyboardInterrupt):
        with ShapedNetwork(3, 1e6) as net:
            names = set(net.namespaces)
            raise KeyboardInterrupt
    assert len(names) == 4 and not names & _ours()


@needs_netns
def test_stale_namespaces_of_dead_launchers_are_removed():
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"{PREFIX}{dead.pid}-abcdef-hub"
    mine = f"{PREFIX}{os.getpid()}-abcdef-hub"  # a live launcher's namespace stays
    for name in (stale, mine):
        subprocess.run(["ip", "netns", "add", name], check=True, timeout=10)
    try:
        assert remove_stale_namespaces() == [stale]
        assert mine in _ours() and stale not in _ours()
    finally:
        for name in (stale, mine):
            subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=10)


@needs_netns
@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_failed_shaped_run_removes_its_namespaces(cli):
    seen: set[str] = set()
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.1):
            seen.update(_ours())

    before = _ours()
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        result = cli("run", "--strategy", "ddp", "--world-size", "2", "--steps", "8", "--quiet", *SHAPED,
                     "--set", "cluster.network.bandwidth_gbps=0.05", "--set", "cluster.network.mode=shaped",
                     "--set", "cluster.faults=[{rank = 1, step = 2}]", timeout_s=75)
    finally:
        done.set()
        watcher.join()
    assert result.returncode == 1 and "failed" in result.stderr
    created = seen - before
    assert len([n for n in created if n.endswith("-hub")]) == 1 and len([n for n in created if n[-3:] in ("-r0", "-r1")]) == 2
    assert not created & _ours()


@needs_netns
@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_shaped_and_emulated_links_agree(cli):
    # mlp-digits' gradient is one 102 KB DDP bucket; 2-rank ring all-reduce puts the payload once on each link.
    # At 8 Mbit/s that is ~0.1 s per step, far above loopback time: the collective is bandwidth-bound.
    comm_s = {}
    for mode in ("emulated", "shaped"):
        result = cli("run", "--strategy", "ddp", "--world-size", "2", "--steps", "12", "--quiet", "--json", *SHAPED,
                     "--set", "cluster.network.bandwidth_gbps=0.008", "--set", f"cluster.network.mode={mode}",
                     timeout_s=90)
        assert result.returncode == 0, result.stderr
        summary = json.loads(result.stdout)
        comm_s[mode] = summary["comm"]["comm_s"]
        modelled_s = summary["comm"]["bytes_sent_per_step"] / 1e6
        assert modelled_s > 0.08
        assert comm_s[mode] == pytest.approx(modelled_s, rel=0.25), mode
    assert comm_s["shaped"] == pytest.approx(comm_s["emulated"], rel=0.25)
