"""The network edge: where bytes become packets and packets become router calls.

- :mod:`broker.net.transport`: the asyncio Protocol over one MQTT connection (TCP), driving
  the sans-IO :class:`broker.mqtt.connection.ServerConnection` and calling the router.
- :mod:`broker.net.admission`: a CONNECT's admission (the login, the session claim across
  workers, the input held meanwhile).
- :mod:`broker.net.tls`, :mod:`broker.net.websocket`: the same connection over TLS (memory
  BIO) and WebSocket (aiohttp), through :mod:`broker.net.carrier`.
- :mod:`broker.net.context`: :class:`~broker.net.context.EdgeContext`, what the edge may use
  of the worker (the router, metrics, auth, links, loop); ``broker.net`` never imports
  ``broker.server``.
- :mod:`broker.net.keepalive`: the keepalive wheel; :mod:`broker.net.iteration`: the
  end-of-iteration pass that runs the group commit, the links' output and the mesh's frames.
"""
