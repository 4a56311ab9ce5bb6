"""Gossip membership: SWIM (Das, Gupta, Motivala, DSN 2002) with the Lifeguard refinements
(Dadgar, Phillips, Currey, "Lifeguard: Local Health Awareness for More Accurate Failure
Detection", 2018), in the shape of hashicorp/memberlist.

Rooms: ``messages`` (what members exchange and what the core hands its driver), ``members``
(states and the precedence rules, SWIM s4.2), ``health`` (the local health multiplier and the
dynamic suspicion timeout of Lifeguard), ``broadcasts`` (piggybacked dissemination with a
retransmit limit, SWIM s4.1), ``swim`` (the sans-IO core), ``codec`` (authenticated datagrams),
``endpoint`` (the asyncio UDP driver) and ``sim`` (a deterministic simulator of 50-200 members).
"""
