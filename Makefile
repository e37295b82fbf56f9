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
# Lingvo for tests/op_rules/test_lingvo.py, into .lingvo/ (the test appends it to sys.path): lingvo itself and the
# pure-Python modules and small extensions its import needs (sympy, mpmath; matplotlib and its own imports, as
# lingvo.core.layers imports lingvo.core.plot), each with --no-deps so that no second numpy or TensorFlow lands
# there. A failed install (no network) leaves no .lingvo/ and the test skips.
LINGVO_DIR := .lingvo
LINGVO_STAMP := $(LINGVO_DIR)/.installed-stamp
LINGVO_REQUIREMENTS := lingvo==0.14.2 sympy==1.14.0 mpmath==1.3.0 matplotlib==3.11.2 cycler==0.12.1 \
	fonttools==4.68.0 kiwisolver==1.5.1 contourpy==1.3.3 pyparsing==3.3.3 python-dateutil==4.0.0 six==1.17.0 \
	packaging==26.4 pillow==13.0.0

.PHONY: run test oracle-venv oracle lingvo chromium bazel-test clean

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

$(LINGVO_STAMP): | $(STAMP)
	rm -rf $(LINGVO_DIR)
	$(PY) -m pip install -q --no-deps --target $(LINGVO_DIR) $(LINGVO_REQUIREMENTS) && touch $(LINGVO_STAMP) || \
		{ rm -rf $(LINGVO_DIR); echo "lingvo not installed: tests/op_rules/test_lingvo.py will skip"; }

lingvo: $(LINGVO_STAMP)

# Headless Chromium for tests/test_explore.py's browser tests (Debian's package, as root); without it they skip.
chromium:
	@command -v chromium >/dev/null 2>&1 || { DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium \
		>/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y \
		-q chromium >/dev/null 2>&1; } || echo "chromium not installed: the browser tests of tests/test_explore.py \
		will skip"; }

# XLA's own SPMD partitioner next to tf_gspmd's on every program of tools/oracle_programs.py
oracle: $(STAMP) $(ORACLE_STAMP)
	$(PY) tools/xla_oracle.py

run: $(STAMP)
	$(PY) examples/mlp.py --mesh=2,4 --mode=megatron

# The suites again with every gs.function exchanging through TF's collective ops (the path GPUs and several
# processes take) instead of the in-process graph of one process's CPUs.
COLLECTIVES_SUITES := tests/differential tests/op_rules tests/test_transformer.py tests/test_keras.py \
	tests/parallel/test_pipeline.py tests/test_workloads.py tests/test_function.py tests/test_state.py tests/parallel/test_mpmd.py \
	tests/test_cross_mesh.py tests/parallel/test_auto_parallel.py tests/parallel/test_planned_model.py

# The suites run in JOBS processes (pytest-xdist), each test file in one of them; the tests that start clusters of
# processes against deadlines, or time themselves, run afterwards one at a time, with lingvo's suite (its MoE
# gradients came 1e-6 past their tolerance beside a second test process).
JOBS ?= 2
SERIAL_TESTS := tests/faults tests/test_restart.py tests/test_soak.py tests/test_launch.py tests/platform \
	tests/test_concurrency.py tests/op_rules/test_lingvo.py
PYTEST := $(VENV)/bin/pytest -q -p no:cacheprovider

test: $(STAMP) $(ORACLE_STAMP)
	-$(MAKE) --no-print-directory lingvo
	-$(MAKE) --no-print-directory chromium
	TF_GSPMD_REQUIRE_ORACLE=1 $(PYTEST) -n $(JOBS) --dist loadfile --durations=25 tests \
		$(addprefix --ignore=,$(SERIAL_TESTS))
	$(PYTEST) --durations=10 $(SERIAL_TESTS)
	$(PYTEST) -n $(JOBS) --dist loadfile --durations=10 --exchange=collectives $(COLLECTIVES_SUITES)

bazel-test: $(STAMP)
	PYTHON=$(CURDIR)/$(PY) ../shared/bazel/bazel-offline test //:all --build_manual_tests --local_test_jobs=1 --test_output=errors

clean:
	rm -rf $(VENV) $(ORACLE_VENV) $(LINGVO_DIR) build *.egg-info
