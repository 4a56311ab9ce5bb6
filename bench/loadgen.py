"""MQTT load generator processes for ``bench.mqtt_bench``: raw uvloop sockets, numpy framing.

Every PUBLISH the generator sends has the same shape: a 23-byte topic
``<prefix7>/<nnnnn>/telemetry`` and a 64-byte payload ``<publisher u32><seq u32><send time
u64 ns, CLOCK_MONOTONIC><48 bytes pad>`` (little endian). So a QoS 0 PUBLISH is always 91
bytes and a QoS 1 one 93, and a read full of deliveries is one numpy structured array: no
Python object per message. Its fixed headers are checked in one vectorised comparison; any
other packet (CONNACK, SUBACK, a PUBLISH of another shape) takes a slow generic path.

Every delivery is checked per publisher: a sequence number that is not the previous one plus
one counts as a gap (missing) or as a duplicate/reorder; the orchestrator compares the total
received with the total sent.

A worker process plays one role (``sub``, ``pub``, ``storm``), reports ``ready`` on a queue,
waits for the shared ``go`` event, runs, and puts one result dict on the queue.
"""

from __future__ import annotations

import asyncio
import resource
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

TOPIC_LEN = 23
PAYLOAD_LEN = 64
PAD = b"\xa5" * 48


def topic_for(prefix: str, n: int) -> bytes:
    t = f"{prefix}/{n:05d}/telemetry".encode()
    assert len(t) == TOPIC_LEN, t
    return t


def publish_dtype(qos: int) -> np.dtype:
    fields: list[tuple[str, str]] = [
        ("h", "u1"),
        ("rl", "u1"),
        ("tl", ">u2"),
        ("topic", f"S{TOPIC_LEN}"),
    ]
    if qos:
        fields.append(("pid", ">u2"))
    fields += [("pub", "<u4"), ("seq", "<u4"), ("ts", "<u8"), ("pad", "S48")]
    return np.dtype(fields)


PUBACK_DT = np.dtype([("h", "u1"), ("rl", "u1"), ("pid", ">u2")])


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _str(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack(">H", len(b)) + b


#: The user name every connection gives: amqtt keeps no offline messages for anonymous
#: sessions (the replay scenario's persistent session), and the brokers under test accept
#: any user name without a password.
USER = "bench"


def connect_packet(
    client_id: str,
    clean: bool = True,
    keepalive: int = 0,
    username: str | None = None,
    will: tuple[str, bytes] | None = None,
) -> bytes:
    """A 3.1.1 CONNECT; ``will``: its topic and message, published at QoS 1, not retained
    (s3.1.2.5-3.1.2.7)."""
    flags = (0x02 if clean else 0x00) | (0x80 if username is not None else 0x00)
    if will is not None:
        flags |= 0x04 | (1 << 3)  # the will flag, will QoS 1
    body = _str("MQTT") + bytes([4, flags]) + struct.pack(">H", keepalive)
    body += _str(client_id)
    if will is not None:
        body += _str(will[0]) + struct.pack(">H", len(will[1])) + will[1]
    if username is not None:
        body += _str(username)
    return b"\x10" + varint(len(body)) + body


def subscribe_packet(topic_filter: str, qos: int, pid: int = 1) -> bytes:
    body = struct.pack(">H", pid) + _str(topic_filter) + bytes([qos])
    return b"\x82" + varint(len(body)) + body


DISCONNECT = b"\xe0\x00"


def raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


@dataclass
class Check:
    """Per-publisher sequence check over the deliveries of one subscriber connection."""

    n_pubs: int
    received: int = 0
    gaps: int = 0
    dup_reorder: int = 0
    other: int = 0
    last_ns: int = 0
    lat: list[np.ndarray] = field(default_factory=list)
    last: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.last = np.full(self.n_pubs, -1, dtype=np.int64)

    def feed(self, pub: np.ndarray, seq: np.ndarray) -> None:
        k = len(pub)
        self.received += k
        p = pub.astype(np.int64)
        s = seq.astype(np.int64)
        if k > 1 and (p[1:] != p[:-1]).any():
            order = np.argsort(p, kind="stable")
            p = p[order]
            s = s[order]
        first = np.ones(k, dtype=bool)
        first[1:] = p[1:] != p[:-1]
        prev = np.empty(k, dtype=np.int64)
        prev[1:] = s[:-1]
        prev[first] = self.last[p[first]]
        d = s - prev
        bad = d != 1
        if bad.any():
            self.dup_reorder += int((d <= 0).sum())
            big = d[d > 1]
            self.gaps += int((big - 1).sum())
        lastmask = np.ones(k, dtype=bool)
        lastmask[:-1] = first[1:]
        self.last[p[lastmask]] = s[lastmask]


class Conn(asyncio.Protocol):
    """One MQTT 3.1.1 client connection. ``fast_dt`` is the shape of the packets it expects
    in bulk (deliveries for a subscriber, PUBACKs for a publisher)."""

    def __init__(
        self,
        client_id: str,
        *,
        clean: bool = True,
        sub: str | None = None,
        sub_qos: int = 0,
        fast_dt: np.dtype = PUBACK_DT,
        fast_h: int = 0x40,
        check: Check | None = None,
        track_lat_from: list[int] | None = None,
    ) -> None:
        self.client_id = client_id
        self.clean = clean
        self.sub = sub
        self.sub_qos = sub_qos
        self.dt = fast_dt
        self.L = fast_dt.itemsize
        self.H = fast_h
        self.RL = self.L - 2
        self.check = check
        self.track_lat_from = track_lat_from
        self.rest = b""
        loop = asyncio.get_running_loop()
        self.ready: asyncio.Future[None] = loop.create_future()
        self.transport: asyncio.Transport | None = None
        self.acked = 0
        self.errors = 0
        self.paused = False
        self.resumed: asyncio.Future[None] | None = None
        self.on_acks: Any = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        out = connect_packet(self.client_id, self.clean, username=USER)
        if self.sub is not None:
            out += subscribe_packet(self.sub, self.sub_qos)
        self.transport.write(out)  # type: ignore[union-attr]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.ready.done():
            self.ready.set_exception(ConnectionError(f"{self.client_id}: closed"))

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        if self.resumed is not None and not self.resumed.done():
            self.resumed.set_result(None)

    def data_received(self, data: bytes) -> None:
        buf = self.rest + data if self.rest else data
        pos = 0
        end = len(buf)
        L = self.L
        while pos < end:
            n = (end - pos) // L
            if n:
                arr = np.frombuffer(buf, self.dt, count=n, offset=pos)
                ok = (arr["h"] == self.H) & (arr["rl"] == self.RL)
                k = n if ok.all() else int(np.argmin(ok))
                if k:
                    self._bulk(arr[:k])
                    pos += k * L
                    if k == n and pos >= end:
                        break
            adv = self._other(buf, pos)
            if not adv:
                break
            pos += adv
        self.rest = buf[pos:]

    def _bulk(self, arr: np.ndarray) -> None:
        if self.check is None:  # publisher: PUBACKs
            self.acked += len(arr)
            if self.on_acks is not None:
                self.on_acks(len(arr))
            return
        if self.H & 0x06:  # QoS 1 deliveries: acknowledge them all in one write
            acks = np.empty(len(arr), PUBACK_DT)
            acks["h"] = 0x40
            acks["rl"] = 2
            acks["pid"] = arr["pid"]
            assert self.transport is not None
            self.transport.write(acks.tobytes())
        now = time.monotonic_ns()
        self.check.feed(arr["pub"], arr["seq"])
        self.check.last_ns = now
        if self.track_lat_from is not None:
            ts = arr["ts"].astype(np.int64)
            ts = ts[ts >= self.track_lat_from[0]]
            if len(ts):
                self.check.lat.append(now - ts)

    def _other(self, buf: bytes, pos: int) -> int:
        """Parse one packet of any kind at ``pos``; bytes consumed, 0 if incomplete."""
        end = len(buf)
        i = pos + 1
        rl = 0
        mult = 1
        while True:
            if i >= end:
                return 0
            b = buf[i]
            rl += (b & 0x7F) * mult
            mult <<= 7
            i += 1
            if not b & 0x80:
                break
        total = i - pos + rl
        if pos + total > end:
            return 0
        kind = buf[pos] >> 4
        if kind == 2:  # CONNACK
            if buf[pos + 3] != 0:
                self.errors += 1
                if not self.ready.done():
                    self.ready.set_exception(ConnectionError(f"CONNACK {buf[pos + 3]}"))
            elif self.sub is None and not self.ready.done():
                self.ready.set_result(None)
        elif kind == 9:  # SUBACK
            if buf[i + 2] & 0x80:
                self.errors += 1
            if not self.ready.done():
                self.ready.set_result(None)
        elif kind == 4:
            self.acked += 1
            if self.on_acks is not None:
                self.on_acks(1)
        elif kind == 3:  # a PUBLISH of another shape: decode it the slow way
            qos = (buf[pos] >> 1) & 3
            tl = struct.unpack_from(">H", buf, i)[0]
            j = i + 2 + tl
            if qos:
                assert self.transport is not None
                self.transport.write(b"\x40\x02" + buf[j : j + 2])
                j += 2
            if self.check is not None:
                if pos + total - j >= 16:
                    pub, seq = struct.unpack_from("<II", buf, j)
                    self.check.feed(np.array([pub]), np.array([seq]))
                    self.check.last_ns = time.monotonic_ns()
                else:
                    self.check.other += 1
        elif kind != 13:  # anything but PINGRESP is unexpected
            self.errors += 1
        return total


class Publisher:
    """Pre-encoded PUBLISH packets for one publisher index; sequence numbers from 0."""

    def __init__(
        self, conn: Conn, index: int, prefix: str, topic_n: int, qos: int, batch: int
    ) -> None:
        self.conn = conn
        self.index = index
        self.qos = qos
        self.dt = publish_dtype(qos)
        self.tmpl = np.zeros(batch, self.dt)
        self.tmpl["h"] = 0x30 | (qos << 1)
        self.tmpl["rl"] = self.dt.itemsize - 2
        self.tmpl["tl"] = TOPIC_LEN
        self.tmpl["topic"] = topic_for(prefix, topic_n)
        self.tmpl["pub"] = index
        self.tmpl["pad"] = PAD
        self.sent = 0
        self.target = 0
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def send(self, k: int) -> None:
        """Send the next ``k`` messages in one write."""
        while k > 0:
            m = min(k, len(self.tmpl))
            t = self.tmpl[:m]
            seq = np.arange(self.sent, self.sent + m, dtype=np.int64)
            t["seq"] = seq
            t["ts"] = time.monotonic_ns()
            if self.qos:
                t["pid"] = seq % 65535 + 1
            assert self.conn.transport is not None
            self.conn.transport.write(t.tobytes())
            self.sent += m
            k -= m

    # -- window mode (QoS 1): keep ``window`` unacknowledged
    def start_window(self, total: int, window: int) -> None:
        self.target = total
        self.conn.on_acks = self._acked
        self.send(min(window, total))

    def _acked(self, k: int) -> None:
        left = self.target - self.sent
        if left > 0:
            self.send(min(k, left))
        if self.conn.acked >= self.target and not self.done.done():
            self.done.set_result(None)

    # -- blast mode (QoS 0): as fast as the socket takes it
    async def blast(self, total: int, batch: int) -> None:
        conn = self.conn
        while self.sent < total:
            if conn.paused:
                conn.resumed = asyncio.get_running_loop().create_future()
                await conn.resumed
            self.send(min(batch, total - self.sent))
            await asyncio.sleep(0)


async def open_conns(port: int, make: Any, count: int, concurrency: int = 200) -> list[Conn]:
    """Open ``count`` connections (``make(i)`` builds the protocol), each up to CONNACK (and
    SUBACK), at most ``concurrency`` in progress."""
    loop = asyncio.get_running_loop()
    sem = asyncio.Semaphore(concurrency)
    conns: list[Conn] = [None] * count  # type: ignore[list-item]

    async def one(i: int) -> None:
        async with sem:
            for attempt in range(5):
                try:
                    _, proto = await loop.create_connection(lambda: make(i), "127.0.0.1", port)
                    conns[i] = proto
                    await asyncio.wait_for(proto.ready, 30)
                    return
                except (ConnectionError, OSError):
                    if attempt == 4:
                        raise
                    await asyncio.sleep(0.05 * (attempt + 1))

    await asyncio.gather(*(one(i) for i in range(count)))
    return conns


def _cpu() -> float:
    return time.process_time()


# ============================================================== roles


async def _sub_role(spec: dict[str, Any], ctl: Any) -> dict[str, Any]:
    qos = spec["qos"]
    dt = publish_dtype(qos)
    lat_from = [1 << 62]
    checks: list[Check] = []

    def make(i: int) -> Conn:
        check = Check(spec["n_pubs"])
        checks.append(check)
        return Conn(
            f"{spec['id']}-{i}",
            clean=spec.get("clean", True),
            sub=spec["filter"],
            sub_qos=spec["sub_qos"],
            fast_dt=dt,
            fast_h=0x30 | (qos << 1),
            check=check,
            track_lat_from=lat_from if spec.get("latency") else None,
        )

    if spec.get("connect_on_go"):
        ctl.ready_q.put(("ready", spec["id"]))
        ctl.go.wait()
        cpu0 = _cpu()
        conns = await open_conns(spec["port"], make, spec["count"])
    else:
        conns = await open_conns(spec["port"], make, spec["count"])
        ctl.ready_q.put(("ready", spec["id"]))
        ctl.go.wait()
        cpu0 = _cpu()
    lat_from[0] = ctl.go_ns.value + int(spec.get("warmup", 0) * 1e9)
    idle_timeout = spec.get("idle_timeout", 10.0)
    last_total = -1
    last_change = time.monotonic()
    while True:
        await asyncio.sleep(0.01)
        total = sum(c.received for c in checks)
        expected = ctl.expected.value
        if expected and all(c.received >= expected for c in checks):
            break
        now = time.monotonic()
        if total != last_total:
            last_total, last_change = total, now
        elif ctl.stop.is_set() and now - last_change > idle_timeout:
            break
    cpu = _cpu() - cpu0
    lat = (
        np.concatenate([a for c in checks for a in c.lat])
        if spec.get("latency") and any(c.lat for c in checks)
        else np.zeros(0, dtype=np.int64)
    )
    closed = sum(c.closed for c in conns)
    for c in conns:
        if c.transport is not None:
            c.transport.write(DISCONNECT)
            c.transport.close()
    await asyncio.sleep(0.05)
    return {
        "role": "sub",
        "closed": closed,
        "received": sum(c.received for c in checks),
        "per_sub_min": min(c.received for c in checks),
        "gaps": sum(c.gaps for c in checks),
        "dup_reorder": sum(c.dup_reorder for c in checks),
        "other": sum(c.other for c in checks),
        "errors": sum(c.errors for c in conns),
        "last_ns": max(c.last_ns for c in checks),
        "cpu": cpu,
        "lat": lat,
    }


async def _pub_role(spec: dict[str, Any], ctl: Any) -> dict[str, Any]:
    qos = spec["qos"]
    first = spec["first"]
    count = spec["count"]
    batch = spec.get("batch", 256)
    commands = spec.get("commands", False)  # each device subscribed to its command topic

    def make(i: int) -> Conn:
        sub = f"cmd/{first + i}" if commands else None
        return Conn(f"{spec['id']}-{first + i}", sub=sub, sub_qos=1)

    conns = await open_conns(spec["port"], make, count)
    pubs = [
        Publisher(c, first + i, spec["prefix"], first + i, qos, batch) for i, c in enumerate(conns)
    ]
    ctl.ready_q.put(("ready", spec["id"]))
    ctl.go.wait()
    cpu0 = _cpu()
    t0 = time.monotonic_ns()
    mode = spec["mode"]
    if mode == "window":
        for p in pubs:
            p.start_window(spec["n"], spec["window"])
        await asyncio.gather(*(p.done for p in pubs))
    elif mode == "blast":
        await asyncio.gather(*(p.blast(spec["n"], batch) for p in pubs))
    elif mode == "paced":
        # Message j goes to publisher j % len(pubs), each in its own write (as devices do);
        # with 5,000 publishers at 5,000 msg/s each sends one message per second.
        rate = spec["rate"]
        total = int(rate * spec["duration"])
        sent = 0
        npub = len(pubs)
        start = time.monotonic()
        while sent < total:
            await asyncio.sleep(0.001)
            due = min(total, int((time.monotonic() - start) * rate))
            while sent < due:
                pubs[sent % npub].send(1)
                sent += 1
        if qos:
            deadline = time.monotonic() + 10
            while sum(p.conn.acked for p in pubs) < total and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
    t1 = time.monotonic_ns()
    if mode == "blast":
        await asyncio.sleep(0)  # let the last writes leave before the (blocking) stop wait
    cpu = _cpu() - cpu0
    result = {
        "role": "pub",
        "sent": sum(p.sent for p in pubs),
        "acked": sum(p.conn.acked for p in pubs),
        "t0": t0,
        "t1": t1,
        "cpu": cpu,
        "errors": sum(c.errors for c in conns),
    }
    ctl.result_q.put(result)
    # Stay connected until the subscribers are done (a QoS 0 publisher's close could
    # otherwise race its last bytes); the orchestrator sets ``stop`` then ``release``.
    while not ctl.release.is_set():
        await asyncio.sleep(0.02)
    for c in conns:
        if c.transport is not None:
            c.transport.write(DISCONNECT)
            c.transport.close()
    await asyncio.sleep(0.05)
    return {}


async def _storm_role(spec: dict[str, Any], ctl: Any) -> dict[str, Any]:
    ctl.ready_q.put(("ready", spec["id"]))
    ctl.go.wait()
    cpu0 = _cpu()
    t0 = time.monotonic_ns()
    conns = await open_conns(
        spec["port"],
        lambda i: Conn(f"{spec['id']}-{i}"),
        spec["count"],
        spec.get("concurrency", 200),
    )
    t1 = time.monotonic_ns()
    cpu = _cpu() - cpu0
    ctl.result_q.put(
        {
            "role": "storm",
            "connected": len(conns),
            "t0": t0,
            "t1": t1,
            "cpu": cpu,
            "errors": sum(c.errors for c in conns),
        }
    )
    while not ctl.release.is_set():
        await asyncio.sleep(0.05)
    for c in conns:
        if c.transport is not None:
            c.transport.write(DISCONNECT)
            c.transport.close()
    await asyncio.sleep(0.2)
    return {}


def worker(spec: dict[str, Any], ctl: Any) -> None:
    """Process entry point: run one role; results go to ``ctl.result_q``."""
    import uvloop

    raise_nofile()
    role = spec["role"]
    fn = {"sub": _sub_role, "pub": _pub_role, "storm": _storm_role}[role]
    try:
        result = uvloop.run(fn(spec, ctl))
    except BaseException as e:
        ctl.result_q.put({"role": role, "error": f"{type(e).__name__}: {e}"})
        ctl.ready_q.put(("error", f"{spec['id']}: {type(e).__name__}: {e}"))
        raise
    if result:
        ctl.result_q.put(result)
