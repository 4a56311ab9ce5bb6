"""The record-batch checksum: zlib's CRC-32, computed by libdeflate when the system has it.

zlib 1.2.13's ``crc32`` is a table-driven loop: 479 us of CPU per MiB on the 2-core benchmark
machine, a third of the cost of appending a batch of 1,000 x 1 KiB records (issue 3,
``python -m bench.commitlog``). libdeflate's ``libdeflate_crc32`` computes the same CRC-32 (same
polynomial, initial value and final xor, so the same bytes on disk) with carry-less
multiplication: 74 us per MiB on the same machine. It is the shared library of Debian's
``libdeflate0`` package, loaded with ctypes as :mod:`broker.commitlog.segment` loads
``sync_file_range``; without it, or if it disagrees with zlib on a test vector at load,
``zlib.crc32`` computes every checksum. Which one is in use is :data:`IMPLEMENTATION`.

Below :data:`NATIVE_MIN_BYTES` zlib is faster: a ctypes call costs about 2 us (measured: zlib
takes 2.0 us for 4 KiB, libdeflate 2.4 us; at 16 KiB 8.2 us against 2.9 us).

A batch's own checksum (:func:`batch_crc`, :func:`batch_crc_ok`: the batch but its four CRC
bytes) is computed by the compiled module :mod:`broker.commitlog._crc` when it is built (one
call from Python, no slice copied, libdeflate called from C for every size: 0.11 us for a
256-byte batch where the two slices and two zlib calls of the pure-Python form take 0.7-1.1
us, issue 25's cost of verifying every read); without it, by the pure-Python forms below, with
the same results. Which one is in use is :data:`BATCH_IMPLEMENTATION`.

Pure functions; safe from any thread (ctypes releases the GIL during the call, as zlib does for
large buffers).
"""

from __future__ import annotations

import ctypes
import zlib
from collections.abc import Callable
from typing import cast

#: Smallest range handed to libdeflate (bytes); shorter ones go to zlib (see module doc).
NATIVE_MIN_BYTES = 8192

_Buffer = bytes | bytearray | memoryview


def _load_libdeflate() -> Callable[[int, int | None, int], int] | None:
    """``libdeflate_crc32(crc, address, length)``, or None when absent or not zlib's CRC-32."""
    try:
        function = ctypes.CDLL("libdeflate.so.0").libdeflate_crc32
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
    function.restype = ctypes.c_uint32
    sample = bytes(range(256)) * 64
    address = ctypes.cast(ctypes.c_char_p(sample), ctypes.c_void_p).value
    if function(7, address, len(sample)) != zlib.crc32(sample, 7):  # pragma: no cover
        return None
    return cast("Callable[[int, int | None, int], int]", function)


_native = _load_libdeflate()
#: ``"libdeflate"`` or ``"zlib"``: what computes the checksums of large ranges in this process.
IMPLEMENTATION = "zlib" if _native is None else "libdeflate"


def _address(buf: _Buffer, end: int) -> int | None:
    """Address of ``buf``'s first byte when libdeflate may read ``end`` bytes there without a
    copy, else None (a read-only memoryview, a range past the end)."""
    if type(buf) is bytes:
        # c_char_p points into the bytes object itself.
        return ctypes.cast(ctypes.c_char_p(buf), ctypes.c_void_p).value if end <= len(buf) else None
    if isinstance(buf, memoryview) and (buf.readonly or not buf.c_contiguous or end > buf.nbytes):
        return None
    if isinstance(buf, bytearray) and end > len(buf):
        return None
    # Borrows the buffer for this call only (a bytearray cannot resize meanwhile).
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def crc32(buf: _Buffer, start: int, end: int, value: int = 0) -> int:
    """CRC-32 of ``buf[start:end]`` continuing from ``value``: ``zlib.crc32(buf[start:end],
    value)``, without copying the range."""
    if _native is not None and end - start >= NATIVE_MIN_BYTES and start >= 0:
        address = _address(buf, end)
        if address is not None:
            return _native(value, address + start, end - start)
    with memoryview(buf) as view:
        return zlib.crc32(view[start:end], value)


#: The batch layout's two numbers a batch's checksum needs (``broker.commitlog.batch`` checks
#: they are its ``BATCH_HEADER_SIZE`` and ``CRC_OFFSET``): the CRC covers the header before
#: ``CRC_AT`` and everything after the header.
HEADER_SIZE = 48
CRC_AT = 44


def _batch_crc(buf: _Buffer, pos: int, length: int) -> int:
    """CRC-32 of the batch at ``buf[pos:pos + length]`` but its stored CRC (pure Python)."""
    if pos < 0 or length < HEADER_SIZE or length > len(buf) - pos:
        raise ValueError(f"no batch of {length} bytes at {pos} in a buffer of {len(buf)}")
    end = pos + length
    if length < NATIVE_MIN_BYTES and type(buf) is bytes:
        # Two slices and two zlib calls: cheaper than a memoryview or a ctypes call here.
        return zlib.crc32(buf[pos + HEADER_SIZE : end], zlib.crc32(buf[pos : pos + CRC_AT]))
    return crc32(buf, pos + HEADER_SIZE, end, crc32(buf, pos, pos + CRC_AT))


def _batch_crc_ok(buf: _Buffer, pos: int, length: int) -> bool:
    """Whether the stored CRC of the batch at ``buf[pos:pos + length]`` matches its bytes."""
    stored = int.from_bytes(buf[pos + CRC_AT : pos + HEADER_SIZE], "little")
    return _batch_crc(buf, pos, length) == stored


batch_crc: Callable[[_Buffer, int, int], int]
batch_crc_ok: Callable[[_Buffer, int, int], bool]
try:
    from broker.commitlog._crc import batch_crc, batch_crc_ok
except ImportError:  # not built (a checkout on PYTHONPATH): the pure-Python forms
    batch_crc, batch_crc_ok = _batch_crc, _batch_crc_ok
#: ``"compiled"`` or ``"python"``: what computes :func:`batch_crc` and :func:`batch_crc_ok`.
BATCH_IMPLEMENTATION = "python" if batch_crc is _batch_crc else "compiled"
