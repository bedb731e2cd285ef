# Two entry points (README): `make study` and `make test`. Both create or reuse .venv.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

.PHONY: env study test browser clean

# The environment is rebuilt only when the project's dependencies change.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first and exactly 2.13.0: the CPU wheel on this machine, never a CUDA build from a range.
	$(BIN)/pip install --quiet --disable-pip-version-check -c constraints.txt torch==2.13.0
	$(BIN)/pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[test]'
	touch $(STAMP)

env: $(STAMP)

# The main job: the main study's quick variant (5-6 minutes on 2 idle cores, plus 1.5 for a fresh install), its summary on the
# terminal and its HTML report in paper-report.html.
study: env
	$(BIN)/ddlscope study paper --quick

test: env
	$(BIN)/python scripts/run_tests.py

# Debian's chromium for the report's browser test (skipped, with its reason, without it).
browser:
	command -v chromium >/dev/null || { apt-get update -q && apt-get install -y -q chromium; }

clean:
	rm -rf $(VENV) ddlscope.db ddlscope.db-wal ddlscope.db-shm ddlscope-runs
