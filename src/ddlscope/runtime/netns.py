"""The `shaped` network mode: every local rank in its own network namespace, links rate-limited by tc.

Layout of one run (nothing is added to the root namespace):

    ddl-<pid>-<id>-hub   a Linux bridge `br0`, one veth end `r<i>` per rank
    ddl-<pid>-<id>-r<i>  rank i's end `ddl0`, address 10.213.0.<i+1>/24, and `lo`

Both directions of each rank's link are limited to the profile's bandwidth by
a tbf qdisc: `ddl0` egress (what the rank sends) and `r<i>` egress (what the
bridge forwards to the rank). The subnet is private to the run's own
namespaces, so concurrent runs can reuse it. This kernel has no netem, so
latency cannot be added here; the strategies' software link keeps alpha.

The launcher creates a `ShapedNetwork` around the elastic launch; each worker
connects to the agent's store from the root namespace, then joins its own
namespace (`join_rank_namespace`) before building the process group, so gloo
traffic crosses the shaped veths while the store stays on 127.0.0.1.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import subprocess
import sys
import uuid
from dataclasses import dataclass
from typing import Any

from ddlscope.specs import ConfigError
from ddlscope.store import pid_alive

PREFIX = "ddl-"
SUBNET = "10.213.0"  # /24, only ever configured inside the run's own namespaces
RANK_IFNAME = "ddl0"  # every rank's veth end has this name, inside its own namespace
BRIDGE = "br0"
MAX_RANKS = 250
CLONE_NEWNET = 0x40000000
_OURS = re.compile(rf"^{PREFIX}(\d+)-[0-9a-f]{{6}}-(hub|r\d+)$")  # ddl-<launcher pid>-<id>-<role>


class ShapingUnavailable(ConfigError):
    """This machine cannot shape the network (not root, no `ip netns`, no tbf...). One line."""


@dataclass(frozen=True)
class RankLink:
    namespace: str
    ifname: str
    address: str


def tbf_args(rate_bytes_per_s: float, nprocs: int = 2) -> list[str]:
    """tc arguments of a tbf qdisc limiting a link to `rate_bytes_per_s`.

    burst: bytes a link may send at line speed after being idle. A message
    shorter than the burst escapes shaping, so it stays small: 8 KiB (above
    one 1514-byte frame, which a tbf bucket must hold; larger TSO/GSO packets
    are split by tbf itself), or 1 ms worth of the rate when that is larger,
    so fast links are not paced one frame per timer wake-up.
    limit: bytes that may wait in the queue. A drop on a link whose round trip
    is a few microseconds tends to end in TCP's 200 ms minimum retransmission
    timeout, which would swamp the transfer being measured, so the queue is
    deep enough never to drop: TCP small queues keep at most
    tcp_limit_output_bytes (4 MiB by default) of one socket below it, and a
    rank has one gloo socket per peer, so 4 MiB per peer (at least 16 MiB).
    Memory is only used while bytes actually wait.
    """
    bits = max(1, round(rate_bytes_per_s * 8))
    burst = max(8 * 1024, round(rate_bytes_per_s * 1e-3))
    limit = 4 * 1024 * 1024 * max(4, nprocs - 1)
    return ["tbf", "rate", f"{bits}bit", "burst", str(burst), "limit", str(limit)]


class ShapedNetwork:
    """Namespaces, bridge, veths and tbf qdiscs for `nprocs` local ranks; removed on exit, whatever happened."""

    def __init__(self, nprocs: int, rate_bytes_per_s: float) -> None:
        if not 1 <= nprocs <= MAX_RANKS:
            raise ConfigError(f"shaped network mode supports 1..{MAX_RANKS} local ranks, got {nprocs}")
        if not rate_bytes_per_s > 0 or rate_bytes_per_s == float("inf"):
            raise ConfigError(f"shaped network mode needs a finite bandwidth, got {rate_bytes_per_s} B/s")
        self.rate_bytes_per_s = rate_bytes_per_s
        self.tag = f"{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.hub = f"{PREFIX}{self.tag}-hub"
        self.ranks = [RankLink(f"{PREFIX}{self.tag}-r{i}", RANK_IFNAME, f"{SUBNET}.{i + 1}") for i in range(nprocs)]
        self._created: list[str] = []

    @property
    def namespaces(self) -> list[str]:
        return [self.hub, *(r.namespace for r in self.ranks)]

    def __enter__(self) -> "ShapedNetwork":
        self.create()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.destroy()

    def create(self) -> None:
        check_available()
        remove_stale_namespaces()
        try:
            self._add_namespace(self.hub)
            _run("ip", "-n", self.hub, "link", "add", BRIDGE, "type", "bridge")
            _run("ip", "-n", self.hub, "link", "set", BRIDGE, "up")
            tbf = tbf_args(self.rate_bytes_per_s, len(self.ranks))
            for i, rank in enumerate(self.ranks):
                hub_end = f"r{i}"
                self._add_namespace(rank.namespace)
                _run("ip", "-n", self.hub, "link", "add", hub_end, "type", "veth",
                     "peer", "name", rank.ifname, "netns", rank.namespace)
                _run("ip", "-n", self.hub, "link", "set", hub_end, "master", BRIDGE)
                _run("ip", "-n", self.hub, "link", "set", hub_end, "up")
                _run("ip", "-n", rank.namespace, "addr", "add", f"{rank.address}/24", "dev", rank.ifname)
                _run("ip", "-n", rank.namespace, "link", "set", rank.ifname, "up")
                _run("ip", "-n", rank.namespace, "link", "set", "lo", "up")
                _run("tc", "-n", rank.namespace, "qdisc", "add", "dev", rank.ifname, "root", *tbf)  # rank -> bridge
                _run("tc", "-n", self.hub, "qdisc", "add", "dev", hub_end, "root", *tbf)  # bridge -> rank
        except BaseException:
            self.destroy()
            raise

    def destroy(self) -> None:
        """Delete every namespace this object created (their veths, bridge and qdiscs go with them)."""
        while self._created:
            subprocess.run(["ip", "netns", "delete", self._created[-1]], capture_output=True, check=False)
            self._created.pop()

    def worker_json(self) -> str:
        """What each worker needs to join its namespace, indexed by local rank."""
        return json.dumps({"namespaces": [r.namespace for r in self.ranks], "ifname": RANK_IFNAME})

    def record(self) -> dict[str, Any]:
        return {"namespaces": self.namespaces, "rank_addresses": [r.address for r in self.ranks],
                "qdisc": " ".join(tbf_args(self.rate_bytes_per_s, len(self.ranks)))}

    def _add_namespace(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._created.append(name)


def check_available() -> None:
    """Raise ShapingUnavailable (one line) unless this process may create namespaces and qdiscs."""
    if sys.platform != "linux":
        raise ShapingUnavailable("shaped network mode needs Linux network namespaces; use mode = 'emulated'")
    if os.geteuid() != 0:
        raise ShapingUnavailable("shaped network mode needs root (ip netns, tc); run as root or use mode = 'emulated'")


def list_namespaces() -> list[str]:
    out = _run("ip", "netns", "list")
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def remove_stale_namespaces(everything: bool = False) -> list[str]:
    """Delete ddl- namespaces left by launchers that died without cleaning up; return their names.

    A namespace is stale when the launcher pid in its name no longer runs;
    `everything=True` deletes all of ours regardless (only when no run is active).
    """
    removed = []
    for name in list_namespaces():
        match = _OURS.match(name)
        if match and (everything or not pid_alive(int(match.group(1)))):
            subprocess.run(["ip", "netns", "delete", name], capture_output=True, check=False)
            removed.append(name)
    return removed


def join_rank_namespace(shaping_json: str, local_rank: int, rank: int, world_size: int,
                        backend: str) -> dict[str, Any]:
    """Worker side: the init_process_group arguments for a rank on the shaped network.

    The store client is connected first, from the root namespace (a socket
    stays in the namespace it was created in), so the store keeps working on
    127.0.0.1; then this thread joins the rank's namespace, where gloo's
    sockets and threads are created, bound to the rank's veth.
    """
    import torch.distributed as dist
    from torch.distributed.constants import default_pg_timeout

    if backend != "gloo":
        raise RuntimeError(f"shaped network mode shapes gloo's TCP traffic; backend {backend} is not supported")
    info = json.loads(shaping_json)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=False, timeout=default_pg_timeout)
    enter_namespace(info["namespaces"][local_rank])
    os.environ["GLOO_SOCKET_IFNAME"] = info["ifname"]
    return {"store": dist.PrefixStore("ddlscope", store), "rank": rank, "world_size": world_size}


def enter_namespace(name: str) -> None:
    """Move the calling thread into network namespace `name` (threads it starts later follow it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


def _run(*cmd: str) -> str:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=30)
    except FileNotFoundError:
        raise ShapingUnavailable(f"shaped network mode needs iproute2 ({cmd[0]} not found); use mode = 'emulated'") from None
    except subprocess.CalledProcessError as exc:
        detail = " ".join((exc.stderr or exc.stdout or f"exit code {exc.returncode}").split())
        raise ShapingUnavailable(f"cannot shape the network: `{' '.join(cmd)}` failed: {detail}") from None
    except subprocess.TimeoutExpired:
        raise ShapingUnavailable(f"cannot shape the network: `{' '.join(cmd)}` timed out") from None
    return proc.stdout


if __name__ == "__main__":  # python -m ddlscope.runtime.netns: remove leftovers of crashed runs
    for stale in remove_stale_namespaces(everything="--all" in sys.argv):
        print(f"removed {stale}")
