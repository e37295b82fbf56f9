# The two commands of the README: `make run` (the main job) and `make test` (the test suite).
# Both create .venv when missing and install the project into it first; `make test` also creates .venv-oracle,
# the separate virtualenv of XLA's own partitioner (jax[cpu]) that tools/xla_oracle.py runs as a subprocess: the
# project itself never imports jax.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
ORACLE_VENV := .venv-oracle
ORACLE_STAMP := $(ORACLE_VENV)/.installed-stamp
ORACLE_REQUIREMENT := jax[cpu]==0.10.2

.PHONY: run test oracle-venv oracle bazel-test clean

$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

$(ORACLE_STAMP):
	test -x $(ORACLE_VENV)/bin/python || $(PYTHON) -m venv $(ORACLE_VENV)
	$(ORACLE_VENV)/bin/python -m pip install -q "$(ORACLE_REQUIREMENT)"
	touch $(ORACLE_STAMP)

oracle-venv: $(ORACLE_STAMP)

# XLA's own SPMD partitioner next to tf_gspmd's on every program of tools/oracle_programs.py
oracle: $(STAMP) $(ORACLE_STAMP)
	$(PY) tools/xla_oracle.py

run: $(STAMP)
	$(PY) examples/mlp.py --mesh=2,4 --mode=megatron

# The suites again with every gs.function exchanging through TF's collective ops (the path GPUs and several
# processes take) instead of the in-process graph of one process's CPUs.
COLLECTIVES_SUITES := tests/differential tests/op_rules tests/test_transformer.py tests/test_keras.py \
	tests/test_pipeline.py tests/test_workloads.py tests/test_function.py tests/test_state.py tests/test_mpmd.py \
	tests/test_cross_mesh.py tests/test_auto_parallel.py

test: $(STAMP) $(ORACLE_STAMP)
	TF_GSPMD_REQUIRE_ORACLE=1 $(VENV)/bin/pytest -q -p no:cacheprovider tests
	$(VENV)/bin/pytest -q -p no:cacheprovider --exchange=collectives $(COLLECTIVES_SUITES)

bazel-test: $(STAMP)
	PYTHON=$(CURDIR)/$(PY) ../shared/bazel/bazel-offline test //:all --local_test_jobs=1 --test_output=errors

clean:
	rm -rf $(VENV) $(ORACLE_VENV) build *.egg-info
