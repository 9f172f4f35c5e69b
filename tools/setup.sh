#!/usr/bin/env bash
# Installs what kiln needs on Debian 12 (apt; skipped when already present) and builds it in build/.
# Usage: tools/setup.sh [extra cmake args...]
set -euo pipefail
cd "$(dirname "$0")/.."

# libopenblas0-pthread: Debian's libtorch calls the generic libblas.so.3, which is the slow reference BLAS
# unless OpenBLAS provides it (10x on the muse-tiny forward).
packages=(build-essential cmake ninja-build ccache pkg-config libtorch-dev libopenmpi-dev openmpi-bin
          libopenblas0-pthread libhdf5-dev libyaml-cpp-dev libeigen3-dev libgtest-dev libgmock-dev libbenchmark-dev libfmt-dev
          libspdlog-dev libcli11-dev nlohmann-json3-dev gnuplot-nox libpcre2-dev libutf8proc-dev libcpp-httplib-dev
          python3 python3-protobuf git)
# node and npm fetch and run the text tests' references (tools/fetch_references.sh); a machine
# that already has a node toolchain keeps it.
command -v node >/dev/null || packages+=(nodejs)
command -v npm >/dev/null || packages+=(npm)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  sudo_cmd=""
  [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

export CCACHE_DIR="${CCACHE_DIR:-$PWD/.cache/ccache}"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release "$@"
cmake --build build -j"$(nproc)"
