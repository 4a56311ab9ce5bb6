"""pyarrow is loaded by the first fetch of the HTTP API, not by starting a broker: it adds
about 50 MB to the RSS of every process that imports it (the supervisor and each worker),
for an API many brokers never serve."""

from __future__ import annotations

import subprocess
import sys

from tests.integration.conftest import ROOT


def test_starting_a_broker_does_not_import_pyarrow() -> None:
    code = (
        "import sys\n"
        "import broker.cli, broker.server, broker.workers.supervisor, broker.http.fetch_api\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('pyarrow', 'numpy')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout[:500]
