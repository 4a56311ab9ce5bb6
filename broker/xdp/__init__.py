"""The XDP filter of a cluster node's interface (``bpf/mqlog_xdp.c``) and its user-space twin.

``open_filter(config)`` gives a :class:`MemberFilter`: the kernel one (:mod:`.kernel`) where
BPF loads, else the user-space one (:mod:`.userspace`), with the same API: ``allow``,
``deny``, ``set_members`` (the membership code's call on every change), ``accept`` (the gossip
socket's predicate), ``counters``, ``status``, ``close``.
"""

from broker.xdp.classes import CLASSES, VERDICTS, Counters
from broker.xdp.members import MemberFilter
from broker.xdp.service import open_filter, ports_of, static_members

__all__ = [
    "CLASSES",
    "VERDICTS",
    "Counters",
    "MemberFilter",
    "open_filter",
    "ports_of",
    "static_members",
]
