# The two commands of the README: `make run` (the main job) and `make test` (the test suite).
# Both create .venv when missing and install the project into it first.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: run test bazel-test clean

$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

run: $(STAMP)
	$(PY) examples/mlp.py --mesh=2,4 --mode=megatron

test: $(STAMP)
	$(VENV)/bin/pytest -q -p no:cacheprovider tests

bazel-test: $(STAMP)
	PYTHON=$(CURDIR)/$(PY) ../shared/bazel/bazel-offline test //:all --local_test_jobs=1 --test_output=errors

clean:
	rm -rf $(VENV) build *.egg-info
