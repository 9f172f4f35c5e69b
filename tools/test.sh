#!/usr/bin/env bash
# Runs the CPU test suite (ctest label cpu) of the build in build/.
set -euo pipefail
cd "$(dirname "$0")/../build"
ctest -L cpu --output-on-failure -j"$(nproc)" "$@"
