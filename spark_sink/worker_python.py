"""The executable a local Spark session starts its Python processes with.

Spark puts ``$SPARK_HOME/python/lib/pyspark.zip`` and py4j's source zip first on the
``PYTHONPATH`` of every Python process it starts. A pip-installed PySpark is its own
``SPARK_HOME``, so that zip holds the very package installed beside it, but Python cannot cache
bytecode for modules imported from a zip: every fresh process compiles PySpark again, about
1.5 s of CPU before it does anything (0.5-0.7 s with the installed package's cached bytecode).
The daemon that forks the task workers pays it once per session; the streaming source runner
(``pyspark.sql.streaming.python_streaming_source_runner``) is a fresh process for every query,
started when the query starts, and the first micro-batch waits for it: 2.2-2.5 s of a 1M-record
``--once`` drain of 6.5-7 s, against 0.5-0.7 s without the zips (measured with timestamps and
``time.process_time()`` in the runner, load average 3-5).

:func:`worker_python` writes a launcher that removes exactly those two entries from
``PYTHONPATH`` and runs the interpreter, so the processes import the installed package. It does
so only where the zips are copies of what the interpreter imports anyway: a local master, the
workers running the driver's own interpreter, and ``SPARK_HOME`` being that interpreter's
``pyspark`` package directory. Anywhere else Spark's ``PYTHONPATH`` is left as it is.
"""

from __future__ import annotations

import atexit
import os
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

#: The launcher; ``%s`` is the interpreter, which runs with Spark's ``PYTHONPATH`` minus the zips.
_LAUNCHER = """#!/bin/sh
# Written by spark_sink.worker_python: import the installed PySpark (cached bytecode) instead
# of Spark's copy in $SPARK_HOME/python/lib/pyspark.zip, which every process compiles again.
set -f
kept=
IFS=:
for entry in $PYTHONPATH; do
    case "$entry" in
        */python/lib/pyspark.zip|*/python/lib/py4j-*-src.zip) ;;
        *) kept="${kept:+$kept:}$entry" ;;
    esac
done
unset IFS
PYTHONPATH=$kept
export PYTHONPATH
exec %s "$@"
"""


def _same_interpreter(python: str) -> bool:
    """Whether ``python`` names this interpreter's path (a venv's, not the base it links to,
    whose site-packages differ)."""
    found = shutil.which(python)
    return found is not None and os.path.abspath(found) == os.path.abspath(sys.executable)


def _spark_home_is_installed_package() -> bool:
    """Whether the ``SPARK_HOME`` PySpark launches the JVM with is the imported ``pyspark``
    package itself (a pip install), so its ``python/lib`` zips hold the same code."""
    import pyspark
    from pyspark.find_spark_home import _find_spark_home

    return Path(_find_spark_home()).resolve() == Path(pyspark.__file__).parent.resolve()


def worker_python(python: str, master: str) -> str | None:
    """A launcher for ``python`` as Spark's worker executable, or None where it does not apply.

    The launcher lives in a temporary directory removed when this process exits; it must
    outlive every Spark session of the process, which stops with it in local mode.
    """
    if (
        not master.startswith("local")
        or not _same_interpreter(python)
        or not _spark_home_is_installed_package()
    ):
        return None
    directory = tempfile.mkdtemp(prefix="mqlog-spark-python-")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    launcher = Path(directory) / "python"
    launcher.write_text(_LAUNCHER % shlex.quote(os.path.abspath(shutil.which(python) or python)))
    launcher.chmod(0o700)
    return str(launcher)
