"""Which filter a cluster node runs, and its first allowlist.

:func:`open_filter` tries the kernel filter when ``[xdp] enabled = true`` and falls back to
the user-space one, logging why once (the broker's other answer to the question is the
metric ``mqlog_xdp_enabled 0`` and the ``xdp`` block of ``mqlog cluster status``):
``[xdp]`` disabled, an IPv6 cluster address (the program filters IPv4), no bcc, no kernel
headers, no such interface, no privilege, or the kernel refusing the program or the link.

The first allowlist is what the node knows before gossip speaks: its own address and its
seeds' hosts (resolved when they are names). The membership code then calls
``set_members`` on every change of the member list.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from collections.abc import Iterable

from broker.config import Config
from broker.config.cluster import METADATA_PORT_OFFSET, ClusterConfig
from broker.xdp.kernel import SOURCE, KernelFilter, Ports
from broker.xdp.members import MemberFilter
from broker.xdp.system_bcc import BccMissing
from broker.xdp.userspace import UserSpaceFilter

log = logging.getLogger("broker.xdp")


def ports_of(config: Config) -> Ports:
    """The node's gossip, Raft and client ports (the config's, overrides applied)."""
    cluster = config.cluster
    if cluster is None:
        raise ValueError("the XDP filter guards a cluster's ports: no [cluster]")
    server = config.server
    return Ports(
        gossip=cluster.gossip_port,
        raft_first=cluster.raft_port + METADATA_PORT_OFFSET,
        raft_last=cluster.raft_port + config.worker_count() - 1,
        mqtt=tuple(p for p in (server.port, server.tls_port, server.ws_port) if p),
    )


def static_members(cluster: ClusterConfig) -> list[str]:
    """This node's address and its seeds' (a host name resolved to its IPv4 and IPv6
    addresses; one that does not resolve is logged and left out)."""
    addrs = [cluster.bind]
    for seed in cluster.seeds:
        try:
            addrs.append(str(ipaddress.ip_address(seed.host)))
        except ValueError:
            try:
                infos = socket.getaddrinfo(seed.host, seed.port, proto=socket.IPPROTO_UDP)
            except OSError as e:
                log.warning("xdp: seed %s does not resolve (%s): not allowed yet", seed, e)
                continue
            addrs.extend(str(info[4][0]) for info in infos)
    return addrs


#: Capability bits (linux/capability.h): attaching to an interface needs CAP_NET_ADMIN;
#: loading a program and creating its maps, CAP_BPF (Linux 5.8+) or CAP_SYS_ADMIN.
CAP_NET_ADMIN, CAP_SYS_ADMIN, CAP_BPF = 12, 21, 39


def _missing_privilege() -> str | None:
    """What this process lacks to load and attach an XDP program (its effective
    capabilities, /proc/self/status), or None. bcc would only say "failed to compile"."""
    try:
        with open("/proc/self/status") as f:
            caps = next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))
    except (OSError, StopIteration, ValueError):
        return None  # not Linux's procfs: let the kernel answer
    missing = []
    if not caps & (1 << CAP_BPF | 1 << CAP_SYS_ADMIN):
        missing.append("CAP_BPF")
    if not caps & (1 << CAP_NET_ADMIN):
        missing.append("CAP_NET_ADMIN")
    if missing:
        return f"no privilege to load BPF: {' and '.join(missing)} not permitted (run as root)"
    return None


def _kernel_unavailable(config: Config) -> str | None:
    """Why the kernel filter cannot be tried, or None."""
    xdp, cluster = config.xdp, config.cluster
    if not xdp.enabled:
        return "[xdp] enabled = false"
    if cluster is not None and ":" in cluster.bind:
        return f"cluster.bind = {cluster.bind} is IPv6: the XDP program filters IPv4 only"
    if not SOURCE.is_file():
        return f"{SOURCE} is missing"
    missing = _missing_privilege()
    if missing is not None:
        return missing
    headers = f"/lib/modules/{os.uname().release}/build"
    if not os.path.isdir(headers):
        return f"no kernel headers at {headers} (scripts/install-system-deps.sh links them)"
    return None


def open_filter(config: Config, members: Iterable[str] | None = None) -> MemberFilter:
    """The node's filter with its first allowlist (``members``, else :func:`static_members`).
    Blocks for the compilation (seconds): run it in a thread."""
    if config.cluster is None:
        raise ValueError("the XDP filter guards a cluster's ports: no [cluster]")
    reason = _kernel_unavailable(config)
    chosen: MemberFilter | None = None
    if reason is None:
        xdp = config.xdp
        try:
            chosen = KernelFilter.load(ports_of(config), xdp.interface, xdp.mode)
        except BccMissing as e:
            reason = str(e)
        except OSError as e:  # no such interface, EPERM, the verifier, EBUSY
            reason = f"{xdp.interface}: {e.strerror or e}"
        except Exception as e:  # bcc's compile and load errors are plain Exceptions
            reason = f"bcc: {e}"
    if chosen is None:
        reason = reason or "the kernel filter did not load"
        level = logging.INFO if not config.xdp.enabled else logging.WARNING
        log.log(level, "xdp: gossip is filtered in user space: %s", reason)
        chosen = UserSpaceFilter(reason)
    else:
        log.info("xdp: filter attached to %s (%s mode)", config.xdp.interface, config.xdp.mode)
    try:
        chosen.set_join_from(config.cluster.join_from)
        chosen.set_members(static_members(config.cluster) if members is None else members)
    except BaseException:
        chosen.close()
        raise
    return chosen
