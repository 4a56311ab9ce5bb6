"""The admin HTTP server (aiohttp): health, metrics, the admin API and the fetch API.

- :mod:`broker.http.api`: routes, ``/healthz``, ``/metrics``, ``/api/v1/...`` admin views.
- :mod:`broker.http.access`: HTTP Basic against the password file (every route but
  ``/healthz`` with ``allow_anonymous = false``), the caller's ACL for the fetch API.
- :mod:`broker.http.fetch_api`: records by offset or time, as Arrow IPC or JSON (Spark).
- :mod:`broker.http.console`: the live console page at ``/`` and the JSON it polls.
- :mod:`broker.http.arrow`: records and column reads as Arrow record batches.
"""
