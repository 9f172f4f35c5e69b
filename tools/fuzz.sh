#!/usr/bin/env bash
# Fuzzes kiln's parsers with libFuzzer (clang, ASan, UBSan): builds the targets of fuzz/ in
# build-fuzz/, runs each for RUNS executions (default 10^6) from its kept corpus, and merges the
# inputs that reached new coverage back into fuzz/corpus/<target> (commit them). A finding stops
# the target and leaves its input as build-fuzz/<target>-crash-*. CI replays the corpora in the
# ordinary build (ctest fuzz_replay_*). Usage: tools/fuzz.sh [target ...]   (RUNS=N, JOBS=N)
set -euo pipefail
cd "$(dirname "$0")/.."
runs="${RUNS:-1000000}"
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(safetensors model_config jsonl tokenizer chat_template recipe)
# clang and libFuzzer's runtime from Debian, installed here when missing (as tools/setup.sh does).
if ! command -v clang++ > /dev/null || ! ls /usr/lib/llvm-*/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a > /dev/null 2>&1; then
  sudo_cmd=""; [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq clang libclang-rt-14-dev
fi
export CCACHE_DIR="${CCACHE_DIR:-$PWD/.cache/ccache}"
mkdir -p build-fuzz
CC=clang CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKILN_FUZZ=ON \
  -DKILN_TESTS=OFF -DKILN_PCH=OFF > build-fuzz/build.log 2>&1 || { tail -20 build-fuzz/build.log; exit 1; }
cmake --build build-fuzz -j"${JOBS:-$(nproc)}" --target "${targets[@]/#/fuzz_}" >> build-fuzz/build.log 2>&1 \
  || { grep -E "error|FAILED" -A3 build-fuzz/build.log | head -40; exit 1; }
status=0
for t in "${targets[@]}"; do
  work="build-fuzz/corpus-$t"
  mkdir -p "$work"
  start=$(date +%s)
  # LeakSanitizer on: a leak is a finding. -timeout: one input past 10 s is a hang.
  if ASAN_OPTIONS=detect_leaks=1 ./build-fuzz/fuzz/fuzz_$t -runs="$runs" -timeout=10 -rss_limit_mb=4096 \
       -max_len=65536 -artifact_prefix="build-fuzz/$t-" -print_final_stats=1 "$work" "fuzz/corpus/$t" \
       > "build-fuzz/$t.log" 2>&1; then
    execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "build-fuzz/$t.log" | grep -o '[0-9]*$')
    ./build-fuzz/fuzz/fuzz_$t -merge=1 "fuzz/corpus/$t" "$work" > "build-fuzz/$t-merge.log" 2>&1
    echo "fuzz $t: $execs executions in $(( $(date +%s) - start )) s, no finding; corpus $(ls "fuzz/corpus/$t" | wc -l) files"
  else
    echo "fuzz $t: FINDING after $(( $(date +%s) - start )) s; see build-fuzz/$t.log:"
    grep -E "ERROR|SUMMARY|terminate|what\(\)|Test unit written" "build-fuzz/$t.log" | head -8
    status=1
  fi
done
exit $status
