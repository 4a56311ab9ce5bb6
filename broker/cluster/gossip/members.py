"""A member's record and the precedence rules between updates (SWIM s4.2, as memberlist's
state.go applies them).

With ``i`` the update's incarnation and ``j`` the one we hold:
- ALIVE(i) overrides ALIVE(j), SUSPECT(j), DEAD(j) and LEFT(j) when i > j (a member that was
  declared dead or left comes back only with a higher incarnation: a rejoin or a refutation).
- SUSPECT(i) overrides ALIVE(j) when i >= j and SUSPECT(j) when i > j; a SUSPECT(i) at the
  same incarnation as the suspicion we hold is a *confirmation* (Lifeguard, "Local Health
  Aware Suspicion"), not a change.
- DEAD(i) and LEFT(i) override ALIVE(j) and SUSPECT(j) when i >= j. SWIM's Confirm overrides
  any incarnation; memberlist ignores an older one, as here: a stale death notice must not
  kill a member that has since refuted it.
- Nothing but a newer ALIVE overrides DEAD or LEFT.
Only the member itself raises its incarnation (to refute, SWIM s4.2), so these rules converge:
every member ends with the update of the highest incarnation, SUSPECT < DEAD/LEFT at equal
incarnations.
"""

from __future__ import annotations

from dataclasses import dataclass

from broker.cluster.gossip.messages import Addr, State, Update

__all__ = ["Member", "is_confirmation", "overrides"]

GONE = (State.DEAD, State.LEFT)


@dataclass(slots=True)
class Member:
    """What this member believes of ``node``; ``since`` is when (driver's ms) ``state`` began,
    ``origin`` who said so (the update's origin)."""

    node: str
    addr: Addr
    state: State
    incarnation: int
    since: int
    origin: str
    #: What the member said of itself in its last ALIVE (``Update.meta``).
    meta: bytes = b""

    def update(self) -> Update:
        """This record as an update (for a full state exchange)."""
        if self.state is State.ALIVE:
            return Update(
                self.state, self.node, self.incarnation, self.origin, self.addr, self.meta
            )
        return Update(self.state, self.node, self.incarnation, self.origin)


def overrides(update: Update, member: Member) -> bool:
    """Whether ``update`` replaces what we hold of ``member`` (the module's rules)."""
    i, j = update.incarnation, member.incarnation
    if update.state is State.ALIVE:
        return i > j
    if member.state in GONE:
        return False
    if update.state is State.SUSPECT:
        return i > j or (i == j and member.state is State.ALIVE)
    return i >= j  # DEAD or LEFT over ALIVE or SUSPECT


def is_confirmation(update: Update, member: Member) -> bool:
    """A SUSPECT about a member we already suspect at that incarnation: another member's
    independent suspicion (its origin), which shortens the suspicion timeout (Lifeguard,
    "Local Health Aware Suspicion")."""
    return (
        update.state is State.SUSPECT
        and member.state is State.SUSPECT
        and update.incarnation == member.incarnation
    )
