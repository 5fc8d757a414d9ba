# Two commands for a fresh machine:  make demo   and   make test
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# The test and demo targets run on the CPU (a CUDA plugin without a GPU only adds noise);
# set JAX_PLATFORMS yourself to override.
export JAX_PLATFORMS ?= cpu

.PHONY: demo test venv clean

$(VENV)/.installed-base: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed-base pyproject.toml
	$(PIP) install --quiet -e '.[test,gpu,plot]'
	touch $@

venv: $(VENV)/.installed-base

$(VENV)/.installed-plot: $(VENV)/.installed-base pyproject.toml
	$(PIP) install --quiet -e '.[plot]'
	touch $@

# the main job, quick sizes (≤ 5 minutes on 2 cores): validation/validation.md and its plots
demo: $(VENV)/.installed-plot
	$(VENV)/bin/moajax derive attention
	$(VENV)/bin/moajax validate --out validation

# one pytest worker per core (pytest-xdist): the suite is compile-bound, one XLA compile per core
test: $(VENV)/.installed-test
	$(PY) -m pytest -q -n auto

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis validation
