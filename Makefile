# Two commands do all set-up on a fresh machine: `make run` and `make test`.
# Both are idempotent: stamps skip work that is already done.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.stamp

.PHONY: run test lint bench clean

$(PY):
	@echo "Creating $(VENV) (first run only) ..."
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# Runtime install: the project and its dependencies.
# setup.py and the .pyx: the compiled modules (broker/net/_devicelane.pyx, the device path;
# broker/commitlog/_crc.pyx, the batch CRC; broker/commitlog/_smallbatch.pyx, the small batch)
# are rebuilt.
$(STAMP)-run: pyproject.toml setup.py broker/net/_devicelane.pyx broker/commitlog/_crc.pyx broker/commitlog/_smallbatch.pyx scripts/install-system-deps.sh | $(PY)
	@echo "Installing mqlog and its dependencies into $(VENV) (about 10 s; once, until pyproject.toml changes) ..."
	bash scripts/install-system-deps.sh runtime
	$(PY) -m pip install --quiet -e .
	touch $@

# Test install: runtime + test-only packages + the Debian packages the tests drive.
$(STAMP)-test: pyproject.toml setup.py broker/net/_devicelane.pyx broker/commitlog/_crc.pyx broker/commitlog/_smallbatch.pyx scripts/install-system-deps.sh | $(PY)
	bash scripts/install-system-deps.sh
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

run: $(STAMP)-run
	@echo "Starting mqlog on config/broker.toml (Ctrl-C stops it) ..."
	$(VENV)/bin/mqlog serve -c config/broker.toml

lint: $(STAMP)-test
	$(VENV)/bin/ruff check broker spark_sink tests bench examples
	$(VENV)/bin/ruff format --check broker spark_sink tests bench examples
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

# --durations: CI's log names the slowest tests (the suite must stay well under 25 min). The
# unit tests run on two processes (pytest-xdist, one per core here: they share nothing), the
# integration tests one at a time (brokers of two workers, network namespaces, timings).
test: $(STAMP)-test lint
	$(PY) -m pytest -q -n 2 tests/unit --durations=10
	$(PY) -m pytest -q tests/integration --durations=25

# Faster tiers while working (README, "The two commands"): the unit tests without the slow
# ones, on two processes (pytest-xdist, one per core here); then with the integration tests
# on a one-worker broker (MQLOG_TEST_WORKERS=1 drops the [w2] variants), still without Spark
# and slow. `make test` runs everything.
.PHONY: test-unit test-fast
test-unit: $(STAMP)-test
	$(PY) -m pytest -q -n 2 tests/unit -m "not slow"

test-fast: $(STAMP)-test
	MQLOG_TEST_WORKERS=1 $(PY) -m pytest -q tests/unit tests/integration -m "not slow and not spark"

# On demand, not in CI: each benchmark runs its reference in the same run.
bench: $(STAMP)-test
	$(PY) -m pip install --quiet -e '.[test,bench]'
	$(PY) -m bench.codec
	$(PY) -m bench.commitlog
	$(PY) -m bench.mqtt_bench
	$(PY) -m bench.spark_drain

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
