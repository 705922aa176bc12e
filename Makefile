# `make demo` and `make test` work from a bare clone: they create .venv and install what each needs, the demo
# its own extra (scikit-learn, for the digits) and the tests every development tool, TensorFlow and Ray Train.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
DEMO_STAMP := $(VENV)/.paratrain-demo
TEST_STAMP := $(VENV)/.paratrain-test
TEST_EXTRAS := dev,tf,ray

.PHONY: demo test test-fast test-gpu lint bench install clean

# $(call install,EXTRAS): the venv (made once) with paratrain editable and EXTRAS, at constraints-dev.txt's pins
define install
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -c constraints-dev.txt -e '.[$(1)]'
	touch $@
endef

$(DEMO_STAMP): pyproject.toml constraints-dev.txt
	$(call install,demo)

$(TEST_STAMP): pyproject.toml constraints-dev.txt
	$(call install,$(TEST_EXTRAS))

install: $(TEST_STAMP)

demo: $(DEMO_STAMP)
	$(VENV)/bin/paratrain demo

# two workers, a test file each (a file's launched jobs and its module fixtures stay on one worker): the launched
# tests spend half their time waiting (rendezvous, restarts, planted hangs), so two cores do 1.2x the work
test: $(TEST_STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile

# the unit lane: no test here starts a process (tests/helpers/unit_lane.py fails one that does)
test-fast: $(TEST_STAMP)
	PARATRAIN_UNIT_LANE=1 $(PY) -m pytest -q -n 2 --dist loadfile -m "not launched and not slow"

# ruff's checks and its formatter's verdict (CI runs it before the tests); `ruff format .` fixes what it finds
lint: $(TEST_STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# the CUDA and NCCL checks (marker gpu): every world size the machine's GPUs allow (1, 2, 4); the others skip, saying why
test-gpu: $(TEST_STAMP)
	$(PY) -m pytest -m gpu -q -rs

bench: $(TEST_STAMP)
	$(PY) benchmarks/ddp_overhead.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache
