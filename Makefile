# `make demo` and `make test` work from a bare clone: they create .venv and install what they need.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.paratrain-installed

.PHONY: demo test bench install clean

$(STAMP): pyproject.toml constraints-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -c constraints-dev.txt -e '.[dev,tf]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/paratrain demo

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) benchmarks/ddp_overhead.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache
