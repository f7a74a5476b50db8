#!/usr/bin/env bash
# Configures and builds csrc/ standalone with CMake in build/cmake (CPU kernels, C++ unit tests,
# and the CUDA kernels where nvcc exists), then runs the unit tests with ctest. Incremental: a
# second run rebuilds only what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=build/cmake
JOBS=${CMAKE_BUILD_PARALLEL_LEVEL:-2}  # 2 cores on CI machines

if [[ ! -f $BUILD/CMakeCache.txt ]]; then
  generator=()
  command -v ninja >/dev/null && generator=(-G Ninja)
  cmake -S . -B "$BUILD" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release
fi
cmake --build "$BUILD" -j "$JOBS"
ctest --test-dir "$BUILD" --output-on-failure
