"""Debian's bcc (``python3-bpfcc``) from any interpreter, and the bpf_link it cannot make.

bcc's Python module is installed for the system's Python in ``/usr/lib/python3/dist-packages``
and is a thin ctypes layer over ``libbcc.so.0`` with no dependency outside the standard
library. The broker runs in a virtualenv that does not see that directory (and the PyPI
package named ``bcc`` is another project), so :func:`import_bcc` loads that one package
from there by its spec, without putting the rest of the system's packages on ``sys.path``.

bcc attaches XDP programs through netlink (``BPF.attach_xdp``): such an attachment belongs
to the interface and outlives the process, so a broker killed with SIGKILL would leave its
filter dropping packets for a broker that is gone. A bpf_link (``BPF_LINK_CREATE``, Linux
5.9+) belongs to its file descriptor instead: the kernel detaches the program when the last
descriptor closes, which a process's death does. :func:`xdp_link` makes one through libbpf's
``bpf_link_create`` (``libbpf.so.1``, which libbcc itself links).
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType

#: Where Debian installs Python packages for every Python 3 of the system.
DIST_PACKAGES = "/usr/lib/python3/dist-packages"
#: ``enum bpf_attach_type``: BPF_XDP (include/uapi/linux/bpf.h).
BPF_XDP = 37
#: ``XDP_FLAGS_SKB_MODE`` (generic: after the driver, any interface) and
#: ``XDP_FLAGS_DRV_MODE`` (native: in the driver, which must support it), linux/if_link.h.
XDP_FLAGS = {"generic": 1 << 1, "native": 1 << 2}


class BccMissing(RuntimeError):
    """bcc or libbpf cannot be loaded; the message says which and the package to install."""


def import_bcc() -> ModuleType:
    """The ``bcc`` module: already imported, importable as usual, or Debian's."""
    if "bcc" in sys.modules:
        return sys.modules["bcc"]
    spec = importlib.machinery.PathFinder.find_spec("bcc", [DIST_PACKAGES])
    if spec is None or spec.loader is None:
        raise BccMissing(f"bcc is not installed ({DIST_PACKAGES}/bcc: Debian python3-bpfcc)")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bcc"] = module  # its submodules import the package by name
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # libbcc.so.0 missing or of another version: OSError, others
        del sys.modules["bcc"]
        raise BccMissing(f"bcc cannot be loaded: {e}") from None
    return module


class _LinkCreateOpts(ctypes.Structure):
    """The head of libbpf's ``struct bpf_link_create_opts``: its size, then the flags (the
    rest is left out: libbpf reads only what ``sz`` covers)."""

    _fields_ = [("sz", ctypes.c_size_t), ("flags", ctypes.c_uint32), ("_pad", ctypes.c_uint32)]


def _libbpf() -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL("libbpf.so.1", use_errno=True)
    except OSError as e:
        raise BccMissing(f"libbpf.so.1 cannot be loaded ({e}): Debian libbpf1") from None
    lib.bpf_link_create.restype = ctypes.c_int
    lib.bpf_link_create.argtypes = [
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.POINTER(_LinkCreateOpts),
    ]
    return lib


def xdp_link(prog_fd: int, ifindex: int, mode: str) -> int:
    """Attach the XDP program ``prog_fd`` to interface ``ifindex`` in ``mode`` ("generic" or
    "native") through a new bpf_link; returns the link's file descriptor (close it to
    detach). OSError with the kernel's errno when the kernel refuses (EBUSY: a program is
    already attached to the interface in that mode)."""
    opts = _LinkCreateOpts(ctypes.sizeof(_LinkCreateOpts), XDP_FLAGS[mode], 0)
    fd = int(_libbpf().bpf_link_create(prog_fd, ifindex, BPF_XDP, ctypes.byref(opts)))
    if fd < 0:
        err = -fd if fd != -1 else ctypes.get_errno()
        raise OSError(err, f"BPF_LINK_CREATE (XDP, {mode}): {os.strerror(err)}")
    return fd
