"""broker/cluster/metadata_members.py: which change of the metadata group's members comes next
(no network), then real pysyncobj groups on 127.0.0.1: a fourth node added to a formed
three-member group holds the committed definitions, refuses a conflicting one at a restart
from its own copy, and is removed again; every replica's members survive its restart.

What is asserted: an alive node outside the group is added (not one leaving), before a member
that left or is gone is removed, and a leader never removes itself; a joiner starts with
every member it knows as its peers, a founder with the founders; the added node is a member
in every replica's view and holds the definitions committed before it came; a restart of it
with another definition fails naming the key; the members a replica saw (the joiner
included) are its members after a restart, before any leader is heard; after a removal the
removed node is a member nowhere; a joiner does not campaign before it caught up (its term
stays 0), and does once it did.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from bench.ports import cluster_port
from broker.cluster.metadata import LocalStreams, StreamDefinition
from broker.cluster.metadata_group import COMMITTED, MetadataConflict, MetadataGroup
from broker.cluster.metadata_members import first_peers, next_change

DEVICES = StreamDefinition("devices", ("devices/#",), 4, 3)
SECRET = b"a-test-secret-of-enough-bytes"
#: Seconds any one wait of the real groups may take (an election is 0.3-0.6 s here).
WAIT = 20.0


# -- the next change -------------------------------------------------------------------------


def test_an_alive_node_outside_the_group_is_added_first() -> None:
    config = {"n1", "n2", "n3"}
    assert next_change("n1", config, {"n1", "n2", "n4"}, set(), set(), {"n3"}) == ("add", "n4")
    # Not a node that announces it leaves, nor one that left.
    assert next_change("n1", config, {"n1", "n4"}, {"n4"}, set(), set()) is None
    assert next_change("n1", config, {"n1", "n4"}, set(), {"n4"}, set()) is None
    # Members alive already: nothing to do.
    assert next_change("n1", config, config, set(), set(), set()) is None


def test_a_member_that_left_or_is_gone_is_removed_but_never_the_leader() -> None:
    config = {"n1", "n2", "n3", "n4"}
    assert next_change("n1", config, {"n1", "n3", "n4"}, set(), {"n2"}, set()) == ("remove", "n2")
    assert next_change("n1", config, {"n1", "n2", "n4"}, set(), set(), {"n3"}) == ("remove", "n3")
    # Only a member is removed, and the leader leaves that to the next one.
    assert next_change("n1", config, {"n1"}, set(), {"n1", "n9"}, set()) is None
    # Dead but not for replace_after yet, and not left: stays.
    assert next_change("n1", config, {"n1", "n2", "n3"}, set(), set(), set()) is None


def test_a_joiner_starts_with_every_member_a_founder_with_the_founders() -> None:
    founders, members = ["n1", "n2", "n3"], ["n1", "n2", "n3", "n4", "n5"]
    assert first_peers("n2", founders, members, joined=False) == ["n1", "n3"]
    assert first_peers("n5", founders, members, joined=True) == ["n1", "n2", "n3", "n4"]


# -- real groups -----------------------------------------------------------------------------


def _local(*definitions: StreamDefinition, source: str) -> LocalStreams:
    return LocalStreams(definitions, source)


async def _until(what: Callable[[], bool]) -> None:
    """Until ``what()`` (polled: a members change sets no event), at most :data:`WAIT` s."""

    async def poll() -> None:
        while not what():
            await asyncio.sleep(0.05)

    await asyncio.wait_for(poll(), WAIT)


def test_a_node_added_later_holds_the_definitions_and_is_removed_again(tmp_path: Path) -> None:
    members = {f"n{i}": ("127.0.0.1", cluster_port()) for i in range(1, 5)}
    founders = {n: a for n, a in members.items() if n != "n4"}

    async def open_group(name: str, peers: list[str], joined: bool = False) -> MetadataGroup:
        return await MetadataGroup.open(
            name, members, SECRET, tmp_path / name, 0.3, 0.05, [name, *peers], joined
        )

    async def main() -> None:
        groups = {
            n: await open_group(n, first_peers(n, founders, members, joined=False))
            for n in founders
        }
        n4: MetadataGroup | None = None
        try:
            await asyncio.gather(
                *(g.agree(_local(DEVICES, source=f"{n}.toml"), WAIT) for n, g in groups.items())
            )
            assert all(g.member_names() == ["n1", "n2", "n3"] for g in groups.values())
            # n4 joins: it starts with every member as its peers, and its check of the
            # definitions waits until the leader added it. Meanwhile it never campaigns
            # (five times the longest election timeout here): its term would depose the leader.
            n4 = await open_group("n4", first_peers("n4", founders, members, joined=True), True)
            agreed = asyncio.ensure_future(n4.agree(_local(DEVICES, source="n4.toml"), WAIT))
            await asyncio.sleep(3.0)
            assert n4.status()["term"] == 0 and n4.quiet
            await _until(lambda: any(g.leads() for g in groups.values()))
            leader = next(g for g in groups.values() if g.leads())
            leader.change("add", "n4")
            await asyncio.wait_for(agreed, WAIT)
            await _until(lambda: n4.ready)
            assert not n4.quiet  # caught up: it campaigns like the others from now on
            everyone = [*groups.values(), n4]
            await _until(
                lambda: all(g.member_names() == ["n1", "n2", "n3", "n4"] for g in everyone)
            )
            assert n4.status()["definitions"] == leader.status()["definitions"]
            assert n4.status()["members"] == ["n1", "n2", "n3", "n4"]
            await n4.close()
            # Restarted with another definition: refused from its own copy, naming the key.
            n4 = await open_group("n4", [], True)
            eight = StreamDefinition("devices", ("devices/#",), 8, 3)
            with pytest.raises(MetadataConflict, match=r"devices\]\.partitions = 8 on node n4"):
                await n4.agree(_local(eight, source="n4.toml"), WAIT)
            # Its members are the group's (saved), not the empty list it was opened with.
            assert n4.member_names() == ["n1", "n2", "n3", "n4"]
            # A founder restarted knows n4 as a member at once.
            await groups["n2"].close()
            groups["n2"] = await open_group("n2", ["n1", "n3"])
            assert groups["n2"].member_names() == ["n1", "n2", "n3", "n4"]
            # n4 leaves: removed on the leader, a member nowhere.
            await n4.close()
            n4 = None
            await _until(lambda: any(g.leads() for g in groups.values()))
            leader = next(g for g in groups.values() if g.leads())
            await _until(lambda: _removed(leader, "n4"))
            await _until(
                lambda: all(g.member_names() == ["n1", "n2", "n3"] for g in groups.values())
            )
        finally:
            for g in [*groups.values(), *([n4] if n4 is not None else [])]:
                await g.close()

    asyncio.run(main())


def _removed(leader: MetadataGroup, name: str) -> bool:
    """Propose the removal of ``name`` unless one is pending; True once it is no member."""
    if name not in leader.member_names():
        return True
    if leader.changing is None and leader.leads():
        leader.change("remove", name)
    return False


def test_a_broker_without_a_cluster_does_not_load_pysyncobj() -> None:
    """pysyncobj, and the cryptography it loads (~8 MB of each worker's memory), load when
    a metadata group is made, not with the modules a single node imports."""
    loaded = "sorted(m for m in sys.modules if m.split('.')[0] in ('pysyncobj', 'cryptography'))"
    out = subprocess.run(
        [sys.executable, "-c", f"import sys, broker.cli, broker.server; print({loaded})"],
        cwd=Path(__file__).resolve().parents[3],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "[]"


def test_committed_is_pysyncobjs_success() -> None:
    from pysyncobj import FAIL_REASON

    assert COMMITTED == FAIL_REASON.SUCCESS
