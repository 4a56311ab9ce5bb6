"""The metadata group: ``broker.cluster.metadata``'s state replicated on pysyncobj.

One pysyncobj Raft group spans every member of the cluster. It is not one of the data groups
(``broker.cluster.multiraft``): it holds only desired state (stream definitions, desired
placement; invariants in ``broker.cluster.metadata``), so it may use a simpler Raft than the
data path, and a lost or stale change of it can never lose data.

* **Address.** It listens on the node's cluster address (``[cluster] bind``) at
  ``raft_port - 1`` (:data:`~broker.config.cluster.METADATA_PORT_OFFSET`): a node learns its
  peers' metadata addresses from their Raft addresses (seeds, the member list), with no key or
  handshake of its own.
* **Members.** The group starts with the members the cluster formed with (as the data groups'
  first configuration does); a node that joins later is added, and one that leaves or is
  replaced removed, one change at a time, by the group's leader
  (``broker.cluster.metadata_members``, ``dynamicMembershipChange``). pysyncobj starts a
  replica with the peers it is given and replays only the *committed* change entries of its
  journal over them; so each replica writes the members as it has them (a change counts
  from its append, Raft thesis s4.1) to ``DATA/cluster/metadata.members`` (:data:`MEMBERS`)
  whenever they change, and starts from that list: a restart knows the members it knew,
  the ones added after formation included, before it hears a leader. A node that joins
  does not campaign before it caught up with a leader once (pysyncobj has neither learners
  nor PreVote: a joiner campaigning while nobody knows it yet would come with a term that
  deposes the leader as soon as it is added; Raft thesis s4.2.1 and s4.2.3).
* **Authentication.** pysyncobj's ``password`` is set to a key derived from the cluster secret
  (HMAC-SHA256 of it over :data:`PASSWORD_CONTEXT`: the secret itself, which the node
  transport's handshake uses, never serves as this key): its connections are encrypted and
  authenticated (Fernet: AES-CBC and HMAC), and a peer without the secret cannot send a
  command (pysyncobj unpickles what it receives: the password is what keeps anyone else's
  bytes away from that). pysyncobj bounds no frame's length, so an unauthenticated peer can
  still make a node buffer one large frame before it fails to decrypt: the cluster address
  should be reachable by the members only.
* **Durability.** Its log is ``DATA/cluster/metadata.journal`` (pysyncobj's ``journalFile``,
  with its term, vote and commit index in ``metadata.journal.meta``) and its snapshot
  ``DATA/cluster/metadata.dump`` (``fullDumpFile``): the state survives a restart of every
  node. pysyncobj writes the journal through mmap without fsync, so it survives a process
  crash, not always a power cut. So every applied change is also written to
  ``DATA/cluster/meta`` (:data:`LOCAL_COPY`: the whole state as JSON, temp file, fsync,
  rename, directory fsync) before the node acts on it, and a start loads that copy before
  pysyncobj replays its journal over it (every command is idempotent, first committed
  wins): a node whose journal a power cut took still holds every definition it ever
  applied, and refuses a conflicting config at once, before any leader is heard. DESIGN.md
  names a local compacted ``$meta`` stream for this; a file written whole is that stream
  with one key: the state is a few KiB of desired state, one fsync per change either way,
  and no cleaner is needed to keep it small. pysyncobj records its commit index once a
  second (and this module on a clean stop): after a crash, what was committed in the last
  second is applied again once a leader is heard.
* **Timings** follow the data groups': the election timeout is ``[cluster] election_timeout``
  (randomized up to twice it), heartbeats every ``heartbeat_interval`` but not more often
  than every :data:`MIN_HEARTBEAT_SECONDS` (nothing here is latency-bound, and each
  heartbeat is Python work on a thread that shares the interpreter with the event loop).
* **Threads.** pysyncobj runs on a thread of its own, which ticks it (``doTick``; its
  ``autoTick`` is off, so that the group is built off the loop: the password's key
  derivation, PBKDF2 with 100,000 rounds, would otherwise hold the loop for ~0.1 s).
  Commands are applied on that thread, under :attr:`Replica.lock`, and their results and
  every state change come back to the event loop through ``call_soon_threadsafe``. Every
  method here is called from the loop's thread; :meth:`MetadataGroup.close` stops the thread
  (which then destroys the group: sockets closed, journal unmapped) and waits for it, off
  the loop.

Start-up (:meth:`MetadataGroup.agree`): a node proposes each stream of its config the
metadata lacks, and checks every one of them against the committed definitions (first
committed wins; a disagreement is :class:`MetadataConflict`, and the node refuses to start:
the reasons are in ``broker.cluster.metadata``). Since only a replication factor changes, a
conflict in any other key found in the node's local copy (its journal replayed) is final,
even before a leader is known; one in a replication factor is once the node caught up with
a leader (a node that was down when it changed, restarted with the old value, serves with
the cluster's and logs an error). If no majority answers within the wait given, the node
serves with its own definitions (a warning says so); the check goes on, and a conflict
found later is logged as an error and shown by ``status()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from broker.cluster.hardstate import write_atomically
from broker.cluster.metadata import Conflict, LocalStreams
from broker.config.cluster import MAX_REPLICATION_FACTOR, METADATA_PORT_OFFSET
from broker.config.values import ConfigError

if TYPE_CHECKING:
    from pysyncobj import SyncObj

    from broker.cluster.metadata_replica import Replica

# pysyncobj (and the cryptography it loads, ~8 MB of every process's memory) is imported
# where a group is made, not here: a broker without [cluster] imports this module but never
# makes one.

#: pysyncobj's FAIL_REASON.SUCCESS: a command committed.
COMMITTED = 0

logger = logging.getLogger("broker.cluster")

#: What the cluster secret is keyed with to make the metadata group's password.
PASSWORD_CONTEXT = b"mqlog cluster metadata group v1"
JOURNAL = "metadata.journal"
DUMP = "metadata.dump"
#: The fsynced copy of the applied state (module docstring, Durability).
LOCAL_COPY = "meta"
#: The group's members as this replica last saw them (module docstring, Members).
MEMBERS = "metadata.members"
#: pysyncobj's minimum time between two connection attempts to a peer (its default, 5 s,
#: would hold a node that started before its peers that long).
CONNECT_RETRY_SECONDS = 0.5
#: The longest one tick of the group's thread waits for its sockets (the granularity of its
#: timers: a socket event ends the wait at once).
TICK_SECONDS = 0.05
#: A quiet replica's election timeout (:meth:`MetadataGroup.open`): never, in practice.
QUIET_SECONDS = 86400.0
#: The metadata group's heartbeats are at most this frequent (module docstring); always
#: under a quarter of the election timeout (pysyncobj wants it under a third).
MIN_HEARTBEAT_SECONDS = 0.1


class MetadataError(ConfigError):
    """This node cannot join the metadata group, or may not (:class:`MetadataConflict`)."""


class MetadataConflict(MetadataError):
    """This node's config defines a stream otherwise than the cluster committed; the message
    names the stream, the key, both values, the config file and both nodes."""

    def __init__(self, conflicts: list[Conflict]) -> None:
        self.conflicts = conflicts
        self.detail = "; ".join(map(str, conflicts))
        super().__init__(
            f"{self.detail}: this node refuses to start (of a stream's definition only its "
            "replication_factor changes, by mqlog cluster set-replication); make its config "
            "match the cluster's definition"
        )


def metadata_address(raft: tuple[str, int]) -> tuple[str, int]:
    """A member's metadata address, from its Raft address (module docstring)."""
    return raft[0], raft[1] + METADATA_PORT_OFFSET


def password(secret: bytes) -> str:
    """The metadata group's pysyncobj password: HMAC-SHA256(secret, PASSWORD_CONTEXT)."""
    return hmac.new(secret, PASSWORD_CONTEXT, hashlib.sha256).hexdigest()


def _text(address: tuple[str, int]) -> str:
    """pysyncobj's node id: ``host:port`` (IPv6 unbracketed: it splits at the last colon)."""
    return f"{address[0]}:{address[1]}"


class MetadataGroup:
    """This node's replica of the metadata group (module docstring); :meth:`open` it."""

    def __init__(
        self, name: str, members: Mapping[str, tuple[str, int]], heartbeat_interval: float
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.name = name
        self.address = _text(metadata_address(members[name]))
        #: pysyncobj node id (``host:port``) -> member name (:meth:`learn` adds to it).
        self.names: dict[str, str] = {}
        self.learn(members)
        #: The group's members as pysyncobj has them (ids, this node's included): its
        #: configuration, written to :data:`MEMBERS` by the group's thread when it changes.
        self.config: frozenset[str] = frozenset()
        self._members_file: Path | None = None
        #: The membership change proposed and not yet answered (one at a time), if any.
        self.changing: tuple[str, str] | None = None
        #: No campaign before catching up with a leader (:meth:`open`'s ``quiet``).
        self.quiet = False
        self._conf: Any = None
        self._timeouts = (0.0, 0.0)
        #: Seconds between two proposals of a command pysyncobj could not place.
        self.retry_seconds = heartbeat_interval
        #: pysyncobj's group (built by :meth:`open`, off the loop).
        self.sync: Any = None
        #: Set (on the loop) after a command was applied or a dump loaded.
        self.changed = asyncio.Event()
        self.local = LocalStreams()
        #: This replica caught up with a leader once (pysyncobj's ``onReady``); the event
        #: is set on the loop after it.
        self.ready = False
        self._caught_up = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        from broker.cluster.metadata_replica import Replica

        self.replica: Replica = Replica(self._notify)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"metadata-{name}", daemon=True)

    @classmethod
    async def open(
        cls,
        name: str,
        members: Mapping[str, tuple[str, int]],
        secret: bytes,
        state_dir: Path,
        election_timeout: float,
        heartbeat_interval: float,
        peers: Iterable[str] | None = None,
        quiet: bool = False,
    ) -> MetadataGroup:
        """Join the group: ``members`` is every member's Raft address by name, this node
        (``name``) included; ``peers`` (default: all of them) those the group starts with
        unless this replica saved its members (module docstring, Members). Binds the
        metadata address (:class:`MetadataError` if it cannot) and replays its local copy,
        off the loop, then starts the group's thread. ``quiet``: a node that joins the group
        never campaigns before it caught up with a leader (module docstring, Members) unless
        its local copy shows it did once."""
        group = cls(name, members, heartbeat_interval)
        state_dir.mkdir(parents=True, exist_ok=True)
        group.replica.copy = state_dir / LOCAL_COPY
        group._members_file = state_dir / MEMBERS
        await asyncio.to_thread(group.replica.load_copy)
        saved = await asyncio.to_thread(_load_members, group._members_file)
        start = saved if saved is not None else group._ids(members if peers is None else peers)
        group.quiet = quiet and not group.replica.state.streams
        group.sync = await asyncio.to_thread(
            group._build, secret, state_dir, election_timeout, heartbeat_interval, start
        )
        await asyncio.to_thread(group._note_config)
        group._thread.start()
        return group

    def _ids(self, names: Iterable[str]) -> list[str]:
        ids = {n: i for i, n in self.names.items()}
        return [ids[n] for n in names if n in ids]

    def _build(
        self,
        secret: bytes,
        state_dir: Path,
        election_timeout: float,
        heartbeat_interval: float,
        start: Iterable[str],
    ) -> SyncObj:
        from pysyncobj import SyncObj, SyncObjConf
        from pysyncobj.syncobj import SyncObjException

        longest = 2 * election_timeout
        self._timeouts = (election_timeout, longest)
        conf = self._conf = SyncObjConf(
            password=password(secret),
            bindAddress=self.address,
            journalFile=str(state_dir / JOURNAL),
            fullDumpFile=str(state_dir / DUMP),
            raftMinTimeout=election_timeout,
            raftMaxTimeout=longest,
            appendEntriesPeriod=min(
                max(heartbeat_interval, MIN_HEARTBEAT_SECONDS), election_timeout / 4
            ),
            connectionTimeout=max(3.5, longest),
            connectionRetryTime=CONNECT_RETRY_SECONDS,
            leaderFallbackTimeout=longest,
            useFork=False,  # a fork of this multi-threaded process to write a small dump
            maxBindRetries=1,  # a port in use is an error at start, not a retry forever
            onReady=self._on_ready,
            autoTick=False,  # ticked by self._thread (module docstring)
            dynamicMembershipChange=True,  # members join and leave (module docstring)
        )
        others = sorted({a for a in start if a != self.address})
        try:
            sync = SyncObj(self.address, others, conf, consumers=[self.replica])
        except SyncObjException:
            raise MetadataError(
                f"cluster: the metadata group cannot listen on {self.address} "
                f"(cluster.bind, port cluster.raft_port + {METADATA_PORT_OFFSET}): is the port "
                "in use?"
            ) from None
        if self.quiet:
            self._hush(sync)
        # One tick here, before the group's thread starts: the dump is loaded and the
        # journal replayed up to the commit index it recorded, so that agree() starts from
        # this node's local copy (and proposes nothing it already holds).
        sync.doTick(0.0)
        return sync

    def _hush(self, sync: SyncObj) -> None:
        """No campaign before :meth:`_on_ready` (:meth:`open`'s ``quiet``). pysyncobj draws
        each election deadline from its conf's two timeouts when it sets one (its
        constructor checks them against other settings: changed after it); the deadline
        its constructor drew is moved too (no public name: found by its mangled name)."""
        self._conf.raftMinTimeout, self._conf.raftMaxTimeout = QUIET_SECONDS, 2 * QUIET_SECONDS
        deadline = "_SyncObj__raftElectionDeadline"
        if hasattr(sync, deadline):
            setattr(sync, deadline, time.monotonic() + QUIET_SECONDS)

    def _run(self) -> None:
        """The group's thread: tick until :meth:`close`, then destroy the group here."""
        while not self._stop.is_set():
            try:
                self.sync.doTick(TICK_SECONDS)
                self._note_config()
            except Exception:
                logger.exception("cluster: metadata: a tick of the group failed")
                time.sleep(TICK_SECONDS)
        # pysyncobj saves its commit index once a second and not when destroyed: saved here,
        # a clean stop leaves a local copy that replays whole at the next start. (No public
        # name for it: pysyncobj's journal, found by its mangled name, and skipped if absent.)
        journal = getattr(self.sync, "_SyncObj__raftLog", None)
        if journal is not None and hasattr(journal, "onOneSecondTimer"):
            journal.onOneSecondTimer()
        self.sync.destroy()

    def _note_config(self) -> None:
        """The group's thread: keep :attr:`config` and :data:`MEMBERS` as pysyncobj has the
        members (it applies a change when the entry is appended: Raft thesis s4.1)."""
        config = frozenset({self.address, *(n.id for n in self.sync.otherNodes)})
        if config == self.config:
            return
        before, self.config = self.config, config
        if before:
            logger.info("cluster: metadata: members now %s", ", ".join(sorted(self.member_names())))
        if self._members_file is not None:
            try:
                write_atomically(self._members_file, orjson.dumps(sorted(config)))
            except OSError as e:  # the next change writes it again; a restart replays the log
                logger.error("cluster: metadata: cannot write %s: %s", self._members_file, e)

    def _on_ready(self) -> None:
        """pysyncobj's thread: this replica caught up with a leader's commit index.
        (pysyncobj sets its own ``isReady()`` only after this callback returns: a loop
        woken here could still read False, and then wait for nothing.)"""
        if self.quiet:  # caught up: campaigns like the others from the next heartbeat on
            self._conf.raftMinTimeout, self._conf.raftMaxTimeout = self._timeouts
            self.quiet = False
        self.ready = True
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
            self.loop.call_soon_threadsafe(self._caught_up.set)
            self.loop.call_soon_threadsafe(self.changed.set)

    def _notify(self) -> None:
        """pysyncobj's thread: tell the loop something changed."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
            self.loop.call_soon_threadsafe(self.changed.set)

    async def _apply(self, command: Callable[..., None], *args: Any) -> Any:
        """Propose ``command(*args)`` until it is committed and applied here; its result.
        Every command is idempotent (``broker.cluster.metadata``), so one whose outcome
        pysyncobj could not tell (a leader change) is simply proposed again."""
        while True:
            done: asyncio.Future[tuple[Any, int]] = self.loop.create_future()

            def answer(result: Any, error: int, done: asyncio.Future[Any] = done) -> None:
                with contextlib.suppress(RuntimeError):
                    self.loop.call_soon_threadsafe(_settle, done, (result, error))

            command(*args, callback=answer)
            result, error = await done
            if error == COMMITTED:
                return result
            await asyncio.sleep(self.retry_seconds)  # an election in progress: try again

    # -- start-up ------------------------------------------------------------------------------

    async def agree(self, local: LocalStreams, wait: float) -> None:
        """Propose ``local``'s streams the metadata lacks and check them all against the
        committed definitions (module docstring). Raises :class:`MetadataConflict` on a
        disagreement found within ``wait`` seconds; past that, returns with a warning and
        the check goes on."""
        self.local = local
        task = self.spawn(self._agree(local))
        try:
            await asyncio.wait_for(asyncio.shield(task), wait)
        except TimeoutError:
            logger.warning(
                "cluster: metadata: no majority of the metadata group answered within %g s: "
                "serving with the stream definitions of %s unconfirmed (checked when a "
                "majority answers)",
                wait,
                local.source,
            )
            task.add_done_callback(_report_late)

    async def _agree(self, local: LocalStreams) -> None:
        state = self.replica.state
        with self.replica.lock:
            absent = state.absent(local)
        for definition in absent:
            self.spawn(self._apply(self.replica.define, definition.as_data(), self.name))
        while True:
            self.changed.clear()
            with self.replica.lock:
                conflicts = state.conflicts(local, self.name)
                missing = state.absent(local)
            if any(c.final or self.ready for c in conflicts):
                raise MetadataConflict(conflicts)
            if not missing and not conflicts:
                break  # final but for a replication factor changed since: checked below
            await self.changed.wait()  # also set once caught up with a leader
        logger.info("cluster: metadata: the %d stream definitions agreed", len(local.definitions))
        self.spawn(self._warn_unknown(local))

    async def _warn_unknown(self, local: LocalStreams) -> None:
        """Once caught up with a leader: an error per replication factor the cluster changed
        while this node was down that its config still has otherwise (it serves, with the
        cluster's: ``broker.cluster.metadata_members``), a warning per stream the cluster
        defines and ``local`` does not."""
        await self._caught_up.wait()
        with self.replica.lock:
            unknown = self.replica.state.unknown_to(local)
            conflicts = self.replica.state.conflicts(local, self.name)
        for conflict in conflicts:
            logger.error("cluster: metadata: %s: make this node's config match", conflict)
        for stream, by in unknown:
            logger.warning(
                "cluster: metadata: stream %r is defined in the cluster (from node %s's config) "
                "but not in %s: this node holds none of its partitions",
                stream,
                by,
                local.source,
            )

    async def set_replication(self, stream: str, factor: int, wait: float) -> dict[str, Any]:
        """Commit ``stream``'s new replication factor (``mqlog cluster set-replication``);
        its committed definition. ValueError: the stream is not defined, or no majority
        answered within ``wait`` s (it may still commit)."""
        if not 1 <= factor <= MAX_REPLICATION_FACTOR:  # as a [[streams]] entry allows
            raise ValueError(
                f"replication factor {factor}: at least 1 and at most {MAX_REPLICATION_FACTOR}"
            )
        try:
            result = await asyncio.wait_for(
                self._apply(self.replica.set_replication, stream, factor, self.name), wait
            )
        except TimeoutError:
            raise ValueError(
                f"no majority of the metadata group answered within {wait:g} s"
            ) from None
        if result is None:
            raise ValueError(f"stream {stream!r} is not defined in the cluster")
        definition: dict[str, Any] = result[0]
        return definition

    def place(self, groups: Mapping[int, Iterable[int]], names: Mapping[int, str]) -> None:
        """Record the desired placement (replica node ids, placement order) of each group of
        ``groups`` the metadata does not place yet; in the background."""
        with self.replica.lock:
            new = {
                g: [names.get(n, str(n)) for n in nodes]
                for g, nodes in groups.items()
                if g not in self.replica.state.placement
            }
        if new:
            self.spawn(self._apply(self.replica.place, new))

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- members -----------------------------------------------------------------------------

    def learn(self, members: Mapping[str, tuple[str, int]]) -> None:
        """Name the members of ``members`` (Raft addresses by name) in views and changes."""
        for n, a in members.items():
            self.names[_text(metadata_address(a))] = n

    def member_names(self) -> list[str]:
        """The group's members by name (an id no member list names yet, as it is)."""
        return sorted(self.names.get(i, i) for i in self.config)

    def leads(self) -> bool:
        return bool(self.sync._isLeader())

    def change(self, kind: str, name: str) -> None:
        """On the leader: propose ``kind`` (``"add"`` or ``"remove"``) of member ``name`` (a
        name :meth:`learn` knows); :attr:`changing` until pysyncobj answers (it commits the
        change, or refuses it: another is still uncommitted, or the leader changed)."""
        node = self._ids([name])[0]
        self.changing = (kind, name)

        def answer(result: Any, error: int) -> None:
            with contextlib.suppress(RuntimeError):
                self.loop.call_soon_threadsafe(self._changed, kind, name, error)

        propose = self.sync.addNodeToCluster if kind == "add" else self.sync.removeNodeFromCluster
        propose(node, callback=answer)

    def _changed(self, kind: str, name: str, error: int) -> None:
        self.changing = None
        if error == COMMITTED:
            logger.info("cluster: metadata: %s %s committed", _VERBS[kind], name)
        else:  # proposed again by the next pass if still wanted
            logger.info(
                "cluster: metadata: %s %s not done (pysyncobj: %s)", _VERBS[kind], name, error
            )

    # -- views and shutdown --------------------------------------------------------------------

    def desired(self, group: int) -> tuple[str, ...] | None:
        """The group's desired replicas (node names), if recorded."""
        with self.replica.lock:
            return self.replica.state.placement.get(group)

    def status(self) -> dict[str, Any]:
        """For ``ClusterNode.status``: this replica's view (the leader as it knows it)."""
        sync = self.sync
        leader = sync._getLeader()
        with self.replica.lock:
            state = self.replica.state
            conflicts = state.conflicts(self.local, self.name)
            view = {
                "address": self.address,
                "leader": self.names.get(leader.id) if leader is not None else None,
                "role": "leader" if sync._isLeader() else "follower",
                "ready": self.ready,
                "term": sync.raftCurrentTerm,
                "commit_index": sync.raftCommitIndex,
                "applied": sync.raftLastApplied,
                "streams": len(state.streams),
                "placed": len(state.placement),
                "members": self.member_names(),
                "definitions": {
                    n: {**d.as_data(), "defined_by": by, "replication_set_by": state.changed.get(n)}
                    for n, (d, by) in state.streams.items()
                },
                "conflicts": [str(c) for c in conflicts],
            }
        return view

    async def close(self) -> None:
        """Stop proposing, stop pysyncobj's thread and wait for it (its sockets closed and
        its journal unmapped), off the loop."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._stop.set()
        if self._thread.is_alive():
            await asyncio.to_thread(self._thread.join)


_VERBS = {"add": "adding member", "remove": "removing member"}


def _load_members(path: Path) -> list[str] | None:
    """The members a replica saved (:data:`MEMBERS`), or None if it never did."""
    try:
        return [str(i) for i in orjson.loads(path.read_bytes())]
    except FileNotFoundError:
        return None
    except (OSError, orjson.JSONDecodeError, ValueError) as e:
        logger.error("cluster: metadata: %s unreadable, not used: %s", path, e)
        return None


def _settle(done: asyncio.Future[Any], value: Any) -> None:
    if not done.done():
        done.set_result(value)


def _report_late(task: asyncio.Task[None]) -> None:
    """The agreement that outlived the start-up wait ended."""
    if task.cancelled():
        return
    error = task.exception()
    if isinstance(error, MetadataConflict):
        logger.error(
            "cluster: metadata: %s: this node already serves with its own definition: stop "
            "it and make its config match the cluster's",
            error.detail,
        )
    elif error is not None:
        logger.error("cluster: metadata: the agreement failed", exc_info=error)
