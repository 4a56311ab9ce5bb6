"""The device path (see broker.net.transport's module docstring) in pure Python, and which
device path the transport takes (issue 23, item 1): the compiled one
(:mod:`broker.net._devicelane`, built from ``_devicelane.pyx`` by ``pip install -e .``), or
this reference (:func:`plain_publish` and :func:`plain_acked`, methods of ``MQTTProtocol``).

Both give the same bytes to the client and the same records to the log
(``tests/unit/net/test_device_path.py`` runs its equivalence tests on both). The compiled
one is taken when it is built, unless the environment says ``MQLOG_DEVICE_PATH=python``
(read once per process). When it is not built (a checkout without ``pip install -e .``),
the broker logs that once and takes the Python path.
"""

from __future__ import annotations

import logging
import os
from functools import partial
from typing import TYPE_CHECKING, Any

from broker.mqtt.packets import PubAck
from broker.mqtt.properties import PropertyId
from broker.mqtt.reason_codes import ReasonCode

if TYPE_CHECKING:
    from broker.commitlog.keys import PartitionKey
    from broker.net._devicelane import DeviceLane

log = logging.getLogger("broker.net.devicelane")

#: The environment variable that selects the path: ``compiled`` (the default) or ``python``.
ENV = "MQLOG_DEVICE_PATH"

_resolved = False
_lane_class: type[DeviceLane] | None = None


def lane_class() -> type[DeviceLane] | None:
    """The compiled lane's class, or None for the Python path (decided on the first call;
    logged then)."""
    global _resolved, _lane_class
    if not _resolved:
        _resolved = True
        choice = os.environ.get(ENV, "compiled").strip().lower()
        if choice == "python":
            log.info("device path: pure Python (%s=python)", ENV)
        else:
            if choice != "compiled":
                log.warning("%s=%r: expected compiled or python; compiled", ENV, choice)
            try:
                from broker.net._devicelane import DeviceLane
            except ImportError as e:
                log.warning(
                    "device path: the compiled module is not built (%s); the pure-Python path "
                    "serves (pip install -e . builds it)",
                    e,
                )
            else:
                _lane_class = DeviceLane
    return _lane_class


def new_lane(proto: Any, key: PartitionKey) -> DeviceLane | None:
    """A compiled lane for ``proto`` 's plain topic (just declared with ``expect_plain``)
    whose partition is ``key``; None: the Python path."""
    cls = lane_class()
    return None if cls is None else cls(proto, key)


def burst_lane(self: Any, data: bytes) -> bool:
    """A method of MQTTProtocol (``self``), for a read of PUBLISHes before the connection
    has a plain topic: a publisher's first burst, which can be its whole stream in one read
    (its socket filled while the loop served the others). The compiled lane is made for the
    first PUBLISH's topic now, where the decoder would have taken every packet of the read
    and left the lane to the next (``MQTTProtocol._publish``), and takes the read if it is
    plain PUBLISHes to that topic. The topic is checked as the decoder and the router check
    it (``ServerConnection.burst_topic``, ``Router.plain_route``), so it is the plain topic
    the full path would give that PUBLISH. False: the decoder's (the plain topic stays)."""
    if (
        self.session is None
        or self._admission is not None
        or self.conn.plain_topic
        or not self.compiled_device_path
        or lane_class() is None
    ):
        return False
    topic = self.conn.burst_topic(data)
    if topic is None:
        return False
    key = self.router.plain_route(self.client_id, topic)
    if key is None:
        return False
    self.conn.expect_plain(topic)
    self._plain_key = key
    self._lane = lane = new_lane(self, key)
    if lane is None or not lane.receive(data):
        return False
    if self.edge.handoff is not None:  # moved to the owner? (broker.net.handoff)
        self.edge.handoff(self, key)
    return True


# The Python device path: methods of MQTTProtocol (``self``), kept here beside the choice.


def plain_publish(self: Any, data: bytes) -> bool:
    """The device path: into the partition's batch if the connection recognises ``data`` as
    one plain PUBLISH to its plain topic; False leaves it to the decoder (``_receive``)."""
    plain = self.conn.plain_publish(data)
    if plain is None:
        return False
    topic, payload, qos, packet_id = plain
    self.metrics.messages_in[qos] += 1
    router = self.router
    router.publish_plain(
        self.client_id,
        topic,
        self._plain_key,
        payload,
        qos,
        int(router.clock() * 1000),
        partial(self._plain_acked, packet_id) if packet_id else None,
    )
    return True


def plain_acked(self: Any, packet_id: int, offset: int | None) -> None:
    """Answer a device-path PUBLISH as :class:`~broker.router.commit.Ack` would: it is in
    the log at ``offset``, or not (None), or may be (negative: ``OUTCOME_UNKNOWN``)."""
    if self._closing:
        return
    if offset is None or offset < 0:
        if offset is None and self.version == 5:
            props: dict[int, Any] = {PropertyId.REASON_STRING: "the log append failed"}
            self.send(PubAck(packet_id, ReasonCode.UNSPECIFIED_ERROR, props))
        else:  # 3.1.1 has no negative ack; an unknown outcome gets none: resend it
            self.close(ReasonCode.UNSPECIFIED_ERROR, "publish not stored, or not known to be")
        return
    # _write inlined: the connection's puback() is the one call this path makes.
    data = self.conn.puback(packet_id)
    if self._out is None:
        self._out = [data]
        self.edge.want_flush(self)
    else:
        self._out.append(data)
    self._out_bytes += len(data)
