"""broker/cli: Mosquitto's command-line habits, and no traceback for any user error.

Each command runs in this process through :func:`broker.cli.main`; a missing optional extra is
made missing with ``sys.modules[name] = None`` (what ``import`` and ``find_spec`` then see).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

from broker.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = str(ROOT / "config" / "broker.toml")


def run(
    argv: list[str], capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> tuple[int, str]:
    """Exit status and everything said (stdout, stderr, log), with no traceback in it."""
    caplog.set_level(logging.INFO)
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse: --help, --version, usage errors
        rc = int(e.code or 0)
    out, err = capsys.readouterr()
    said = out + err + caplog.text
    assert "Traceback" not in said, said
    return rc, said


def test_version(capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    rc, said = run(["--version"], capsys, caplog)
    assert rc == 0 and said.startswith("mqlog ")


def test_serve_short_flags_as_mosquitto() -> None:
    args = build_parser().parse_args(["serve", "-c", "x.toml", "-h", "0.0.0.0", "-p", "1884", "-v"])
    assert (args.config, args.host, args.port, args.verbose) == ("x.toml", "0.0.0.0", 1884, True)


def test_serve_help_is_long_only(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    rc, said = run(["serve", "--help"], capsys, caplog)
    assert rc == 0 and "-h HOST, --host HOST" in said and "-p PORT, --port PORT" in said


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--port", "70000"], "command line: --port = 70000 must be an integer >= 0"),
        (["--http-port", "70000"], "command line: --http-port = 70000 must be an integer >= 0"),
        (["-p", "70000"], "command line: --port = 70000"),
        (["--workers", "-3"], "command line: --workers = -3 must be an integer >= 0 and <= 256"),
        (["--port", "abc"], "argument -p/--port: invalid int value: 'abc'"),
    ],
)
def test_bad_flag_values_are_errors_not_tracebacks(
    flags: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    rc, said = run(["serve", "-c", SHIPPED, *flags], capsys, caplog)
    assert rc == 2 and message in said, said


def test_data_dir_naming_a_regular_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    rc, said = run(["serve", "-c", SHIPPED, "--data-dir", str(afile)], capsys, caplog)
    assert rc == 2
    assert f"command line: --data-dir = '{afile}' must be a directory" in said, said


def test_bench_help_without_numpy_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setitem(sys.modules, "numpy", None)
    rc, said = run(["bench", "--help"], capsys, caplog)
    assert rc == 2 and "pip install 'mqlog[bench]'" in said, said


def test_spark_drain_without_pyspark_names_the_extra(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setitem(sys.modules, "pyspark", None)
    argv = ["spark-drain", "--output", str(tmp_path / "o"), "--checkpoint", str(tmp_path / "c")]
    rc, said = run(argv, capsys, caplog)
    assert rc == 1 and "pip install 'mqlog[spark]'" in said, said
    assert "mqlog spark-drain: error: needs pyspark" in said


def test_streams_against_no_broker_is_one_line(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    rc, said = run(["streams", "--broker", "http://127.0.0.1:9"], capsys, caplog)
    assert rc == 1 and "cannot reach the broker's HTTP API" in said
