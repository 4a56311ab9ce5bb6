# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, auto_pickle=False
"""The device path compiled (issue 23, item 1): :class:`DeviceLane` does in C what
``MQTTProtocol._plain_publish`` and ``MQTTProtocol._plain_acked`` (broker.net.transport,
the pure-Python reference) do for a read that is one plain QoS 0/1 PUBLISH to the
connection's plain topic, byte for byte the same (tests/unit/net/test_device_path.py runs
every equivalence test on both). It also takes a read of several (a publisher's burst,
cut anywhere by the socket: the start of a packet at its end waits in the decoder, and is
taken back with the next read), which the Python device path leaves to the decoder and
``Router.publish_run``: the same records and acknowledgements, without a ``Publish`` per
packet (a QoS 0 fan-in's reads of hundreds of PUBLISHes each went through the decoder at
about 27,000 instructions per message, 9,000 in the lane, bench/instr_bench.py fanin0).

Per message, what was about ten Python calls and several objects (the connection's
recognition, a ``partial`` for the ack, the router's ``publish_plain``, the partition's
``add`` and ``next_offset``, ``flush_soon``; at the commit ``_plain_acked``, ``puback``,
the PUBACK's encoding) is one call into C, one Record tuple, and one small ack object
called from the partition's commit. The commit, the PUBACKs' write and the subscribers'
delivery run per batch, in Python, unchanged.

The lane gathers into a :class:`~broker.router.partition.Partition` (this worker's) and into
a partition with PartitionBase's ``add`` (another worker's: the batch is forwarded, the owner
numbers it); a type with its own ``add`` or ``next_offset`` (a replicated partition) gets the
record through ``Router.publish_plain`` as on the Python path, with the same compiled ack.

Loaded by :mod:`broker.net.devicepath`; built by ``pip install -e .`` (setup.py). Called
only from the owning event loop's thread.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.dict cimport PyDict_GetItem, PyDict_GetItemWithError
from cpython.list cimport PyList_Append, PyList_GET_SIZE
from cpython.object cimport PyObject
from cpython.ref cimport Py_INCREF
from cpython.set cimport PySet_Add, PySet_Contains, PySet_Discard, PySet_GET_SIZE
from cpython.tuple cimport PyTuple_SET_ITEM
from libc.string cimport memcmp
from posix.time cimport CLOCK_MONOTONIC, CLOCK_REALTIME, clock_gettime, timespec

cimport cython

import time

from broker.commitlog import Record
from broker.router.partition import Partition, PartitionBase


cdef extern from "Python.h":
    # A Record (a tuple subclass) of n items, all NULL until set; a new reference.
    object PyType_GenericAlloc(type cls, Py_ssize_t n)
    void PyObject_GC_UnTrack(object op)

cdef type _RECORD = Record

#: The 4-byte PUBACK (Success, no properties: the same at every level, s3.4.2.1) of each
#: packet id, made on first use.
cdef list _PUBACKS = [None] * 65536
#: How the lane gathers into a partition, by its type (decided once per type): NUMBERED
#: where ``add`` and ``next_offset`` are Partition's (this worker appends: the offset is the
#: log's end plus what is pending), UNNUMBERED where they are PartitionBase's (another
#: worker's partition, broker.workers.partitions, or a cluster's replicated partition,
#: broker.workers.replicated: offset -1, the owner or the Raft leader numbers them), else
#: through ``Router.publish_plain`` (a type with its own).
cdef dict _INLINE = {}
cdef enum:
    THROUGH_ROUTER = 0
    NUMBERED = 1
    UNNUMBERED = 2
#: What DeviceLane._plain_at finds instead of a plain PUBLISH's end.
cdef enum:
    NOT_PLAIN = -1
    INCOMPLETE = -2
cdef object _EMPTY = b""


cdef inline bytes _puback(int packet_id):
    data = _PUBACKS[packet_id]
    if data is None:
        data = _PUBACKS[packet_id] = bytes((0x40, 2, packet_id >> 8, packet_id & 0xFF))
    return <bytes>data


cdef inline double _seconds(int clock_id):
    """``time.time()`` (CLOCK_REALTIME) or ``time.monotonic()`` (CLOCK_MONOTONIC) without
    the call: the same double, from the same nanoseconds (CPython: ns / 1e9)."""
    cdef timespec ts
    clock_gettime(clock_id, &ts)
    return <double>(<long long>ts.tv_sec * 1000000000 + ts.tv_nsec) / 1e9


cdef inline void _set(object t, Py_ssize_t i, object value):
    Py_INCREF(value)
    PyTuple_SET_ITEM(t, i, value)


cdef object _record(offset, timestamp, topic, payload, qos, client_id):
    """``Record(offset, timestamp, topic, payload, qos, False, client_id, b"")`` in one
    allocation (``tuple.__new__(Record, ...)`` cost a method call and a copy), not tracked
    by the garbage collector: it holds ints, strs and bytes only, so it is in no cycle. The
    collector untracks such a plain tuple itself, never an instance of a tuple subclass, so
    the collections a fan-in's allocations set off traversed every record in the partitions'
    tails (5% of a QoS 0 fan-in's instructions, bench/instr_bench.py)."""
    record = PyType_GenericAlloc(_RECORD, 8)
    PyObject_GC_UnTrack(record)
    _set(record, 0, offset)
    _set(record, 1, timestamp)
    _set(record, 2, topic)
    _set(record, 3, payload)
    _set(record, 4, qos)
    _set(record, 5, False)
    _set(record, 6, client_id)
    _set(record, 7, _EMPTY)
    return record


cdef int _gathering(type cls):
    known = PyDict_GetItem(_INLINE, cls)
    if known is not NULL:
        return <int><object>known
    add, next_offset = getattr(cls, "add", None), getattr(cls, "next_offset", None)
    how = THROUGH_ROUTER
    if add is Partition.add and next_offset is Partition.next_offset:
        how = NUMBERED
    elif add is PartitionBase.add and next_offset is PartitionBase.next_offset:
        how = UNNUMBERED
    _INLINE[cls] = how
    return how


@cython.final
cdef class DeviceLane:
    """One connection's device path while it has a plain topic (``expect_plain``): what
    the recognition needs of its ServerConnection, and where the records go."""

    cdef readonly object proto
    cdef object decoder
    cdef bytes field
    cdef Py_ssize_t max_packet_size
    cdef int version
    cdef int receive_maximum
    cdef set unacked
    cdef object topic
    cdef object client_id
    cdef readonly object key
    cdef type inline_type
    cdef int inline_how
    cdef list messages_in
    cdef object metrics
    cdef object monotonic
    # The clocks are time.time and time.monotonic (read in C), not injected ones (tests).
    cdef bint c_clock
    cdef bint c_monotonic
    cdef object router
    cdef dict partitions
    cdef dict dirty
    cdef object flush_soon
    cdef object clock
    cdef object edge

    def __init__(self, proto, key):
        conn = proto.conn
        router = proto.router
        self.proto = proto
        self.decoder = conn._decoder
        self.field = conn._plain_field
        self.max_packet_size = conn._max_packet_size
        self.version = conn.version or 0
        self.receive_maximum = conn.receive_maximum
        self.unacked = conn.inbound_unacked
        self.topic = conn.plain_topic
        self.client_id = proto.client_id
        self.key = key
        self.inline_type = None
        self.inline_how = THROUGH_ROUTER
        self.messages_in = proto.metrics.messages_in
        self.metrics = proto.metrics
        self.monotonic = proto.edge.monotonic
        self.c_monotonic = self.monotonic is time.monotonic
        self.router = router
        self.partitions = router.partitions
        self.dirty = router.dirty
        self.flush_soon = router.flush_soon
        self.clock = router.clock
        self.c_clock = self.clock is time.time
        self.edge = proto.edge

    cpdef bint receive(self, bytes data) except -1:
        """``MQTTProtocol.data_received`` for a read of plain PUBLISHes to the lane's topic
        (the rules of ``ServerConnection.plain_publish``, packet by packet), with what the
        decoder buffered before it (the start of the first) and the start of one more after
        them (buffered for the next read): stamped, counted and gathered, as the full path
        (the decoder, then ``Router.publish_run``) gathers them. False, with nothing
        changed, leaves ``data`` to ``data_received``: a closing connection, an admission
        pending, or a read with any other packet in it (so a packet the decoder refuses
        takes the decoder's road with the whole read, as without the lane)."""
        proto = self.proto
        if proto._closing or proto._admission is not None:
            return False
        decoder = self.decoder
        cdef bytes head = None
        cdef bytes read = data
        if decoder._pending or decoder._pos < len(decoder._buf):
            # A packet's start came at the end of the last read (a publisher's stream cut
            # by the socket): parsed here with its rest.
            head = decoder.take()
            read = head + data
        cdef Py_ssize_t count = self._plain_run(read)
        if count <= 0:
            if head is not None:
                decoder.feed(head)  # as it was
            return False
        # Recognised: what data_received does first for every read.
        proto.last_received = (
            _seconds(CLOCK_MONOTONIC) if self.c_monotonic else self.monotonic()
        )
        self.metrics.bytes_in += PyBytes_GET_SIZE(data)
        if self.c_clock:  # int(time.time() * 1000), as the Python path computes it
            timestamp = <long long>(_seconds(CLOCK_REALTIME) * 1000)
        else:
            timestamp = int(self.clock() * 1000)
        cdef Py_ssize_t done = self._gather(read, count, timestamp)
        if done < PyBytes_GET_SIZE(read):
            decoder.feed(read[done:])  # the next packet's start: the next read completes it
        return True

    cdef Py_ssize_t _plain_run(self, bytes read) except -2:
        """How many plain PUBLISHes ``read`` starts with when nothing but the start of one
        more follows them (its fixed header one the decoder would wait on); 0 otherwise.
        5.0: their QoS 1 ids are counted against our Receive Maximum as the decoder's path
        counts them (s4.9), all of them or none."""
        cdef const unsigned char* p = <const unsigned char*>PyBytes_AS_STRING(read)
        cdef Py_ssize_t n = PyBytes_GET_SIZE(read)
        cdef Py_ssize_t pos = 0, end, payload, count = 0
        cdef int packet_id
        cdef list counted = None
        while pos < n:
            end = self._plain_at(p, pos, n, &payload, &packet_id)
            if end == INCOMPLETE:
                break
            if end == NOT_PLAIN:
                count = 0
                break
            if packet_id and self.version == 5:
                if (
                    PySet_Contains(self.unacked, packet_id)
                    or PySet_GET_SIZE(self.unacked) >= self.receive_maximum
                ):
                    count = 0  # the decoder's path refuses it [MQTT-3.3.4-7]
                    break
                PySet_Add(self.unacked, packet_id)
                if counted is None:
                    counted = []
                PyList_Append(counted, packet_id)
            count += 1
            pos = end
        if not count and counted is not None:
            for packet_id in counted:
                PySet_Discard(self.unacked, packet_id)
        return count

    cdef Py_ssize_t _plain_at(
        self, const unsigned char* p, Py_ssize_t pos, Py_ssize_t n,
        Py_ssize_t* payload, int* packet_id,
    ):
        """The end of the plain PUBLISH at ``pos`` (its payload's start in ``payload``, its
        packet id in ``packet_id``, 0 at QoS 0); INCOMPLETE where ``p[pos:n]`` is the start
        of a QoS 0/1 PUBLISH without DUP or retain whose size the decoder accepts (it waits
        for the rest); NOT_PLAIN for anything else."""
        cdef Py_ssize_t length, body, end, flen
        cdef int first
        first = p[pos]
        if first != 0x32 and first != 0x30:  # QoS 1 or 0; no DUP, no retain (s3.3.1)
            return NOT_PLAIN
        if n - pos < 2:
            return INCOMPLETE
        length = p[pos + 1]
        body = pos + 2
        if length & 0x80:  # a second byte of remaining length (up to 16,383 bytes)
            if n - pos < 3:
                return INCOMPLETE
            if p[pos + 2] & 0x80:
                return NOT_PLAIN
            length = (length & 0x7F) | (p[pos + 2] << 7)
            body = pos + 3
        end = body + length
        if end - pos > self.max_packet_size:
            return NOT_PLAIN  # the decoder refuses it, complete or not
        if end > n:
            return INCOMPLETE
        field = self.field
        flen = PyBytes_GET_SIZE(field)
        if not flen or body + flen > end:
            return NOT_PLAIN
        if memcmp(p + body, PyBytes_AS_STRING(field), flen) != 0:
            return NOT_PLAIN
        body += flen
        packet_id[0] = 0
        if first == 0x32:
            if body + 2 > end:
                return NOT_PLAIN
            packet_id[0] = (p[body] << 8) | p[body + 1]
            body += 2
            if not packet_id[0]:
                return NOT_PLAIN  # the decoder refuses it [MQTT-2.2.1-3]
        if self.version == 5:
            if body >= end or p[body]:
                return NOT_PLAIN  # properties: the decoder's
            body += 1
        payload[0] = body
        return end

    cdef Py_ssize_t _gather(self, bytes read, Py_ssize_t count, timestamp) except -1:
        """Gather the first ``count`` packets of ``read`` (plain PUBLISHes, _plain_run)
        stamped ``timestamp``; returns where they end."""
        cdef const unsigned char* p = <const unsigned char*>PyBytes_AS_STRING(read)
        cdef Py_ssize_t n = PyBytes_GET_SIZE(read)
        cdef Py_ssize_t pos = 0, end, start, i, base = 0
        cdef Py_ssize_t counts[2]
        cdef int packet_id
        cdef bint inline
        counts[0] = counts[1] = 0
        key = self.key
        found = PyDict_GetItemWithError(self.partitions, key)
        inline = found is not NULL and (
            type(<object>found) is self.inline_type or self._inline(<object>found)
        )
        if inline:
            part = <object>found
            pending = part.pending
            acks = part.acks
            if self.inline_how == NUMBERED:
                base = part.end + PyList_GET_SIZE(pending)
        for i in range(count):
            end = self._plain_at(p, pos, n, &start, &packet_id)
            pos = end
            payload = PyBytes_FromStringAndSize(<const char*>p + start, end - start)
            ack = None
            if packet_id:
                ack = DeviceAck.__new__(DeviceAck)
                (<DeviceAck>ack).lane = self
                (<DeviceAck>ack).packet_id = packet_id
                counts[1] += 1
                qos = 1
            else:
                counts[0] += 1
                qos = 0
            if not inline:
                self.router.publish_plain(
                    self.client_id, self.topic, key, payload, qos, timestamp, ack
                )
                continue
            offset = base + i if self.inline_how == NUMBERED else -1
            PyList_Append(
                pending, _record(offset, timestamp, self.topic, payload, qos, self.client_id)
            )
            PyList_Append(acks, ack)
        messages_in = self.messages_in
        if counts[0]:
            messages_in[0] += counts[0]
        if counts[1]:
            messages_in[1] += counts[1]
        if inline:
            found = PyDict_GetItemWithError(self.dirty, key)
            if found is NULL or <object>found is not part:
                self.dirty[key] = part
                self.flush_soon()
        return pos

    cdef bint _inline(self, object part) except -1:
        """Whether records for ``part`` are gathered here (remembered for its type)."""
        how = _gathering(type(part))
        if how == THROUGH_ROUTER:
            return False
        self.inline_type = type(part)
        self.inline_how = how
        return True


@cython.final
@cython.freelist(64)
@cython.no_gc
cdef class DeviceAck:
    """The acknowledgement of one device-path QoS 1 PUBLISH, called by the partition's
    commit with the record's offset (the AckCallback contract, broker.router.commit):
    its PUBACK only after the append [MQTT-4.3.2-2]. Not tracked by the garbage collector
    (one per message; it refers to its lane, and nothing that the lane reaches refers to
    it: no cycle)."""

    cdef DeviceLane lane
    cdef int packet_id

    def __call__(self, offset):
        proto = self.lane.proto
        if proto._closing:
            return
        if offset is None or offset < 0:
            # A failed append or an unknown outcome: the Python path's answer (rare).
            proto._plain_acked(self.packet_id, offset)
            return
        lane = self.lane
        if lane.version == 5:
            PySet_Discard(lane.unacked, self.packet_id)  # its quota comes back (s4.9)
        data = _puback(self.packet_id)
        out = proto._out
        if out is None:
            proto._out = [data]
            lane.edge.want_flush(proto)
        else:
            PyList_Append(out, data)
        proto._out_bytes += 4
