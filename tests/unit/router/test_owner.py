"""A session belongs to the user who made it (broker/router/lifecycle.py): another user's
CONNECT with its client id is refused, and the owner is kept across persistence."""

from __future__ import annotations

from typing import Any

from broker.mqtt.packets import ConnAck, Connect
from broker.mqtt.properties import PropertyId
from broker.router.session import Session
from tests.unit.router.conftest import FakeLink, Harness


def login(
    h: Harness, client_id: str, user: str | None, version: int = 5, clean: bool = False
) -> tuple[FakeLink, tuple[Session, int] | None]:
    """A CONNECT of ``client_id`` as ``user`` (a persistent session unless ``clean``)."""
    link = FakeLink(client_id, version)
    props: dict[int, Any] = {PropertyId.SESSION_EXPIRY_INTERVAL: 600} if version == 5 else {}
    result = h.router.connect(
        link, Connect(client_id, version, clean_start=clean, properties=props), username=user
    )
    h.run()
    return link, result


def test_another_users_connect_is_refused_and_the_session_kept(h: Harness) -> None:
    link, result = login(h, "phone", "alice")
    assert result is not None
    session = result[0]
    assert session.owner == "alice"
    h.router.connection_lost(session, link, graceful=True)
    for user, version, clean in (("bob", 5, False), ("bob", 5, True), (None, 4, False)):
        link, result = login(h, "phone", user, version, clean)
        assert result is None
        (ack,) = link.of(ConnAck)
        assert ack.reason_code == (0x85 if version == 5 else 2)
        if version == 5:
            reason = ack.properties[PropertyId.REASON_STRING]
            assert reason == "this client id holds another user's session"
    assert h.router.sessions["phone"] is session  # not ended, not replaced
    link, result = login(h, "phone", "alice")
    assert result is not None and result[0] is session


def test_the_owner_survives_persistence_and_an_unowned_session_is_claimed() -> None:
    s = Session("phone", persistent=True, expiry_interval=600, owner="alice")
    restored = Session.from_state("phone", s.to_state())
    assert (restored.owner, restored.owner_known) == ("alice", True)
    state = s.to_state()
    del state["owner"]  # persisted before owners were kept
    legacy = Session.from_state("phone", state)
    assert not legacy.owner_known  # its next login becomes the owner
