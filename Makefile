# Two commands: `make train` (set up, train the embedded default) and `make test`; `make test-unit`
# is the quick tier (no whole trainings, no child processes: tests marked `slow` are left out).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
WORKDIR ?= workdirs/digits_mlp

.PHONY: setup train test test-unit clean

# uv installs the same pinned versions as pip, about 3x faster (parallel downloads and
# installs; bytecode compiled, as pip does); pip does it where uv cannot be had.
$(VENV)/.installed: pyproject.toml constraints.txt
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "dpjax needs Python >= 3.11, found " + sys.version.split()[0]'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet 'uv==0.13.9' \
	  && $(VENV)/bin/uv pip install --quiet --python $(PY) --compile-bytecode \
	     -c constraints.txt -e '.[test]' \
	  || { $(PY) -m pip install --quiet --upgrade pip \
	       && $(PY) -m pip install --quiet -c constraints.txt -e '.[test]'; }
	touch $@

setup: $(VENV)/.installed

train: setup
	$(PY) -m dpjax.train --config configs/digits_mlp.py --workdir $(WORKDIR)

# One worker per core (`-n auto`: two on the 2-core box). Two per core spent 14% more CPU on the
# same tests (processes on one core evict each other's caches) than they gained by filling a core
# while a test waited on a child (2-core box, cold, fresh clone, Nov 27: 439 s and 849 s of CPU
# with two workers, 508 s and 987 s with four).
test: setup
	$(PY) -m pytest -n auto -q

test-unit: setup
	$(PY) -m pytest -n auto -q -m "not slow"

clean:
	rm -rf $(VENV) workdirs
