#!/usr/bin/env bash
# The supported torch range, tested: for each torch, its own virtualenv, the extension built
# against it, then the compat subset of the tests.
#
#   make compat                                    # COMPAT_TORCH="2.11.0 2.13.0 2.14.0 2.15.0"
#   make compat COMPAT_TORCH=2.11.0                # one version
#   COMPAT_TESTS="tests/common/test_bindings.py" make compat COMPAT_TORCH=2.15.0
#   make compat COMPAT_TORCH= COMPAT_TRANSFORMERS=5.19.0   # the lowest Transformers only
#
# The supported Transformers range the same way ([Note: the Transformers range]): for each
# COMPAT_TRANSFORMERS version (default: the lowest, 5.19.0), a virtualenv .compat/transformers-V
# with the local torch and that Transformers in place of the default environment's pin, then the
# same steps; results in docs/compat/transformers-V.txt.
#
# Per version (each step says what it runs):
#   .compat/torch-V/        a virtualenv: torch==V, then verl[verl-core] and the dev requirements
#                           through uv with requirements/verl-overrides.txt, torch pinned to V
#   build/compat-torch-V/   the extension, built without build isolation and without a CUDA
#                           toolkit in sight of the build ([Note: no CUDA toolkit needed]) when
#                           COMPAT_HIDE_CUDA=1 (default where `unshare` works: a private mount
#                           namespace with an empty tmpfs over the toolkit and CUDA_HOME unset)
#   ctest                   the C++ core's tests against that torch
#   pytest COMPAT_TESTS     every C++ entry point (bindings), the FSDP2 internals, the sharded init
#                           and its faults, host sharing, the checkpoint load, positions, the
#                           spec's files, VERL's TrainingWorker and main_ppo, HSDP, the resharded
#                           resume
#   torchrun                the spec's distributed test
# Results: docs/compat/torch-V.txt (the versions, each step's outcome, pytest's summary line).
#
# Torch: 2.13.0 is taken as the Makefile takes it (this machine's CPU wheel, through pip's own
# configuration); any other version from PyPI with pip's configuration set aside
# (PIP_CONFIG_FILE=/dev/null), because this machine caps torch at the builds on its disk. A CUDA
# build runs its CPU paths here. ~5 GB of disk per CUDA build.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VERSIONS=${COMPAT_TORCH-2.11.0 2.13.0 2.14.0 2.15.0}
TRANSFORMERS_VERSIONS=${COMPAT_TRANSFORMERS-5.19.0}
LOCAL_TORCH=${COMPAT_LOCAL_TORCH:-2.13.0}
VERL_VERSION=${VERL_VERSION:-0.9.1}
TESTS=${COMPAT_TESTS:-tests/common/test_bindings.py tests/common/test_fsdp2_internals.py tests/init/test_sharded_init.py \
tests/init/test_sharded_init_faults.py tests/init/test_transport.py tests/tables/test_host_shared.py tests/checkpoint/test_model_checkpoint_load.py \
tests/init/test_meta_build.py tests/init/test_hub_kernels.py tests/common/test_transformers_version.py tests/checkpoint/test_safetensors_source.py tests/common/test_positions.py \
tests/test_protocol_v2_on_cpu.py tests/utils tests/verl/test_verl.py \
tests/verl/test_verl_engine.py::test_tied_qwen2_is_bit_identical_to_verl_alone tests/verl/test_main_ppo.py \
tests/init/test_hsdp.py tests/verl/test_resume_reshard.py}
HIDE_CUDA=${COMPAT_HIDE_CUDA:-1}
CUDA_DIRS=${COMPAT_CUDA_DIRS:-/usr/local/cuda /usr/local/cuda-13.0}
mkdir -p docs/compat .compat
status=0

hidden() {  # runs "$@" with the CUDA toolkit out of sight (private mount namespace)
  if [ "$HIDE_CUDA" = 1 ] && command -v unshare >/dev/null && unshare -m true 2>/dev/null; then
    local mounts=""
    for d in $CUDA_DIRS; do [ -d "$d" ] && mounts="$mounts mount -t tmpfs none $(readlink -f "$d");"; done
    [ -e /usr/local/bin/nvcc ] && mounts="$mounts mount --bind /dev/null /usr/local/bin/nvcc;"
    env -u CUDA_HOME -u CUDA_PATH unshare -m bash -c "$mounts ! command -v nvcc >/dev/null || ! nvcc --version >/dev/null 2>&1 || { echo 'nvcc still visible' >&2; exit 1; }; \"\$@\"" _ "$@"
  else
    "$@"
  fi
}

# Each entry: torch-V (torch V, the default Transformers) or transformers-V (the local torch,
# Transformers V).
ENTRIES=""
for v in $VERSIONS; do ENTRIES="$ENTRIES torch-$v"; done
for t in $TRANSFORMERS_VERSIONS; do ENTRIES="$ENTRIES transformers-$t"; done

for entry in $ENTRIES; do
  case $entry in
    torch-*) v=${entry#torch-}; tf="" ;;
    transformers-*) v=$LOCAL_TORCH; tf=${entry#transformers-} ;;
  esac
  venv=.compat/$entry
  py=$ROOT/$venv/bin/python
  out=docs/compat/$entry.txt
  log=.compat/$entry.log
  : >"$log"
  echo "== $entry (torch $v${tf:+, transformers $tf}): $venv (log: $log)"
  step() {  # step NAME COMMAND...: runs it, records the outcome
    local name=$1; shift
    echo "-- $name" | tee -a "$log"
    if "$@" >>"$log" 2>&1; then echo "$name: ok" >>"$out.partial"; return 0; fi
    echo "$name: FAILED (see $log)" | tee -a "$out.partial"; status=1; return 1
  }
  rm -f "$out.partial"
  {
    echo "# torch $v${tf:+, transformers $tf}, $(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo " + uncommitted changes")"
  } >"$out.partial"
  install_torch() {
    test -x "$py" || python3 -m venv "$venv"
    "$py" -m pip install -q --upgrade pip uv
    if [ "$v" = "$LOCAL_TORCH" ]; then "$py" -m pip install -q "torch==$v"
    else PIP_CONFIG_FILE=/dev/null "$py" -m pip install -q "torch==$v"; fi
  }
  install_deps() {
    sed "s/^torch==.*/torch==$v/" requirements/verl-overrides.txt >"$venv/overrides.txt"
    [ -z "$tf" ] || sed -i "s/^transformers==.*/transformers==$tf/" "$venv/overrides.txt"
    "$ROOT/$venv/bin/uv" pip install -q --python "$py" --override "$venv/overrides.txt" \
      "verl[verl-core]==$VERL_VERSION" -r requirements/dev.txt
  }
  build() {
    hidden "$py" -m pip install -q --no-build-isolation --no-deps \
      -C build-dir="build/compat-$entry/wheel" .
  }
  ctest_run() {
    hidden cmake -S . -B "build/compat-$entry/cpp" -DFSDP2_BUILD_PYTHON=OFF -DFSDP2_BUILD_TESTS=ON \
      -DPython_EXECUTABLE="$py" && cmake --build "build/compat-$entry/cpp" -j 2 \
      && ctest --test-dir "build/compat-$entry/cpp" --output-on-failure
  }
  pytest_run() {
    "$py" -m pytest -q -p no:cacheprovider --durations=10 $TESTS
  }
  torchrun_run() {
    PYTHONPATH=. "$py" -m torch.distributed.run --standalone --nproc-per-node=2 \
      tests/special_distributed/test_fsdp2_full_state_load.py
  }
  if [ -f "$venv/.installed-$v" ] || { step "install torch $v" install_torch && step "install verl $VERL_VERSION and dev requirements${tf:+ (transformers $tf)}" install_deps && touch "$venv/.installed-$v"; }; then
    "$py" -c "import torch, transformers, verl; print('versions: torch', torch.__version__, '(cuda', str(torch.version.cuda) + ')', 'transformers', transformers.__version__, 'verl', verl.__version__)" >>"$out.partial" 2>&1
    if step "build (no CUDA toolkit visible: $HIDE_CUDA)" build; then
      step "ctest" ctest_run
      grep -h "fsdp2_ext: torch" "$log" | tail -1 | sed 's/^-- /configure: /' >>"$out.partial"
      step "pytest (compat subset)" pytest_run
      grep -E "(passed|failed).* in [0-9.]+s" "$log" | tail -1 | sed 's/^/pytest: /' >>"$out.partial"
      step "torchrun (spec's distributed test)" torchrun_run
    fi
  fi
  mv "$out.partial" "$out"
  cat "$out"
done
exit $status
