"""MQTT over TLS ([server] tls_port): TLS done with :mod:`ssl` memory BIOs around the one
MQTT connection implementation (:class:`~broker.net.transport.MQTTProtocol`).

Doing the handshake ourselves, rather than through the loop's ``ssl=`` transport, lets the
listener see the first bytes: a plain MQTT client on the TLS port (first byte not 0x16, a TLS
handshake record) and a failed handshake (wrong CA, no client certificate, old protocol
version) are each logged in one clear line naming the peer, instead of a silent close.

Defaults are modern: TLS 1.2 or newer, the ssl module's cipher list, no compression,
optional or required client certificates verified against ``cafile``; the client
certificate's Common Name becomes the user name when ``[auth] use_identity_as_username``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from typing import TYPE_CHECKING, Any, cast

from broker.net.carrier import Carrier
from broker.net.transport import TLS_HANDSHAKE_BYTE, MQTTProtocol

if TYPE_CHECKING:
    from broker.config import ServerConfig
    from broker.net.context import EdgeContext

log = logging.getLogger("broker.tls")

#: Plaintext bytes decrypted per SSLObject.read call.
READ_CHUNK = 1 << 16


class TLSConfigError(Exception):
    """The certificate, key or CA file cannot be loaded; the message names the file."""


def server_context(cfg: ServerConfig) -> ssl.SSLContext:
    """The listener's SSLContext from ``[server]`` certfile / keyfile / cafile."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.options |= ssl.OP_NO_COMPRESSION | ssl.OP_CIPHER_SERVER_PREFERENCE
    try:
        ctx.load_cert_chain(str(cfg.certfile), str(cfg.keyfile))
    except (OSError, ssl.SSLError) as e:
        raise TLSConfigError(
            f"server.certfile {cfg.certfile} / server.keyfile {cfg.keyfile}: cannot load: {e}"
        ) from None
    if cfg.cafile is not None:
        try:
            ctx.load_verify_locations(cafile=str(cfg.cafile))
        except (OSError, ssl.SSLError) as e:
            raise TLSConfigError(f"server.cafile {cfg.cafile}: cannot load: {e}") from None
        ctx.verify_mode = ssl.CERT_REQUIRED if cfg.require_certificate else ssl.CERT_OPTIONAL
    return ctx


def common_name(cert: dict[str, Any] | None) -> str | None:
    """The subject's CN of a verified peer certificate (``SSLObject.getpeercert()``)."""
    if not cert:
        return None
    for rdn in cert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return None


class TLSProtocol(asyncio.Protocol):
    """The socket side: handshake, then decrypt into and encrypt out of an MQTTProtocol."""

    def __init__(self, edge: EdgeContext[MQTTProtocol], context: ssl.SSLContext) -> None:
        self.edge = edge
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self.sslobj = context.wrap_bio(self._incoming, self._outgoing, server_side=True)
        self.inner = MQTTProtocol(edge, tls=True)
        self.transport: asyncio.Transport | None = None
        self.carrier: TLSCarrier | None = None
        self.peer = "?"
        self._first = True
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a stream listener's (uvloop's)
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self._timer = self.edge.loop.call_later(
            self.edge.config.router.connect_timeout, self._handshake_timeout
        )

    def _handshake_timeout(self) -> None:
        log.warning("%s: TLS handshake not completed in time; closing", self.peer)
        self._abort()

    def data_received(self, data: bytes) -> None:
        if self.carrier is None:
            if self._first:
                self._first = False
                if data[0] != TLS_HANDSHAKE_BYTE:
                    what = " (an MQTT CONNECT)" if data[0] == 0x10 else ""
                    log.warning(
                        "%s: plain (non-TLS) data%s on the MQTT over TLS port; closing",
                        self.peer,
                        what,
                    )
                    self._abort()
                    return
            self._incoming.write(data)
            if not self._handshake():
                return
        else:
            self._incoming.write(data)
        self._read_plaintext()

    def _handshake(self) -> bool:
        try:
            self.sslobj.do_handshake()
        except ssl.SSLWantReadError:
            self._send_pending()
            return False
        except ssl.SSLError as e:
            self._send_pending()  # the alert tells the client why
            log.warning(
                "%s: TLS handshake failed: %s",
                self.peer,
                getattr(e, "verify_message", None) or e.reason or e,
            )
            self._close()
            return False
        self._send_pending()
        if self._timer is not None:
            self._timer.cancel()
        assert self.transport is not None
        self.carrier = TLSCarrier(self)
        self.inner.tls_identity = common_name(self.sslobj.getpeercert())
        self.inner.connection_made(self.carrier)
        return True

    def _read_plaintext(self) -> None:
        chunks = []
        while True:
            try:
                chunk = self.sslobj.read(READ_CHUNK)
            except ssl.SSLWantReadError:
                break
            except ssl.SSLZeroReturnError:  # close_notify from the client
                self._close()
                break
            except ssl.SSLError as e:
                log.info("%s: TLS error: %s; closing", self.peer, e.reason or e)
                self._abort()
                return
            if not chunk:
                break
            chunks.append(chunk)
        self._send_pending()  # reading can produce records (TLS 1.3 tickets, key updates)
        if chunks:
            self.inner.data_received(chunks[0] if len(chunks) == 1 else b"".join(chunks))

    def _send_pending(self) -> None:
        pending = self._outgoing.read()
        if pending and self.transport is not None and not self.transport.is_closing():
            self.transport.write(pending)

    def _close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def eof_received(self) -> bool:
        return False  # close our side too

    def pause_writing(self) -> None:
        if self.carrier is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.carrier is not None:
            self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self.carrier is not None:
            self.carrier._closing = True
            self.inner.connection_lost(exc)


class TLSCarrier(Carrier):
    """The transport MQTTProtocol writes to: plaintext in, TLS records to the socket."""

    def __init__(self, outer: TLSProtocol) -> None:
        super().__init__(outer.transport)
        self.tls = outer

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "ssl_object":
            return self.tls.sslobj
        if name == "peercert":
            return self.tls.sslobj.getpeercert()
        return super().get_extra_info(name, default)

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        transport = self.tls.transport
        if transport is not None:
            transport.set_write_buffer_limits(high, low)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._closing:
            return
        try:
            self.tls.sslobj.write(data)
        except ssl.SSLError as e:
            log.info("%s: TLS error while writing: %s; closing", self.tls.peer, e.reason or e)
            self.abort()
            return
        self.tls._send_pending()

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        with contextlib.suppress(ssl.SSLError):
            self.tls.sslobj.unwrap()  # queue our close_notify
        self.tls._send_pending()
        self.tls._close()

    def abort(self) -> None:
        self._closing = True
        self.tls._abort()
