# kvstore developer entry points. `make run` and `make test` are the README's Quick start.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
SOURCES := pyproject.toml CMakeLists.txt proto/kvstore/v1/kvstore.proto kvstore/_native/copy.c

.PHONY: setup run demo test test-fast bench clean

setup: $(STAMP)

# Editable install: CMake builds the native copy module and generates the gRPC stubs from proto/.
$(STAMP): $(SOURCES)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

# The daemon with embedded defaults (1 GiB arena, unix socket + 127.0.0.1:7070), in the foreground.
run: setup
	$(VENV)/bin/kvstore-server

# A short tour: start a daemon, put and get blocks through the arena, print stats, stop.
demo: setup
	$(PY) -m bench.demo

test: setup
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

bench: setup
	$(PY) -m bench.micro --quick
	$(PY) -m bench.connector --quick

clean:
	rm -rf build $(VENV) .pytest_cache
