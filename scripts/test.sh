#!/usr/bin/env bash
# Builds kvferry and runs every test. The README's test command; CI runs it too (.ci/run).
#
#   scripts/test.sh            install packages, build (build/), run ctest, the Python tests of the
#                              vLLM connector (.venv from scripts/install-python.sh), then the
#                              transport tests and the Python module's tests again on UCX 1.22
#                              (the libucx-cu13 wheel, build-ucx122/), the core and wire tests under AddressSanitizer +
#                              UndefinedBehaviorSanitizer (build-asan/), and a bounded fuzz run
#                              when clang is present.
#
# Environment: JOBS (default: nproc), KVFERRY_SKIP_ASAN=1, KVFERRY_SKIP_UCX_WHEEL=1,
# KVFERRY_SKIP_FUZZ=1, FUZZ_SECONDS.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install-deps.sh

jobs=${JOBS:-$(nproc)}
export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo}

# The Python environment first: the build compiles kvferry._native against it.
scripts/install-python.sh

echo "== build (build/, with the Python module kvferry._native)"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVFERRY_PYTHON=ON \
  -DPython_EXECUTABLE="$PWD/.venv/bin/python" \
  -Dpybind11_DIR="$(.venv/bin/python -m pybind11 --cmakedir)" >/dev/null
cmake --build build -j "$jobs"

echo "== tests"
(cd build && ctest --output-on-failure -j "$jobs" --timeout 300)

echo "== python: kvferry._native and the vLLM connector against vLLM's real scheduler"
.venv/bin/python -m pytest -q python/tests

if [ "${KVFERRY_SKIP_UCX_WHEEL:-0}" != 1 ]; then
  # The data plane on a current UCX as well: users' UCX is rarely Debian's 1.13. The wheel's
  # libraries come by the test binaries' RPATH, and its transport modules from beside them.
  # The Python module too: built so, it is the GPU-direct build of docs/vllm.md.
  echo "== transport tests and kvferry._native on UCX 1.22 (the libucx-cu13 wheel; build-ucx122/)"
  ucx_dir=$(.venv/bin/python -c 'import libucx, os; print(os.path.join(os.path.dirname(libucx.__file__), "lib", "cmake", "ucx"))')
  cmake -S . -B build-ucx122 -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVFERRY_BENCH=OFF \
    -DKVFERRY_MODULES="core;wire;protocol;control;transport;runtime" -DKVFERRY_PYTHON=ON \
    -DPython_EXECUTABLE="$PWD/.venv/bin/python" \
    -Dpybind11_DIR="$(.venv/bin/python -m pybind11 --cmakedir)" -Ducx_DIR="$ucx_dir" >/dev/null
  cmake --build build-ucx122 -j "$jobs" --target kvferry_transport_tests kvferry_native
  # The same soname as Debian's: make sure the tests load the wheel's (LD_LIBRARY_PATH, searched
  # before RUNPATH, could hand them Debian's and this stage would test 1.13 twice).
  # (ldd's output taken whole first: `grep -q` quits at its first match, and under pipefail the
  # SIGPIPE that leaves ldd with turned a found library into a failure in one CI run.)
  for binary in build-ucx122/tests/transport/kvferry_transport_tests \
                build-ucx122/python/kvferry/_native.*.so; do
    libs=$(ldd "$binary")
    if ! grep -q 'libucx/lib/libucp.so' <<<"$libs"; then
      echo "test.sh: $binary does not load the wheel's libucp" >&2
      grep -i ucp <<<"$libs" >&2
      exit 1
    fi
  done
  (cd build-ucx122 && ctest --output-on-failure -j "$jobs" --timeout 300 -L transport)
  KVFERRY_BUILD_DIR=build-ucx122 KVFERRY_EXPECT_UCX=1.22 .venv/bin/python -m pytest -q \
    python/tests/test_native.py \
    python/tests/test_vllm_worker.py::test_a_gpu_direct_cache_reaches_the_data_plane_as_cuda_memory_which_refuses_it_here
fi

if [ "${KVFERRY_SKIP_ASAN:-0}" != 1 ]; then
  echo "== sanitizers: core, wire, protocol and simulator tests under ASan + UBSan (build-asan/)"
  cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DKVFERRY_SANITIZE=ON \
    -DKVFERRY_BENCH=OFF -DKVFERRY_MODULES="core;wire;protocol;sim" >/dev/null
  cmake --build build-asan -j "$jobs"
  (cd build-asan && ctest --output-on-failure -j "$jobs" --timeout 300)
fi

if [ "${KVFERRY_SKIP_FUZZ:-0}" != 1 ] && command -v clang++ >/dev/null && [ -x scripts/fuzz.sh ]; then
  echo "== bounded fuzzing of every decoder"
  scripts/fuzz.sh
fi
echo "== all tests passed"
