# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, auto_pickle=False
"""The check of a small batch's CRC compiled (issue 25, the cost of verifying every read).

:func:`batch_crc` and :func:`batch_crc_ok` are those of :mod:`broker.commitlog.crc` (the
pure-Python forms there): the same CRC-32 over the same bytes (the batch but its stored CRC,
the layout numbers ``crc.HEADER_SIZE`` and ``crc.CRC_AT``), in one call from Python, no slice
copied, the CRC computed by libdeflate's
``libdeflate_crc32`` (carry-less multiplication) when the shared library loads and agrees with
zlib on a test vector, else by zlib's ``crc32`` (the function ``zlib.crc32`` calls). Measured
on the 2-core machine of issue 25 for a 256-byte batch (two records): zlib 542 ns, libdeflate
47 ns in C; the pure-Python form costs 0.7-2 us there, mostly its two slices and two calls.
From Python a ctypes call costs ~2 us, which is why ``broker.commitlog.crc`` keeps libdeflate
for ranges of 8 KiB and more; here the call is C's.

Loaded by :mod:`broker.commitlog.crc` when built (``pip install -e .``, setup.py); without
it the pure-Python form checks, with the same results (tests/unit/commitlog/test_crc.py
compares them). :data:`IMPLEMENTATION` says which function computes. Thread-safe: pure.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from libc.stdint cimport uint32_t
from posix.dlfcn cimport RTLD_NOW, dlopen, dlsym

import zlib



cdef extern from "zlib.h":
    unsigned long crc32(unsigned long crc, const unsigned char *buf, unsigned int length) nogil


ctypedef uint32_t (*crc_function)(uint32_t crc, const void *buf, size_t length) noexcept nogil


cdef uint32_t _zlib(uint32_t crc, const void *buf, size_t length) noexcept nogil:
    return <uint32_t>crc32(crc, <const unsigned char *>buf, <unsigned int>length)


cdef crc_function _load_libdeflate():
    """``libdeflate_crc32``, or NULL when absent or not zlib's CRC-32."""
    cdef void *lib = dlopen(b"libdeflate.so.0", RTLD_NOW)
    if lib == NULL:
        return NULL
    cdef crc_function found = <crc_function>dlsym(lib, b"libdeflate_crc32")
    if found == NULL:
        return NULL
    sample = bytes(range(256)) * 3
    if found(7, PyBytes_AS_STRING(sample), len(sample)) != zlib.crc32(sample, 7):
        return NULL
    return found


cdef crc_function _native = _load_libdeflate()
cdef crc_function _crc = _native if _native != NULL else _zlib
#: ``"libdeflate"`` or ``"zlib"``: what computes the checksums here.
IMPLEMENTATION = "zlib" if _native == NULL else "libdeflate"
#: ``crc.HEADER_SIZE`` and ``crc.CRC_AT`` (this module cannot import them: crc imports it).
cdef Py_ssize_t _HEADER = 48
cdef Py_ssize_t _CRC_AT = 44
#: Batches from this size on are checked without the GIL (the bytes object or the buffer
#: view held keeps them alive and unchanged, for bytes, meanwhile).
cdef Py_ssize_t _NOGIL_BYTES = 1 << 16


cdef uint32_t _computed(const unsigned char *data, Py_ssize_t size, Py_ssize_t pos,
                        Py_ssize_t length) except? 0:
    if pos < 0 or length < _HEADER or length > size - pos:
        raise ValueError(f"no batch of {length} bytes at {pos} in a buffer of {size}")
    cdef const unsigned char *batch = data + pos
    cdef uint32_t crc
    if length >= _NOGIL_BYTES:
        with nogil:
            crc = _crc(_crc(0, batch, <size_t>_CRC_AT), batch + _HEADER, <size_t>(length - _HEADER))
        return crc
    return _crc(_crc(0, batch, <size_t>_CRC_AT), batch + _HEADER, <size_t>(length - _HEADER))


cdef uint32_t batch_crc_of(const unsigned char *batch, Py_ssize_t length) noexcept nogil:
    """The CRC of the whole batch of ``length`` bytes (at least a header) at ``batch``, by
    the same function as :func:`batch_crc`: for other compiled modules (_crc.pxd), which
    write batches (broker.commitlog._smallbatch)."""
    return _crc(_crc(0, batch, <size_t>_CRC_AT), batch + _HEADER, <size_t>(length - _HEADER))


cdef inline uint32_t _stored(const unsigned char *data, Py_ssize_t pos) noexcept:
    cdef const unsigned char *s = data + pos + _CRC_AT
    return s[0] | (s[1] << 8) | (s[2] << 16) | (<uint32_t>s[3] << 24)


def batch_crc(buf, Py_ssize_t pos, Py_ssize_t length):
    """CRC-32 of the batch at ``buf[pos:pos + length]`` but its stored CRC (``buf``: bytes, or
    any object with a contiguous buffer). Raises ``ValueError`` when the range is not inside
    ``buf`` or shorter than a batch header."""
    cdef Py_buffer view
    if type(buf) is bytes:
        return _computed(<const unsigned char *>PyBytes_AS_STRING(buf), PyBytes_GET_SIZE(buf),
                         pos, length)
    PyObject_GetBuffer(buf, &view, PyBUF_SIMPLE)
    try:
        return _computed(<const unsigned char *>view.buf, view.len, pos, length)
    finally:
        PyBuffer_Release(&view)


def batch_crc_ok(buf, Py_ssize_t pos, Py_ssize_t length):
    """Whether the stored CRC of the batch at ``buf[pos:pos + length]`` matches its bytes
    (raises as :func:`batch_crc`)."""
    cdef Py_buffer view
    cdef const unsigned char *data
    cdef uint32_t crc  # computed first: it checks the range _stored reads
    if type(buf) is bytes:
        data = <const unsigned char *>PyBytes_AS_STRING(buf)
        crc = _computed(data, PyBytes_GET_SIZE(buf), pos, length)
        return crc == _stored(data, pos)
    PyObject_GetBuffer(buf, &view, PyBUF_SIMPLE)
    try:
        data = <const unsigned char *>view.buf
        crc = _computed(data, view.len, pos, length)
        return crc == _stored(data, pos)
    finally:
        PyBuffer_Release(&view)
