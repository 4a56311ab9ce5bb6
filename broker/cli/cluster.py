"""``mqlog cluster status`` and ``mqlog cluster transfer-leader``: a node's view of the cluster,
from its HTTP admin API (``GET /api/v1/cluster``; ``POST .../partitions/<stream>/<p>/leader``).

``status`` prints the members as gossip has them (name, gossip address, state: alive,
suspect, dead or left, incarnation, Raft and MQTT addresses they announced), the Raft links
(name, address, connected or not) and, per
partition, its leader, term, commit index, this node's role and the followers' lag (known on
the leader: ask the leader's node for exact lags), then the metadata group's leader and
what it holds (stream definitions, placed partitions, its members), any stream this node's config
defines otherwise than the cluster, and the XDP filter (attached, or why user space filters
gossip instead; its allowlist; packets and bytes by class and verdict).
``transfer-leader STREAM/PARTITION NODE`` asks for the partition's leadership to move to
NODE (Raft's leadership transfer, thesis s3.10): the node asked passes it to the current
leader, and the command waits until the partition's leader is NODE (or ``--timeout``
passes, exit status 1). The balancer then leaves that partition where the operator put it
for five minutes (as Kafka's leader imbalance check waits 300 s) before it hands it back
to its preferred replica.
``set-replication STREAM N`` commits the stream's new replication factor in the metadata
group (``POST .../cluster/streams/<stream>/replication``; the one key of a definition that
changes, ``broker.cluster.metadata`` says why); each partition's leader then adds or removes
replicas, one at a time, to match.
"""

from __future__ import annotations

import argparse
import time
import urllib.parse
from typing import Any

from broker.cli.admin import (
    DEFAULT_BROKER,
    PASSWORD_ENV,
    BrokerUnreachable,
    _get,
    _post,
    table,
)

#: Seconds the leave command's HTTP request waits beyond the node's own wait (its drain of
#: leaderships and its goodbye come on top).
LEAVE_MARGIN_SECONDS = 20.0


def cmd_status(args: argparse.Namespace) -> int:
    view = _get(args.broker, "/api/v1/cluster", args.user)
    if view.get("mode") != "cluster":
        print("single node: no [cluster] section in this broker's config")
        return 0
    workers = f", {view['workers']} workers" if view.get("workers", 1) > 1 else ""
    print(f"node {view['node_id']}: {len(view['nodes'])} nodes{workers}")
    members = view.get("members") or []
    if members:
        print(
            table(
                ["MEMBER", "GOSSIP", "STATE", "INCARNATION", "RAFT", "MQTT"],
                [
                    [
                        m["id"] + (" (self)" if m["self"] else ""),
                        m["gossip"],
                        m["state"],
                        m["incarnation"],
                        m["raft"] or "-",
                        m["mqtt"] or "-",
                    ]
                    for m in members
                ],
            )
        )
        print()
    print(
        table(
            ["NODE", "ADDRESS", "STATE"],
            [[n["id"], n["address"], n["state"]] for n in view["nodes"]],
        )
    )
    print()
    rows: list[list[Any]] = []
    for p in view["partitions"]:
        lags = ", ".join(f"{f['node']}:{f['lag']}" for f in p["followers"]) or "-"
        rows.append(
            [
                f"{p['stream']}/{p['partition']}",
                p["leader"] or "none",
                "-" if p["term"] is None else p["term"],
                p["commit_index"],
                p["role"],
                ",".join(p["replicas"]),
                lags,
            ]
        )
    print(table(["PARTITION", "LEADER", "TERM", "COMMIT", "ROLE HERE", "REPLICAS", "LAG"], rows))
    meta = view.get("metadata")
    if meta:
        print(
            f"\nmetadata: leader {meta['leader'] or 'none'}, term {meta['term']}, "
            f"{meta['streams']} streams, {meta['placed']} partitions placed, "
            f"applied {meta['applied']}, members {', '.join(meta.get('members', ()))}"
        )
        for conflict in meta["conflicts"]:
            print(f"CONFLICT: {conflict}")
    xdp = view.get("xdp")
    if xdp:
        _print_xdp(xdp)
    return 0


def _print_xdp(xdp: dict[str, Any]) -> None:
    """The filter of the cluster interface: where it runs, its allowlist, its counters."""
    if xdp["enabled"]:
        print(f"\nxdp: attached to {xdp['interface']} ({xdp['mode']} mode)")
    else:
        print(f"\nxdp: off, gossip filtered in user space ({xdp['reason']})")
    print(f"allowed: {', '.join(xdp['members']) or 'none'}")
    rows = [
        [cls, verdict, n, xdp["bytes"].get(cls, {}).get(verdict, 0)]
        for cls, verdicts in sorted(xdp["packets"].items())
        for verdict, n in sorted(verdicts.items())
    ]
    if rows:
        print(table(["CLASS", "VERDICT", "PACKETS", "BYTES"], rows))


def cmd_transfer_leader(args: argparse.Namespace) -> int:
    stream, sep, p = args.partition.rpartition("/")
    if not sep or not p.isdigit():
        raise BrokerUnreachable(f"{args.partition!r}: expected STREAM/PARTITION, e.g. devices/0")
    path = f"/api/v1/cluster/partitions/{urllib.parse.quote(stream, safe='')}/{p}/leader"
    answer = _post(args.broker, path, {"node": args.node}, args.user)
    print(answer.get("message", ""))
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        view = _get(args.broker, "/api/v1/cluster", args.user)
        for part in view["partitions"]:
            if (part["stream"], str(part["partition"])) == (stream, p) and part[
                "leader"
            ] == args.node:
                print(f"{stream}/{p}: leader {args.node} in term {part['term']}")
                return 0
        time.sleep(0.1)
    print(f"{stream}/{p}: leader is not {args.node} after {args.timeout:g} s")
    return 1


def cmd_set_replication(args: argparse.Namespace) -> int:
    path = f"/api/v1/cluster/streams/{urllib.parse.quote(args.stream, safe='')}/replication"
    # The node waits up to 10 s for the metadata group's majority: a little longer here.
    answer = _post(args.broker, path, {"replication_factor": args.factor}, args.user, 15.0)
    definition = answer["definition"]
    print(
        f"stream {definition['name']}: replication_factor = {definition['replication_factor']} "
        "(committed); its partitions' leaders move replicas to match (mqlog cluster status); "
        "set it in every node's [[streams]] entry too: a node restarted with another value "
        "refuses to start"
    )
    return 0


def cmd_leave(args: argparse.Namespace) -> int:
    answer = _post(
        args.broker,
        "/api/v1/cluster/leave",
        {"timeout": args.timeout},
        args.user,
        timeout=args.timeout + LEAVE_MARGIN_SECONDS,
    )
    for partition, node in sorted(answer.get("moved", {}).items()):
        print(f"{partition}: handed to {node}")
    still = answer.get("still_leading", [])
    for partition in still:
        print(f"{partition}: still led by {answer.get('node')} (no other replica took it)")
    for partition in answer.get("replicas_kept", []):
        print(
            f"{partition}: replica stays on {answer.get('node')} (too few other members to "
            "move it to: not waited for)"
        )
    for partition in answer.get("replicas_unmoved", []):
        print(
            f"{partition}: replica still on {answer.get('node')} (not moved within "
            f"{args.timeout:g} s)"
        )
    print(f"node {answer.get('node')}: clients told to use another server; stopping")
    return 1 if still else 0


def add_parser(sub: Any) -> None:
    cluster = sub.add_parser(
        "cluster", help="a cluster node's view: status, transfer-leader, leave, set-replication"
    )
    commands = cluster.add_subparsers(dest="cluster_command", required=True)
    status = commands.add_parser("status", help="members, and each partition's leader and lag")
    status.set_defaults(func=cmd_status)
    transfer = commands.add_parser("transfer-leader", help="move a partition's leadership")
    transfer.add_argument("partition", help="STREAM/PARTITION, e.g. devices/0")
    transfer.add_argument("node", help="the node_id to lead it")
    transfer.add_argument("--timeout", type=float, default=10.0, help="seconds to wait (10)")
    transfer.set_defaults(func=cmd_transfer_leader)
    leave = commands.add_parser(
        "leave", help="drain the node (leaderships, clients, goodbye) and stop it"
    )
    leave.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="seconds to wait for the node's replicas to move elsewhere (60)",
    )
    leave.set_defaults(func=cmd_leave)
    replication = commands.add_parser(
        "set-replication", help="change a stream's replication factor, cluster-wide"
    )
    replication.add_argument("stream", help="the stream's name")
    replication.add_argument("factor", type=int, help="its new replication factor")
    replication.set_defaults(func=cmd_set_replication)
    for cmd in (status, transfer, leave, replication):
        cmd.add_argument(
            "--broker", default=DEFAULT_BROKER, help=f"a node's HTTP API (default {DEFAULT_BROKER})"
        )
        cmd.add_argument(
            "--user", help=f"a user of the password file (password in ${PASSWORD_ENV})"
        )
