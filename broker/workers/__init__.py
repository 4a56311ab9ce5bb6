"""Per-core workers: N processes, one router each, under one supervisor.

Each worker is a whole broker for the clients it accepts (the listeners are shared through
SO_REUSEPORT) and owns a share of the partitions; publishes to a partition another worker
owns are forwarded to it, and its subscribers elsewhere read the owner's files.

- :mod:`broker.workers.supervisor`: starts the workers, restarts one that dies, stops them;
- :mod:`broker.workers.mesh`: the local channel between workers, and which worker owns
  which partition;
- :mod:`broker.workers.partitions`: forwarding publishes to a partition's owner, high-water
  marks, reading partitions owned elsewhere;
- :mod:`broker.workers.sessions`: where each session lives, and handing it over;
- :mod:`broker.workers.groups`: shared subscription groups across workers;
- :mod:`broker.workers.runtime`: what joins these to one worker's server and router.
"""
