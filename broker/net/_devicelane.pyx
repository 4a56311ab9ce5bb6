# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, auto_pickle=False
"""The device path compiled (issue 23, item 1): :class:`DeviceLane` does in C what
``MQTTProtocol._plain_publish`` and ``MQTTProtocol._plain_acked`` (broker.net.transport,
the pure-Python reference) do for a read that is one plain QoS 0/1 PUBLISH to the
connection's plain topic, byte for byte the same (tests/unit/net/test_device_path.py runs
every equivalence test on both).

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

cdef type _RECORD = Record

#: The 4-byte PUBACK (Success, no properties: the same at every level, s3.4.2.1) of each
#: packet id, made on first use.
cdef list _PUBACKS = [None] * 65536
#: How the lane gathers into a partition, by its type (decided once per type): NUMBERED
#: where ``add`` and ``next_offset`` are Partition's (this worker appends: the offset is the
#: log's end plus what is pending), UNNUMBERED where they are PartitionBase's (another
#: worker's partition, broker.workers.partitions: offset -1, the owner numbers them),
#: else through ``Router.publish_plain`` (a type with its own: a replicated partition).
cdef dict _INLINE = {}
cdef enum:
    THROUGH_ROUTER = 0
    NUMBERED = 1
    UNNUMBERED = 2
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
    allocation (``tuple.__new__(Record, ...)`` cost a method call and a copy)."""
    record = PyType_GenericAlloc(_RECORD, 8)
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
        """``MQTTProtocol.data_received`` for a read that is one plain PUBLISH to the lane's
        topic (the rules of ``ServerConnection.plain_publish``): stamped, counted and
        gathered. False, with nothing changed, leaves ``data`` to ``data_received``
        (a closing connection, an admission pending, any other read)."""
        proto = self.proto
        if proto._closing or proto._admission is not None:
            return False
        cdef const unsigned char* p = <const unsigned char*>PyBytes_AS_STRING(data)
        cdef Py_ssize_t n = PyBytes_GET_SIZE(data)
        cdef Py_ssize_t length, pos, flen
        cdef int first, qos, packet_id = 0
        if n < 2:
            return False
        first = p[0]
        if first != 0x32 and first != 0x30:  # QoS 1 or 0; no DUP, no retain (s3.3.1)
            return False
        length = p[1]
        pos = 2
        if length & 0x80:  # a second byte of remaining length (up to 16,383 bytes)
            if n < 3 or p[2] & 0x80:
                return False
            length = (length & 0x7F) | (p[2] << 7)
            pos = 3
        field = self.field
        flen = PyBytes_GET_SIZE(field)
        if pos + length != n or n > self.max_packet_size or not flen or pos + flen > n:
            return False
        if memcmp(p + pos, PyBytes_AS_STRING(field), flen) != 0:
            return False
        decoder = self.decoder
        if decoder._pending or decoder._pos < len(decoder._buf):
            return False  # part of a packet before it: the decoder's
        pos += flen
        if first == 0x32:
            if pos + 2 > n:
                return False
            packet_id = (p[pos] << 8) | p[pos + 1]
            pos += 2
            if not packet_id:
                return False  # the decoder refuses it [MQTT-2.2.1-3]
        if self.version == 5:
            if pos >= n or p[pos]:
                return False  # properties: the decoder's
            pos += 1
            if packet_id:
                # s4.9: the client's quota (our Receive Maximum), as the connection keeps it.
                if (
                    PySet_Contains(self.unacked, packet_id)
                    or PySet_GET_SIZE(self.unacked) >= self.receive_maximum
                ):
                    return False
                PySet_Add(self.unacked, packet_id)
        # Recognised: what data_received does first for every read.
        proto.last_received = (
            _seconds(CLOCK_MONOTONIC) if self.c_monotonic else self.monotonic()
        )
        self.metrics.bytes_in += n
        qos = first >> 1 & 1
        messages_in = self.messages_in
        messages_in[qos] += 1
        payload = PyBytes_FromStringAndSize(<const char*>p + pos, n - pos)
        if self.c_clock:  # int(time.time() * 1000), as the Python path computes it
            timestamp = <long long>(_seconds(CLOCK_REALTIME) * 1000)
        else:
            timestamp = int(self.clock() * 1000)
        ack = None
        if packet_id:
            ack = DeviceAck.__new__(DeviceAck)
            (<DeviceAck>ack).lane = self
            (<DeviceAck>ack).packet_id = packet_id
        key = self.key
        found = PyDict_GetItemWithError(self.partitions, key)
        if found is NULL or (
            type(<object>found) is not self.inline_type and not self._inline(<object>found)
        ):
            self.router.publish_plain(
                self.client_id, self.topic, key, payload, qos, timestamp, ack
            )
            return True
        part = <object>found
        pending = part.pending
        if self.inline_how == NUMBERED:
            offset = part.end + PyList_GET_SIZE(pending)
        else:
            offset = -1
        PyList_Append(
            pending, _record(offset, timestamp, self.topic, payload, qos, self.client_id)
        )
        PyList_Append(part.acks, ack)
        found = PyDict_GetItemWithError(self.dirty, key)
        if found is NULL or <object>found is not part:
            self.dirty[key] = part
            self.flush_soon()
        return True

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
