# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, auto_pickle=False
"""The small batch compiled (issue 23, item 2: a forward between workers costs per batch):
:func:`encode_small` writes the bytes of
:func:`broker.commitlog.small_batch.encode_small_python` (the pure-Python form, itself held to
:func:`~broker.commitlog.batch.encode_batch`), :func:`encode_records` those of ``encode_batch``
for a batch of any size (a fan-in's iteration appends thousands of records per partition:
~180 ns per record in Python, ~45 ns here), :func:`rebased` moves a batch to another base
offset (CRC computed again), and
:func:`decode_records` makes the records :func:`~broker.commitlog.batch.decode_batch` makes,
each in one call from Python: a fleet's batch of one to three records cost ~10 us to encode
and ~15 us to decode in Python, mostly per-call setup (issue 23's timing), where the marshalled
rows a forward carried before cost ~7 us both ways. tests/unit/commitlog/test_smallbatch.py
compares them with the pure-Python forms on random batches.

What either cannot take (a field of another type than the format's usual one, a value that
does not fit, a control batch, a batch with gaps) it answers with None and the caller takes
the pure-Python form, which encodes it or raises the error the format calls for. The layout
is :mod:`broker.commitlog.batch`'s (little-endian, 48-byte header, string table, columns).

The CRCs are :mod:`broker.commitlog._crc`'s (libdeflate's when it loads: a fleet's one-record
batch encoded in 230 ns, against 420 ns with zlib's). Loaded by
:mod:`broker.commitlog.small_batch` when built (setup.py); without it the pure-Python forms
serve. Pure functions; thread-safe under the GIL.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.long cimport PyLong_AsLong, PyLong_AsLongLong, PyLong_FromLongLong
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.object cimport PyObject
from cpython.ref cimport Py_INCREF
from cpython.tuple cimport PyTuple_GET_ITEM, PyTuple_GET_SIZE, PyTuple_SET_ITEM
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.stdint cimport int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memcmp, memcpy

cimport cython

from broker.commitlog._crc cimport batch_crc_of
from broker.commitlog.record import Record


cdef extern from "Python.h":
    object PyType_GenericAlloc(type cls, Py_ssize_t n)
    void PyObject_GC_UnTrack(object op)
    const char* PyUnicode_AsUTF8AndSize(object s, Py_ssize_t* size) except NULL


cdef type _RECORD = Record
cdef object _EMPTY = b""
#: No string at all: what a column's first record is compared with (None is a field's value
#: too, which the table refuses).
cdef object _NO_STRING = object()
#: The format's numbers (broker.commitlog.batch: MAGIC, BATCH_HEADER_SIZE, CRC_OFFSET,
#: RECORD_FIXED_SIZE, CONTROL_FLAG); tests/unit/commitlog/test_smallbatch.py checks them.
cdef enum:
    MAGIC = 1
    HEADER = 48
    CRC_AT = 44
    FIXED = 30
    CONTROL = 1
    #: Records per batch encode_small takes (small_batch.SMALL_BATCH).
    MAX_RECORDS = 8
    #: Strings of a batch's table found by a scan; a table of more is indexed by a dict.
    MAX_SCANNED = 16


cdef inline void _u16(uint8_t* p, uint16_t v) noexcept:
    p[0] = v & 0xFF
    p[1] = v >> 8


cdef inline void _u32(uint8_t* p, uint32_t v) noexcept:
    cdef int i
    for i in range(4):
        p[i] = (v >> (8 * i)) & 0xFF


cdef inline void _u64(uint8_t* p, uint64_t v) noexcept:
    cdef int i
    for i in range(8):
        p[i] = (v >> (8 * i)) & 0xFF


cdef inline uint32_t _get32(const uint8_t* p) noexcept:
    return p[0] | (p[1] << 8) | (p[2] << 16) | (<uint32_t>p[3] << 24)


cdef inline uint64_t _get64(const uint8_t* p) noexcept:
    return _get32(p) | (<uint64_t>_get32(p + 4) << 32)


cdef inline bint _small_int(object value, int* out):
    """``value`` an int (or bool) of 0 .. 255, as struct's ``B`` packs it."""
    if type(value) is not int and type(value) is not bool:
        return False
    cdef long long v = PyLong_AsLongLong(value) if type(value) is int else (1 if value else 0)
    if v < 0 or v > 255:
        return False
    out[0] = <int>v
    return True


def encode_small(long long base_offset, records, long long leader_epoch=0):
    """The batch of ``records`` (a list or tuple of 1 .. 8 :class:`Record` tuples) from
    ``base_offset``, consecutive offsets, as ``bytes``; None: not taken here (module doc)."""
    if len(records) > MAX_RECORDS:
        return None
    return encode_records(base_offset, records, leader_epoch)


def encode_records(long long base_offset, records, long long leader_epoch=0):
    """The batch of ``records`` (a sequence of :class:`Record` tuples, at least one) from
    ``base_offset``, consecutive offsets, as ``bytes``: the bytes of
    :func:`~broker.commitlog.batch.encode_batch`; None: not taken here (module doc)."""
    cdef Py_ssize_t n = len(records)
    if n < 1 or n > 0xFFFFFFFF or leader_epoch < -(1 << 31) or leader_epoch >= (1 << 31):
        return None
    if type(records) is not list and type(records) is not tuple:
        records = list(records)
    cdef _Columns cols = _Columns(n)
    if not cols.gather(records):
        return None
    return cols.encode(base_offset, leader_epoch)


@cython.final
cdef class _Columns:
    """The fixed columns of ``n`` records and their string table, gathered from the records
    (:meth:`gather`), then written as one batch (:meth:`encode`)."""

    cdef Py_ssize_t n
    cdef object records  # keeps each record's objects alive while their pointers are used
    cdef int64_t* stamps
    cdef uint32_t* topic_at
    cdef uint32_t* client_at
    cdef uint8_t* qos
    cdef uint8_t* flags
    cdef Py_ssize_t body  # payload and property bytes
    cdef bint no_props
    # The string table: a few strings are found by a scan, more through a dict.
    cdef Py_ssize_t m, strings
    cdef const char* names[MAX_SCANNED]
    cdef Py_ssize_t sizes[MAX_SCANNED]
    cdef list table  # the strings (str), in table order
    cdef dict index  # str -> its place in table, once there are more than MAX_SCANNED

    def __cinit__(self, Py_ssize_t n):
        self.n = n
        self.table = []
        self.stamps = <int64_t*>PyMem_Malloc(n * (8 + 4 + 4 + 1 + 1))
        if self.stamps is NULL:
            raise MemoryError()
        self.topic_at = <uint32_t*>(self.stamps + n)
        self.client_at = self.topic_at + n
        self.qos = <uint8_t*>(self.client_at + n)
        self.flags = self.qos + n

    def __dealloc__(self):
        PyMem_Free(self.stamps)

    cdef bint gather(self, records) except -1:
        """Read every record's fields; False if one is not the format's usual type or
        does not fit (the Python encoder then encodes it or raises)."""
        cdef Py_ssize_t i, n = self.n
        cdef int q = 0, f = 0
        self.records = records
        self.no_props = True
        for i in range(n):
            record = records[i]
            if not isinstance(record, tuple) or PyTuple_GET_SIZE(record) != 8:
                return False
            stamp = <object>PyTuple_GET_ITEM(record, 1)
            payload = <object>PyTuple_GET_ITEM(record, 3)
            props = <object>PyTuple_GET_ITEM(record, 7)
            if type(stamp) is not int or type(payload) is not bytes or type(props) is not bytes:
                return False
            try:
                # A C long (64 bits here; 32 elsewhere, where a larger stamp is left to the
                # Python encoder): PyLong_AsLongLong converts a two-digit int through a byte
                # array (~200 instructions; a timestamp in ms has two 30-bit digits).
                self.stamps[i] = PyLong_AsLong(stamp)
            except OverflowError:
                return False
            if not _small_int(<object>PyTuple_GET_ITEM(record, 4), &q):
                return False
            if not _small_int(<object>PyTuple_GET_ITEM(record, 5), &f):
                return False
            self.qos[i] = <uint8_t>q
            self.flags[i] = <uint8_t>f
            self.body += PyBytes_GET_SIZE(payload) + PyBytes_GET_SIZE(props)
            if PyBytes_GET_SIZE(props):
                self.no_props = False
        # The string table: topics, then client ids, each once, in order of first appearance.
        return self.index_column(records, 2, self.topic_at) and self.index_column(
            records, 6, self.client_at
        )

    cdef bint index_column(self, records, int field, uint32_t* out) except -1:
        """``out[i]``: the table index of record ``i``'s string ``field`` (2: the topic, 6:
        the client id); False if one is not a string the table takes. A run of one
        publisher's records shares its string objects: looked up once per run."""
        cdef Py_ssize_t i
        cdef object prev = _NO_STRING
        cdef uint32_t at = 0
        cdef long index
        for i in range(self.n):
            value = <object>PyTuple_GET_ITEM(records[i], field)
            if value is not prev:
                index = self.find(value)
                if index < 0:
                    return False
                prev, at = value, <uint32_t>index
            out[i] = at
        return True

    cdef long find(self, value) except -2:
        """The table index of the string ``value`` (added if new); -1: not a str, not
        UTF-8, or longer than the format takes."""
        cdef Py_ssize_t size, j
        cdef const char* name
        if type(value) is not str:
            return -1
        if self.index is not None:
            found = self.index.get(value)
            if found is not None:
                return <long>found
        try:
            name = PyUnicode_AsUTF8AndSize(value, &size)
        except UnicodeError:
            return -1
        if size > 0xFFFF:
            return -1
        if self.index is None:
            for j in range(self.m):
                if self.sizes[j] == size and memcmp(self.names[j], name, size) == 0:
                    return j
            if self.m < MAX_SCANNED:
                self.names[self.m] = name
                self.sizes[self.m] = size
            else:  # one more than a scan is worth: a dict from here on
                self.index = {s: j for j, s in enumerate(self.table)}
        if self.index is not None:
            self.index[value] = self.m
        self.table.append(value)
        self.strings += size
        self.m += 1
        return self.m - 1

    cdef bytes encode(self, long long base_offset, long long leader_epoch):
        """The batch (the fields gathered) from ``base_offset``."""
        cdef Py_ssize_t n = self.n, m = self.m, i, j, size
        cdef Py_ssize_t length = HEADER + 4 + 2 * m + self.strings + n * FIXED + self.body
        cdef const char* name
        cdef int64_t max_ts = self.stamps[0]
        if length > 0xFFFFFFFF:
            return None
        records = self.records
        out = PyBytes_FromStringAndSize(NULL, length)
        cdef uint8_t* buf = <uint8_t*>PyBytes_AS_STRING(out)
        cdef uint8_t* p = buf + HEADER
        _u32(p, <uint32_t>m)
        p += 4
        cdef uint8_t* text = p + 2 * m
        for j in range(m):
            name = PyUnicode_AsUTF8AndSize(self.table[j], &size)  # kept by the str
            _u16(p + 2 * j, <uint16_t>size)
            memcpy(text, name, size)
            text += size
        p = text
        for i in range(n):
            _u64(p + 8 * i, <uint64_t>self.stamps[i])
            if self.stamps[i] > max_ts:
                max_ts = self.stamps[i]
        p += 8 * n
        for i in range(n):
            record = records[i]
            _u32(p + 4 * i, <uint32_t>i)
            _u32(p + 4 * (n + i), self.topic_at[i])
            _u32(p + 4 * (2 * n + i), self.client_at[i])
            _u32(p + 4 * (3 * n + i), <uint32_t>PyBytes_GET_SIZE(<object>PyTuple_GET_ITEM(record, 7)))
            _u32(p + 4 * (4 * n + i), <uint32_t>PyBytes_GET_SIZE(<object>PyTuple_GET_ITEM(record, 3)))
        p += 20 * n
        memcpy(p, self.qos, n)
        memcpy(p + n, self.flags, n)
        p += 2 * n
        if not self.no_props:
            for i in range(n):
                value = <object>PyTuple_GET_ITEM(records[i], 7)
                size = PyBytes_GET_SIZE(value)
                memcpy(p, PyBytes_AS_STRING(value), size)
                p += size
        for i in range(n):
            value = <object>PyTuple_GET_ITEM(records[i], 3)
            size = PyBytes_GET_SIZE(value)
            memcpy(p, PyBytes_AS_STRING(value), size)
            p += size
        _u64(buf, <uint64_t>base_offset)
        _u32(buf + 8, <uint32_t>length)
        buf[12] = MAGIC
        buf[13] = 0
        _u16(buf + 14, 0)
        _u32(buf + 16, <uint32_t><int64_t>leader_epoch)
        _u32(buf + 20, <uint32_t>(n - 1))
        _u32(buf + 24, <uint32_t>n)
        _u64(buf + 28, <uint64_t>self.stamps[0])
        _u64(buf + 36, <uint64_t>max_ts)
        _u32(buf + CRC_AT, _crc(buf, length))
        return out


cdef inline uint32_t _crc(const uint8_t* batch, Py_ssize_t length) noexcept:
    return batch_crc_of(batch, length)


def rebased(batch, long long base_offset):
    """``batch`` (bytes: one whole batch) with its base offset set to ``base_offset`` and its
    CRC computed again: what the log appends of a batch another worker encoded."""
    if type(batch) is not bytes:
        raise TypeError("a batch as bytes")
    cdef Py_ssize_t length = PyBytes_GET_SIZE(batch)
    if length < HEADER or _get32(<const uint8_t*>PyBytes_AS_STRING(batch) + 8) != length:
        raise ValueError("not one whole batch")
    out = PyBytes_FromStringAndSize(PyBytes_AS_STRING(batch), length)
    cdef uint8_t* buf = <uint8_t*>PyBytes_AS_STRING(out)
    _u64(buf, <uint64_t>base_offset)
    _u32(buf + CRC_AT, _crc(buf, length))
    return out


cdef inline void _set(object t, Py_ssize_t i, object value):
    Py_INCREF(value)
    PyTuple_SET_ITEM(t, i, value)


def decode_records(bytes buf, Py_ssize_t pos=0):
    """The records of the batch at ``buf[pos:]`` (its CRC checked by the caller, or written
    here), as :func:`~broker.commitlog.batch.decode_batch` makes them; None for a control
    batch or one with gaps (compacted). Raises ValueError for bytes that are not a batch."""
    cdef const uint8_t* data = <const uint8_t*>PyBytes_AS_STRING(buf)
    cdef Py_ssize_t size = PyBytes_GET_SIZE(buf)
    if pos < 0 or size - pos < HEADER:
        raise ValueError("truncated batch header")
    cdef const uint8_t* b = data + pos
    cdef Py_ssize_t length = _get32(b + 8)
    cdef Py_ssize_t n = _get32(b + 24)
    cdef long long base = <long long>_get64(b)
    if length > size - pos or length < HEADER + 4 or b[12] != MAGIC or n < 1:
        raise ValueError("not a batch")
    if b[13] & CONTROL or _get32(b + 20) != <uint32_t>(n - 1):
        return None
    cdef const uint8_t* end = b + length
    cdef const uint8_t* p = b + HEADER
    cdef Py_ssize_t m = _get32(p), j, i, k, at, total
    p += 4
    if m > (end - p) // 2:
        raise ValueError("bad string table")
    cdef const uint8_t* text = p + 2 * m
    table = []
    for j in range(m):
        k = p[2 * j] | (p[2 * j + 1] << 8)
        if k > end - text:
            raise ValueError("bad string table")
        table.append(PyUnicode_DecodeUTF8(<const char*>text, k, "strict"))
        text += k
    p = text
    if n > (end - p) // FIXED:
        raise ValueError("record columns past the batch end")
    cdef const uint8_t* props = p + FIXED * n
    total = 0
    for i in range(n):
        if _get32(p + 8 * n + 4 * i) != <uint32_t>i:
            return None
        if _get32(p + 12 * n + 4 * i) >= <uint32_t>m or _get32(p + 16 * n + 4 * i) >= <uint32_t>m:
            raise ValueError("string index outside the table")
        total += _get32(p + 20 * n + 4 * i) + _get32(p + 24 * n + 4 * i)
    if props + total != end:
        raise ValueError("record sizes do not add up to the batch length")
    cdef const uint8_t* payloads = props
    for i in range(n):
        payloads += _get32(p + 20 * n + 4 * i)
    out = []
    for i in range(n):
        record = PyType_GenericAlloc(_RECORD, 8)
        PyObject_GC_UnTrack(record)  # ints, strs and bytes: in no cycle (as the lane's)
        _set(record, 0, PyLong_FromLongLong(base + i))
        _set(record, 1, PyLong_FromLongLong(<int64_t>_get64(p + 8 * i)))
        _set(record, 2, table[_get32(p + 12 * n + 4 * i)])
        k = _get32(p + 24 * n + 4 * i)
        _set(record, 3, PyBytes_FromStringAndSize(<const char*>payloads, k))
        payloads += k
        _set(record, 4, <int>p[28 * n + i])
        _set(record, 5, (p[29 * n + i] & 1) != 0)
        _set(record, 6, table[_get32(p + 16 * n + 4 * i)])
        k = _get32(p + 20 * n + 4 * i)
        _set(record, 7, PyBytes_FromStringAndSize(<const char*>props, k) if k else _EMPTY)
        props += k
        out.append(record)
    return out
