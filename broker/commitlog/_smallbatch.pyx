# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, auto_pickle=False
"""The small batch compiled (issue 23, item 2: a forward between workers costs per batch):
:func:`encode_small` writes the bytes of
:func:`broker.commitlog.small_batch.encode_small_python` (the pure-Python form, itself held to
:func:`~broker.commitlog.batch.encode_batch`), :func:`rebased` moves a batch to another base
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

Loaded by :mod:`broker.commitlog.small_batch` when built (setup.py); without it the
pure-Python forms serve. Pure functions; thread-safe under the GIL.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.long cimport PyLong_AsLongLong, PyLong_FromLongLong
from cpython.object cimport PyObject
from cpython.ref cimport Py_INCREF
from cpython.tuple cimport PyTuple_GET_ITEM, PyTuple_GET_SIZE, PyTuple_SET_ITEM
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.stdint cimport int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memcmp, memcpy

from broker.commitlog.record import Record


cdef extern from "Python.h":
    object PyType_GenericAlloc(type cls, Py_ssize_t n)
    const char* PyUnicode_AsUTF8AndSize(object s, Py_ssize_t* size) except NULL


cdef extern from "zlib.h":
    unsigned long crc32(unsigned long crc, const unsigned char *buf, unsigned int length) nogil


cdef type _RECORD = Record
cdef object _EMPTY = b""
#: The format's numbers (broker.commitlog.batch: MAGIC, BATCH_HEADER_SIZE, CRC_OFFSET,
#: RECORD_FIXED_SIZE, CONTROL_FLAG); tests/unit/commitlog/test_smallbatch.py checks them.
cdef enum:
    MAGIC = 1
    HEADER = 48
    CRC_AT = 44
    FIXED = 30
    CONTROL = 1
    #: Records per batch the encoder takes (small_batch.SMALL_BATCH), and strings.
    MAX_RECORDS = 8
    MAX_STRINGS = 2 * MAX_RECORDS


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
    cdef Py_ssize_t n = len(records)
    if n < 1 or n > MAX_RECORDS or leader_epoch < -(1 << 31) or leader_epoch >= (1 << 31):
        return None
    cdef const char* names[MAX_STRINGS]
    cdef Py_ssize_t sizes[MAX_STRINGS]
    cdef uint32_t topic_at[MAX_RECORDS]
    cdef uint32_t client_at[MAX_RECORDS]
    cdef int64_t stamps[MAX_RECORDS]
    cdef int qos[MAX_RECORDS]
    cdef int flags[MAX_RECORDS]
    cdef Py_ssize_t m = 0, i, j, k, size, body = 0, strings = 0
    cdef const char* name
    cdef int64_t max_ts
    fields = []  # keeps each record's objects alive while their pointers are used
    for i in range(n):
        record = records[i]
        if not isinstance(record, tuple) or PyTuple_GET_SIZE(record) != 8:
            return None
        fields.append(record)
        stamp = <object>PyTuple_GET_ITEM(record, 1)
        payload = <object>PyTuple_GET_ITEM(record, 3)
        props = <object>PyTuple_GET_ITEM(record, 7)
        if type(stamp) is not int or type(payload) is not bytes or type(props) is not bytes:
            return None
        try:
            stamps[i] = PyLong_AsLongLong(stamp)
        except OverflowError:
            return None
        if not _small_int(<object>PyTuple_GET_ITEM(record, 4), &qos[i]):
            return None
        if not _small_int(<object>PyTuple_GET_ITEM(record, 5), &flags[i]):
            return None
        body += PyBytes_GET_SIZE(payload) + PyBytes_GET_SIZE(props)
    # The string table: topics, then client ids, each once, in order of first appearance.
    for k in range(2 * n):
        value = <object>PyTuple_GET_ITEM(records[k % n], 2 if k < n else 6)
        if type(value) is not str:
            return None
        try:
            name = PyUnicode_AsUTF8AndSize(value, &size)
        except UnicodeError:
            return None
        if size > 0xFFFF:
            return None
        j = 0
        while j < m and not (sizes[j] == size and memcmp(names[j], name, size) == 0):
            j += 1
        if j == m:
            names[m] = name
            sizes[m] = size
            strings += size
            m += 1
        if k < n:
            topic_at[k] = <uint32_t>j
        else:
            client_at[k - n] = <uint32_t>j
    cdef Py_ssize_t length = HEADER + 4 + 2 * m + strings + n * FIXED + body
    out = PyBytes_FromStringAndSize(NULL, length)
    cdef uint8_t* buf = <uint8_t*>PyBytes_AS_STRING(out)
    cdef uint8_t* p = buf + HEADER
    _u32(p, <uint32_t>m)
    p += 4
    for j in range(m):
        _u16(p, <uint16_t>sizes[j])
        p += 2
    for j in range(m):
        memcpy(p, names[j], sizes[j])
        p += sizes[j]
    max_ts = stamps[0]
    for i in range(n):
        _u64(p + 8 * i, <uint64_t>stamps[i])
        if stamps[i] > max_ts:
            max_ts = stamps[i]
    p += 8 * n
    for i in range(n):
        _u32(p + 4 * i, <uint32_t>i)
        _u32(p + 4 * (n + i), topic_at[i])
        _u32(p + 4 * (2 * n + i), client_at[i])
        record = fields[i]
        _u32(p + 4 * (3 * n + i), <uint32_t>PyBytes_GET_SIZE(<object>PyTuple_GET_ITEM(record, 7)))
        _u32(p + 4 * (4 * n + i), <uint32_t>PyBytes_GET_SIZE(<object>PyTuple_GET_ITEM(record, 3)))
        p[20 * n + i] = <uint8_t>qos[i]
        p[21 * n + i] = <uint8_t>flags[i]
    p += 22 * n
    for k in (7, 3):  # every record's properties, then every payload
        for i in range(n):
            value = <object>PyTuple_GET_ITEM(fields[i], k)
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
    _u64(buf + 28, <uint64_t>stamps[0])
    _u64(buf + 36, <uint64_t>max_ts)
    _u32(buf + CRC_AT, _crc(buf, length))
    return out


cdef inline uint32_t _crc(const uint8_t* batch, Py_ssize_t length) noexcept:
    return <uint32_t>crc32(
        crc32(0, batch, CRC_AT), batch + HEADER, <unsigned int>(length - HEADER)
    )


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
