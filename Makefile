# Two commands on a fresh machine: `make smoke` (install + run the smoke pipeline) and `make test`.
PYTHON ?= python3
VENV ?= .venv
# CPU build from local disk here; on a CUDA box: make install TORCH="torch" (or keep the torch you have).
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin
export KEDRO_DISABLE_TELEMETRY=1
export MLFLOW_DISABLE_TELEMETRY=1
export DO_NOT_TRACK=1
export TOKENIZERS_PARALLELISM=false

.PHONY: install lock audit smoke full test test-fast test-durations viz mlflow-ui tracking-server benchmark-data clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -c constraints.txt --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt "$(TORCH)"
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[dev]"
	touch $@

# Rebuild the lock (constraints.txt) from a fresh, unconstrained install; then re-run `make audit`.
lock:
	rm -rf .lock-venv && $(PYTHON) -m venv .lock-venv
	.lock-venv/bin/python -m pip install -q --upgrade pip
	.lock-venv/bin/python -m pip install -q "$(TORCH)" -e ".[dev]"
	{ grep '^#' constraints.txt; .lock-venv/bin/python -m pip freeze --all --exclude-editable | sed 's/+cpu$$//'; } > constraints.txt.new
	mv constraints.txt.new constraints.txt && rm -rf .lock-venv

# Offline audit of the lock against security/pypa-advisories.json, then pip-audit against the live service.
audit: install
	$(BIN)/python security/audit.py
	$(BIN)/python security/audit.py --installed
	$(BIN)/python -m pytest -q -m online tests/reliability/test_security.py

smoke: install
	$(BIN)/kedro run --pipelines smoke

full: install
	$(BIN)/kedro run --pipelines full --params gpus=$${GPUS:-4}

# Two workers (pytest-xdist): the suite waits on child processes and servers a good part of the time. Tests that
# share a session fixture run on one worker; the longest go first (tests/conftest.py).
TEST_WORKERS ?= 2
test: install
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

# The inner loop: every test that starts no project run, stage, server or child process (tests/conftest.py says
# which those are); under 2 minutes on a 2-core machine. `make test` (CI) runs everything.
test-fast: install
	$(BIN)/python -m pytest -m "not slow"

# Re-measure each test's seconds in one serial run (tests/durations.json orders the parallel run's work).
test-durations: install
	rm -f .test-durations.jsonl
	LYCHEE_TEST_DURATIONS=.test-durations.jsonl $(BIN)/python -m pytest -p no:xdist
	$(BIN)/python tests/write_durations.py .test-durations.jsonl && rm -f .test-durations.jsonl

viz: install
	PATH=$(abspath $(BIN)):$$PATH $(BIN)/kedro viz run --host 127.0.0.1

mlflow-ui: install
	PATH=$(abspath $(BIN)):$$PATH $(BIN)/kedro mlflow ui --host 127.0.0.1

# A team's MLflow tracking server on 127.0.0.1:$(TRACKING_PORT): PostgreSQL backend store and artifact root under
# .tracking/ (README "For a team"). Foreground; Ctrl-C stops it. Needs PostgreSQL (apt-get install postgresql).
TRACKING_PORT ?= 5000
tracking-server: install
	$(BIN)/python scripts/tracking_server.py --root .tracking --port $(TRACKING_PORT)

benchmark-data: install
	$(BIN)/python benchmarks/data_layer.py

clean:
	rm -rf mlflow.db mlruns .viz build
	find data -mindepth 2 ! -name .gitkeep -delete
