"""Per-core workers: N processes, one router each, under one supervisor (DESIGN.md,
"Per-core routers").

- :mod:`broker.workers.mesh`: the local channel between workers, and which worker owns
  which partition;
- :mod:`broker.workers.supervisor`: starts the workers, restarts one that dies, stops them.
"""
