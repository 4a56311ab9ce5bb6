"""broker/cluster/metadata.py (the state machine, no network) and the pieces of
broker/cluster/metadata_group.py that need none: the replicated commands applied as pysyncobj
applies them, the dump, the conflict's message, the password; then one real single-member
group on 127.0.0.1 that survives a restart from its journal.

What is asserted: the first definition committed wins and never changes (the same one again
is a no-op, another is answered with the committed one); a conflict names the stream, the
key, both values, the config file and both nodes; placement is recorded once per group; the
state goes through the dump as plain data; a node's streams are read from its config with
their effective replication factor; the metadata port is checked like the other ports.
"""

from __future__ import annotations

import asyncio
import pickle
import socket
import tomllib
from pathlib import Path

import pytest

from bench.ports import cluster_port
from broker.cluster.metadata import LocalStreams, MetadataState, StreamDefinition
from broker.cluster.metadata_group import (
    MetadataConflict,
    MetadataError,
    MetadataGroup,
    metadata_address,
    password,
)
from broker.cluster.metadata_replica import Replica
from broker.config import ConfigError, check_ports, parse_config

DEVICES = StreamDefinition("devices", ("devices/#",), 4, 3)
LOGS = StreamDefinition("logs", ("logs/#", "audit/#"), 1, 2)


def _local(*definitions: StreamDefinition, source: str = "n3.toml") -> LocalStreams:
    return LocalStreams(definitions, source)


# -- the state machine -----------------------------------------------------------------------


def test_the_first_definition_committed_wins_and_never_changes() -> None:
    state = MetadataState()
    assert state.define(DEVICES.as_data(), "n1") == (DEVICES.as_data(), "n1")
    # The same definition from another node: a no-op, still n1's.
    assert state.define(DEVICES.as_data(), "n2") == (DEVICES.as_data(), "n1")
    # Another definition of the stream: refused, answered with the committed one.
    eight = StreamDefinition("devices", ("devices/#",), 8, 3)
    assert state.define(eight.as_data(), "n3") == (DEVICES.as_data(), "n1")
    assert state.streams == {"devices": (DEVICES, "n1")}


def test_a_conflict_names_the_stream_the_key_both_values_the_file_and_both_nodes() -> None:
    state = MetadataState()
    state.define(DEVICES.as_data(), "n1")
    ours = StreamDefinition("devices", ("devices/+/telemetry",), 8, 3)
    conflicts = state.conflicts(_local(ours), "n3")
    assert [(c.stream, c.key, c.ours, c.theirs) for c in conflicts] == [
        ("devices", "topic_filter", ["devices/+/telemetry"], ["devices/#"]),
        ("devices", "partitions", 8, 4),
    ]
    assert str(conflicts[1]) == (
        "n3.toml: streams[devices].partitions = 8 on node n3, but the cluster's definition "
        "of stream 'devices' (committed first, from node n1's config) has partitions = 4"
    )
    error = str(MetadataConflict(conflicts))
    assert error.startswith(str(conflicts[0]) + "; " + str(conflicts[1]) + ": ")
    assert "refuses to start" in error


@pytest.mark.parametrize(
    ("other", "key"),
    [
        (StreamDefinition("devices", ("devices/#",), 4, 2), "replication_factor"),
        (StreamDefinition("devices", ("devices/#",), 4, 3, compacted=True), "compacted"),
        (StreamDefinition("devices", ("devices/#", "x/#"), 4, 3), "topic_filter"),
    ],
)
def test_every_key_of_a_definition_is_compared(other: StreamDefinition, key: str) -> None:
    state = MetadataState()
    state.define(DEVICES.as_data(), "n1")
    assert [c.key for c in state.conflicts(_local(other), "n2")] == [key]
    assert state.conflicts(_local(DEVICES), "n2") == []


def test_absent_and_unknown_streams() -> None:
    state = MetadataState()
    state.define(LOGS.as_data(), "n2")
    local = _local(DEVICES)
    assert state.absent(local) == [DEVICES]  # to propose
    assert state.unknown_to(local) == [("logs", "n2")]  # a warning, not a refusal
    assert state.conflicts(local, "n1") == []


def test_only_the_replication_factor_changes_and_the_conflict_names_the_command() -> None:
    state = MetadataState()
    state.define(DEVICES.as_data(), "n1")
    five = StreamDefinition("devices", ("devices/#",), 4, 5)
    assert state.set_replication("devices", 5, "n2") == (five.as_data(), "n1")
    assert state.streams == {"devices": (five, "n1")} and state.changed == {"devices": "n2"}
    # The same factor again: a no-op (the command is idempotent); an unknown stream or a
    # factor below 1: refused, nothing changed.
    assert state.set_replication("devices", 5, "n3") == (five.as_data(), "n1")
    assert state.changed == {"devices": "n2"}
    assert state.set_replication("nope", 2, "n2") is None
    assert state.set_replication("devices", 0, "n2") is None
    assert state.streams["devices"][0].replication_factor == 5
    # A node still configured with 3: a conflict that is final only once caught up, naming
    # the command and where it ran; one in partitions is final at once.
    (conflict,) = state.conflicts(_local(DEVICES), "n3")
    assert (conflict.key, conflict.ours, conflict.theirs, conflict.final) == (
        "replication_factor",
        3,
        5,
        False,
    )
    assert "set by mqlog cluster set-replication on node n2 since) has replication_factor = 5" in (
        str(conflict)
    )
    (other,) = state.conflicts(_local(StreamDefinition("devices", ("devices/#",), 8, 5)), "n3")
    assert other.key == "partitions" and other.final
    # Through the dump, who changed it too.
    again = MetadataState()
    again.load(pickle.loads(pickle.dumps(state.to_data())))
    assert (again.streams, again.changed) == (state.streams, state.changed)


def test_placement_is_recorded_once_per_group() -> None:
    state = MetadataState()
    assert state.place({7: ["n1", "n2", "n3"], 9: ["n2", "n3", "n1"]}) == 2
    assert state.place({7: ["n3", "n1", "n2"], 11: ["n1"]}) == 1
    assert state.placement == {7: ("n1", "n2", "n3"), 9: ("n2", "n3", "n1"), 11: ("n1",)}


def test_the_dump_is_plain_data_and_loads_back() -> None:
    state = MetadataState()
    state.define(DEVICES.as_data(), "n1")
    state.define(LOGS.as_data(), "n2")
    state.place({7: ["n1", "n2"]})
    data = state.to_data()
    # No class of ours in the dump: it unpickles without this module's names.
    assert "broker" not in pickle.dumps(data).decode("latin-1")
    again = MetadataState()
    again.load(pickle.loads(pickle.dumps(data)))
    assert again.streams == state.streams and again.placement == state.placement


# -- the replicated commands, applied as pysyncobj applies a committed entry -----------------


def test_the_replica_applies_commands_and_goes_through_its_dump() -> None:
    changes: list[None] = []
    replica = Replica(lambda: changes.append(None))
    # _doApply=True is how pysyncobj calls a @replicated method for a committed entry.
    assert replica.define(DEVICES.as_data(), "n1", _doApply=True) == (DEVICES.as_data(), "n1")
    assert replica.place({7: ["n1"]}, _doApply=True) == 1
    assert len(changes) == 2  # the loop is told after each
    dumped = replica._serialize()
    assert set(dumped) == {"streams", "placement", "changed"}  # no lock, no callback
    other = Replica(lambda: changes.append(None))
    other._deserialize(dumped)
    assert other.state.streams == replica.state.streams
    assert other.state.placement == {7: ("n1",)}


def test_the_password_is_derived_from_the_secret() -> None:
    a, b = b"a-cluster-secret-of-32-bytes....", b"another-cluster-secret-32-bytes."
    assert password(a) == password(a) != password(b)
    assert a.decode() not in password(a)
    assert metadata_address(("10.0.0.1", 7950)) == ("10.0.0.1", 7949)


# -- the config ------------------------------------------------------------------------------


def _config(tmp_path: Path, cluster: str = "", streams: str = "") -> dict[str, object]:
    secret = tmp_path / "cluster.key"
    secret.write_bytes(b"0123456789abcdef0123456789abcdef")
    secret.chmod(0o600)
    return tomllib.loads(
        f'[cluster]\nnode_id = "n1"\nbind = "10.0.0.1"\nsecret_file = "{secret}"\n{cluster}\n'
        + streams
    )


def test_local_streams_carry_the_effective_replication_factor(tmp_path: Path) -> None:
    data = _config(
        tmp_path,
        "replication_factor = 3",
        '[[streams]]\nname = "devices"\ntopic_filter = ["devices/#"]\npartitions = 4\n'
        '[[streams]]\nname = "logs"\ntopic_filter = "logs/#"\nreplication_factor = 2\n',
    )
    local = LocalStreams.of(parse_config(data, "n1.toml"))
    assert local.source == "<config>"  # parse_config alone: load_config sets the path
    assert local.definitions == (
        StreamDefinition("devices", ("devices/#",), 4, 3),
        StreamDefinition("logs", ("logs/#",), 1, 2),
        StreamDefinition("default", (), 1, 3),  # as the broker opens it
    )


def test_the_metadata_port_is_checked_like_the_others(tmp_path: Path) -> None:
    data = _config(tmp_path, "raft_port = 8081")  # - 1 = 8080, the HTTP API's default
    with pytest.raises(ConfigError, match=r"cluster.raft_port - 1 \(the metadata group\) = 8080"):
        parse_config(data, "n1.toml")
    with pytest.raises(ConfigError, match=r"cluster.raft_port"):
        parse_config(_config(tmp_path, "raft_port = 1"), "n1.toml")
    check_ports(parse_config(_config(tmp_path, "raft_port = 2"), "n1.toml"))


# -- one real member: the journal survives a restart -----------------------------------------


def test_a_single_member_group_agrees_and_its_state_survives_a_restart(tmp_path: Path) -> None:
    members = {"n1": ("127.0.0.1", cluster_port())}
    secret = b"a-test-secret-of-enough-bytes"

    async def open_group() -> MetadataGroup:
        return await MetadataGroup.open("n1", members, secret, tmp_path, 0.3, 0.05)

    async def main() -> None:
        group = await open_group()
        try:
            await asyncio.wait_for(group.agree(_local(DEVICES, LOGS), 10.0), 10.0)
            group.place({7: [1, 2]}, {1: "n1", 2: "n2"})
            while group.desired(7) is None:
                await group.changed.wait()
                group.changed.clear()
            view = group.status()
            assert (view["streams"], view["placed"], view["leader"]) == (2, 1, "n1")
        finally:
            await group.close()
        assert (tmp_path / "metadata.journal").exists()
        # Restarted: the committed definitions come back from the journal, before any
        # leader is heard, and a config that now disagrees is refused from them.
        group = await open_group()
        try:
            assert group.status()["streams"] == 2
            assert group.desired(7) == ("n1", "n2")
            eight = StreamDefinition("devices", ("devices/#",), 8, 3)
            with pytest.raises(MetadataConflict, match=r"partitions = 8 on node n1"):
                await group.agree(_local(eight), 10.0)
        finally:
            await group.close()

    asyncio.run(main())


def test_a_replication_factor_changes_through_the_group(tmp_path: Path) -> None:
    """``set_replication`` commits; a restart configured with the old factor is refused once
    caught up (a one-member group catches up with itself), with the new one it agrees."""
    members = {"n1": ("127.0.0.1", cluster_port())}
    secret = b"a-test-secret-of-enough-bytes"

    async def main() -> None:
        group = await MetadataGroup.open("n1", members, secret, tmp_path, 0.3, 0.05)
        try:
            await asyncio.wait_for(group.agree(_local(DEVICES), 10.0), 10.0)
            definition = await group.set_replication("devices", 2, 10.0)
            assert definition["replication_factor"] == 2
            with pytest.raises(ValueError, match="stream 'nope' is not defined"):
                await group.set_replication("nope", 2, 10.0)
            for factor in (0, 8):
                with pytest.raises(ValueError, match="at least 1 and at most 7"):
                    await group.set_replication("devices", factor, 10.0)
        finally:
            await group.close()
        group = await MetadataGroup.open("n1", members, secret, tmp_path, 0.3, 0.05)
        try:
            with pytest.raises(MetadataConflict, match=r"replication_factor = 3 on node n1"):
                await group.agree(_local(DEVICES), 10.0)
        finally:
            await group.close()
        two = StreamDefinition("devices", ("devices/#",), 4, 2)
        group = await MetadataGroup.open("n1", members, secret, tmp_path, 0.3, 0.05)
        try:
            await asyncio.wait_for(group.agree(_local(two), 10.0), 10.0)
        finally:
            await group.close()

    asyncio.run(main())


def test_a_node_down_while_the_factor_changed_agrees_with_the_new_one(tmp_path: Path) -> None:
    """n3 is down while the factor changes: its copy says 3, its config (updated) says 2.
    That conflict is not final before n3 caught up with a leader, and then there is none
    (refused at once from the stale copy without the rule)."""
    members = {f"n{i}": ("127.0.0.1", cluster_port()) for i in (1, 2, 3)}
    secret = b"a-test-secret-of-enough-bytes"
    two = StreamDefinition("devices", ("devices/#",), 4, 2)

    async def open_group(name: str) -> MetadataGroup:
        return await MetadataGroup.open(name, members, secret, tmp_path / name, 0.3, 0.05)

    async def main() -> None:
        groups = [await open_group(n) for n in members]
        try:
            await asyncio.gather(*(g.agree(_local(DEVICES), 20.0) for g in groups))
            await groups[2].close()
            await asyncio.wait_for(groups[0].set_replication("devices", 2, 20.0), 20.0)
            groups[2] = await open_group("n3")
            with groups[2].replica.lock:
                assert groups[2].replica.state.streams["devices"][0].replication_factor == 3
            await asyncio.wait_for(groups[2].agree(_local(two), 20.0), 20.0)
            assert groups[2].status()["definitions"]["devices"]["replication_factor"] == 2
        finally:
            for g in groups:
                await g.close()

    asyncio.run(main())


def test_the_fsynced_copy_outlives_a_lost_journal(tmp_path: Path) -> None:
    """pysyncobj's journal is written through mmap, never fsynced: a power cut may take it.
    The copy written (fsync) at each applied change brings the definitions back anyway."""
    members = {"n1": ("127.0.0.1", cluster_port()), "n2": ("127.0.0.1", cluster_port())}
    secret = b"a-test-secret-of-enough-bytes"
    alone = {"n1": members["n1"]}

    async def main() -> None:
        group = await MetadataGroup.open("n1", alone, secret, tmp_path, 0.3, 0.05)
        try:
            await asyncio.wait_for(group.agree(_local(DEVICES, LOGS), 10.0), 10.0)
            group.place({7: [1, 2]}, {1: "n1", 2: "n2"})
            while group.desired(7) is None:
                await group.changed.wait()
                group.changed.clear()
        finally:
            await group.close()
        for name in ("metadata.journal", "metadata.journal.meta", "metadata.dump"):
            (tmp_path / name).unlink(missing_ok=True)
        # Back with a peer that is not there: no leader, no journal, and yet the state is
        # this node's, and a config that now disagrees is refused at once.
        group = await MetadataGroup.open("n1", members, secret, tmp_path, 0.3, 0.05)
        try:
            assert group.status()["leader"] is None
            assert group.status()["streams"] == 2 and group.desired(7) == ("n1", "n2")
            eight = StreamDefinition("devices", ("devices/#",), 8, 3)
            with pytest.raises(MetadataConflict, match=r"partitions = 8 on node n1"):
                await group.agree(_local(eight), 10.0)
        finally:
            await group.close()
        # Without it (only the journal gone), the node would know nothing: shown by removing it.
        (tmp_path / "meta").unlink()
        group = await MetadataGroup.open("n1", members, secret, tmp_path, 0.3, 0.05)
        try:
            assert group.status()["streams"] == 0
        finally:
            await group.close()

    asyncio.run(main())


def test_without_a_majority_a_node_serves_unconfirmed_and_the_check_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """n1 alone of two members: no leader, so ``agree`` returns after its wait with a
    warning; once n2 comes, n1's proposal commits and both hold the definition."""
    members = {"n1": ("127.0.0.1", cluster_port()), "n2": ("127.0.0.1", cluster_port())}
    secret = b"a-test-secret-of-enough-bytes"

    async def main() -> None:
        n1 = await MetadataGroup.open("n1", members, secret, tmp_path / "n1", 0.3, 0.05)
        n2 = None
        try:
            with caplog.at_level("WARNING", logger="broker.cluster"):
                await n1.agree(_local(DEVICES, source="n1.toml"), 0.5)
            assert "no majority of the metadata group answered within 0.5 s" in caplog.text
            assert "n1.toml unconfirmed" in caplog.text
            assert n1.status()["streams"] == 0 and n1.status()["leader"] is None
            n2 = await MetadataGroup.open("n2", members, secret, tmp_path / "n2", 0.3, 0.05)
            await asyncio.wait_for(n2.agree(_local(DEVICES, source="n2.toml"), 10.0), 10.0)
            while n1.status()["streams"] == 0:
                await n1.changed.wait()
                n1.changed.clear()
            assert n1.status()["definitions"] == n2.status()["definitions"]
        finally:
            await n1.close()
            if n2 is not None:
                await n2.close()

    asyncio.run(main())


def test_seeds_on_this_address_name_gossip_ports(tmp_path: Path) -> None:
    """Seeds are gossip addresses (the others' Raft ports come from gossip): one on this
    node's address is refused only when it is this node's own gossip port."""
    data = _config(tmp_path, 'raft_port = 7950\nseeds = ["10.0.0.1:7946"]')
    with pytest.raises(ConfigError, match=r"n1.toml: cluster.seeds\[0\] = '10.0.0.1:7946'"):
        parse_config(data, "n1.toml")
    for seed in ("10.0.0.1:7951", "10.0.0.1:7949", "10.0.0.2:7946"):
        parse_config(_config(tmp_path, f'raft_port = 7950\nseeds = ["{seed}"]'), "n1.toml")


def test_a_taken_metadata_port_is_an_error_naming_the_address(tmp_path: Path) -> None:
    port = cluster_port()
    members = {"n1": ("127.0.0.1", port)}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port - 1))
        taken.listen()

        async def main() -> None:
            await MetadataGroup.open(
                "n1", members, b"a-test-secret-of-enough-bytes", tmp_path, 0.3, 0.05
            )

        with pytest.raises(MetadataError, match=rf"cannot listen on 127.0.0.1:{port - 1} "):
            asyncio.run(main())
