# Two entry points (README): `make study` and `make test`. Both create or reuse .venv.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

.PHONY: env study test clean

# The environment is rebuilt only when the project's dependencies change.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first and exactly 2.13.0: the CPU wheel on this machine, never a CUDA build from a range.
	$(BIN)/pip install --quiet --disable-pip-version-check -c constraints.txt torch==2.13.0
	$(BIN)/pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[test]'
	touch $(STAMP)

env: $(STAMP)

# The main job. Until `ddlscope study paper` exists: the default DDP experiment and its
# summary, after a one-process baseline of the same workload so the summary shows a speedup.
study: env
	$(BIN)/ddlscope run configs/default.toml --strategy single --world-size 1 --name baseline-single --quiet > /dev/null
	$(BIN)/ddlscope run configs/default.toml

test: env
	$(BIN)/python scripts/run_tests.py

clean:
	rm -rf $(VENV) ddlscope.db ddlscope.db-wal ddlscope.db-shm ddlscope-runs
