#!/usr/bin/env bash
# One device call: build kiln against torch's libtorch with CUDA, run the cuda tests (and the cpu
# tests of the same build), the GRPO smoke runs (bf16, NVFP4 rollouts, LoRA) and the benchmarks.
# Four logs go to $OUT when set (the device tool returns at most 8 files): build.log, tests.log,
# grpo.txt, train.txt, bench.txt. KILN_GPU_CHECK=tests,grpo,train,bench (the default) picks sections; also grpostep (the GRPO step's
# phases, fused kernels on and off), optim (bench optim alone, also part of bench), ncu (kernel
# metrics of the fused path's memory-bound kernels, into profile.txt) and calibrate (kiln plan
# against the measured peak memory of muse-small GRPO runs), rollout (issue 20's RL workload, decode
# and the peer's decode, into rollout.txt), rolloutwide (the workload with 512 and 1024 samples
# in flight, rollout.txt), nvfp4 (the GEMMs' cuda tests and bench nvfp4, into
# nvfp4.txt) mismatch (kiln mismatch of muse-small after a short SFT, into mismatch.txt) and
# attention (the paged decode kernels' cuda tests and bench attention, into attention.txt);
# grouped (the grouped W4A16 kernel: kiln_probe_nvfp4's work splits at 8-128 rows per expert and ncu
# of the dispatch's kernel at 32, grouped.txt); experts (bench nvfp4 --grouped: every experts'
# kernel at 32-256 rows per expert, uniform and uneven routing, experts.txt); wgmmancu (ncu of the
# wgmma GEMM on the experts at 256 rows per expert, wgmma.txt); pdl (kiln_probe_pdl: a kernel boundary's cost in a
# graph, plain and with programmatic dependent launch, pdl.txt);
# cudatests runs the cuda tests alone; mpi the MPI tests at 2 CPU ranks with their whole output (mpi.txt);
# mpigpus the MPI tests' CUDA ones at a rank per GPU (NCCL between GPUs: a machine with 2 or more, mpi.txt);
# async the synchronous GRPO step against grpo.async (async.txt); split (grpo.async.placement split
# with two CUDA ranks on the one GPU, split.txt); long (long responses, long.txt),
# tool (the multi-turn calculator recipe on muse-small, tool.txt), bitwise (the GRPO step under
# rollout.numerics: bitwise against the standard numerics, bitwise.txt) and cp (context
# parallelism: its FlashAttention test, a 32K-token step on one GPU, and with 2+ GPUs the MPI CUDA
# tests and kiln bench train --cp at 2, 4 and 8 ranks, cp.txt).
# The train section times kiln's training step against the plain-PyTorch peer (torch_peer.py in
# KILN_PEER_DIR, default .cache/peers: copy it there and carry .cache/peers) and profiles both.
# The machine lacks PCRE2 and utf8proc: run tools/device_deps.sh here first and carry
# .cache/device-deps into the call.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/kiln-gpu}"; mkdir -p "$out"
jobs=$(nproc)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PATH="/usr/local/cuda/bin:$PATH"
sections="${KILN_GPU_CHECK:-tests,grpo,train,bench}"
want() { [[ ",$sections," == *",$1,"* ]]; }
step() { echo; echo "=== $* ($(date +%T))"; }
# tests_then_bench <gtest filter> <bench case> <file>: a kernel family's cuda tests (their verdict
# lines) and then its benchmark, both into $out/<file>.
tests_then_bench() {
  ./build-gpu/tests/kiln_test_cuda --gtest_filter="$1" 2>&1 \
    | grep -E "OK|FAILED|Failure|Expected|Which is|not deterministic|PASSED" | head -80 | tee -a "$out/$3"
  ./build-gpu/kiln bench "$2" --device cuda 2>&1 | tee -a "$out/$3"
}
# symbolize <log> <file>: a crash report's "binary+0xoffset" places (core/crash.h), named by
# addr2line, appended to $out/<file>.
symbolize() {
  for at in $(grep -oE "[^ (]+(\(|)\+0x[0-9a-f]+" "$1" | tr -d '(' | sort -u); do
    local file="${at%+0x*}" off="0x${at##*+0x}"
    [ -f "$file" ] && echo "$at: $(addr2line -f -C -i -e "$file" "$off" | tr '\n' ' ')" | tee -a "$out/$2"
  done
}
# arith_sft <name> <steps> <file>: muse-small's short SFT on two-digit addition (the GPU smoke
# recipe), weights in $tmp/<name>/sft; its last lines to $out/<file>.
arith_sft() {
  sed -e "s|config: ../configs|config: $PWD/configs|" recipes/grpo-arith-small-gpu.yaml > "$tmp/$1.yaml"
  printf 'sft:\n  steps: %s\n  batch_size: 64\n  lr: 0.001\n  lr_decay: cosine\n  min_lr_ratio: 0.1\n' "$2" >> "$tmp/$1.yaml"
  ./build-gpu/kiln sft "$tmp/$1.yaml" --out "$tmp/$1" 2>&1 | tr '\r' '\n' | grep -v "^sft [0-9]" | tail -3 | tee -a "$out/$3"
}
mismatch_report() {  # mismatch_report <metrics.jsonl>: per step, R3 on and off
  python3 - "$1" <<'PY'
import sys, json
rows = [json.loads(l) for l in open(sys.argv[1]) if '"mismatch"' in l]
for m in rows:
    on, off = m["mismatch"], m["mismatch_no_replay"]
    print(f"step {m['step']}: R3 on  mean|dlp| seq {on['mean_abs_seq']:.3e} tok {on['mean_abs_token']:.3e} max {on['max_abs']:.3e} k3 {on['k3_kl']:.3e} out[0.5,2] {on['frac_outside']:.2e}")
    print(f"        R3 off mean|dlp| seq {off['mean_abs_seq']:.3e} tok {off['mean_abs_token']:.3e} max {off['max_abs']:.3e} k3 {off['k3_kl']:.3e} out[0.5,2] {off['frac_outside']:.2e}; routing disagreement {m['routing_disagreement']:.4f}; rollout {m['rollout_seconds']:.2f} s, train {m['train_seconds']:.2f} s")
    if "sync_bytes" in m:
        b, t = m["sync_bytes"], m["sync_seconds"]
        print(f"        sync {b / 1e6:.2f} MB in {t * 1e3:.2f} ms ({m.get('sync_gbps', b / max(t, 1e-9) / 1e9):.1f} GB/s); probe check {m.get('sync_check', -1):.2e}")
PY
}

step environment
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
nvcc --version | tail -1
torch_prefix=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')
python3 -c 'import torch;print("torch", torch.__version__, "cuda", torch.version.cuda)'
cmake --version | head -1

step configure
# PCRE2 and utf8proc (text/) from tools/device_deps.sh, carried into the call: the machine has neither.
if [ -d .cache/device-deps ]; then
  export PKG_CONFIG_PATH="$PWD/.cache/device-deps/usr/lib/x86_64-linux-gnu/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
fi
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DKILN_CUDA=ON \
  -DCMAKE_PREFIX_PATH="$torch_prefix" -DCMAKE_CUDA_ARCHITECTURES=90a "$@" > "$out/configure.log" 2>&1 \
  || { tail -40 "$out/configure.log"; exit 1; }
grep -E "kiln:|Found (Torch|MPI|HDF5|GTest|CUDA)" "$out/configure.log" | tee -a "$out/tests.log"  # -a: a second run in one call keeps the first's

step build
start=$(date +%s)
cmake --build build-gpu -j"$jobs" > "$out/build.log" 2>&1 || { grep -E "error|FAILED" -A5 "$out/build.log" | head -60; exit 1; }
echo "built in $(( $(date +%s) - start )) s"

tmp=$(mktemp -d)
if want cudatests && ! want tests; then  # the cuda tests alone (a kernel change, a short call)
step "ctest -L cuda"
if [ -n "${KILN_CUDA_FILTER:-}" ]; then  # a gtest filter over kiln_test_cuda instead of every cuda test
  ./build-gpu/tests/kiln_test_cuda --gtest_filter="$KILN_CUDA_FILTER" > "$tmp/ctest-cuda.log" 2>&1
  grep -E "^\[  (PASSED|FAILED) |OK \]" "$tmp/ctest-cuda.log" | tee -a "$out/tests.log"
else
(cd build-gpu && ctest -L cuda --output-on-failure > "$tmp/ctest-cuda.log" 2>&1)
fi
grep -E "\*\*\*Failed|Failure|Expected|Which is|elements differ|exception with description" "$tmp/ctest-cuda.log" | head -100 | tee -a "$out/tests.log"
grep -E "tests passed|^\s+[0-9]+ - " "$tmp/ctest-cuda.log" | tee -a "$out/tests.log"
fi
if want mpi; then  # the CPU-rank MPI tests of this build, whole output (a crash prints its backtrace)
step "mpi tests at 2 ranks"
OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 timeout 300 \
  mpiexec --oversubscribe -np 2 ./build-gpu/tests/kiln_test_parallel 2>&1 | grep -vE "^\[ +(RUN|OK) " | tail -80 | tee "$tmp/mpi.log" | tee -a "$out/mpi.txt"
symbolize "$tmp/mpi.log" mpi.txt  # a crash names offsets into files (the test binary, libtorch, ...)
fi
if want mpigpus; then  # a rank per GPU (nvidia-h200-x2 and up): NCCL between ranks, inside captured graphs too
gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | wc -l)
[ "$gpus" -ge 2 ] || echo "mpigpus: $gpus GPU(s) here; NCCL between ranks needs 2 or more" | tee -a "$out/mpi.txt"
step "mpi tests on $gpus GPUs, a rank each: the CUDA ones"
[ "$gpus" -ge 1 ] && OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 timeout 400 \
  mpiexec -np "$gpus" ./build-gpu/tests/kiln_test_parallel \
  --gtest_filter='*Cuda*' 2>&1 | grep -vE "^\[ +(RUN|OK) " | tail -60 | tee "$tmp/mpigpus.log" | tee -a "$out/mpi.txt"
symbolize "$tmp/mpigpus.log" mpi.txt
fi
if want cp; then  # context parallelism (cp.txt): FlashAttention's cp form, a 32K-token step, and cp over the GPUs there are
gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | wc -l)
step "cp: FlashAttention with queries after earlier keys (one GPU)"
./build-gpu/tests/kiln_test_cuda --gtest_filter='CudaTrainFlash.*' 2>&1 | grep -E "OK \]|FAILED|Failure|Expected|Which is|SKIPPED" | tee -a "$out/cp.txt"
step "cp: muse-small train step, 32768 tokens in one sequence, one GPU"
./build-gpu/kiln bench train configs/muse-small.yaml --tokens 32768 --seqs 1 --device cuda --only-fused 2>&1 | tail -6 | tee -a "$out/cp.txt"
./build-gpu/kiln plan configs/muse-small.yaml recipes/grpo-arith-small-gpu.yaml --gpus-per-node 1 --seq-len 32768 2>&1 | head -30 >> "$out/cp.txt"
if [ "$gpus" -ge 2 ]; then
  step "cp: the MPI tests' CUDA ones on $gpus GPUs (NCCL), context parallelism's included"
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 timeout 300 \
    mpiexec -np "$gpus" ./build-gpu/tests/kiln_test_parallel --gtest_filter='*Cuda*' 2>&1 | grep -vE "^\[ +(RUN|OK) " | tail -30 | tee -a "$out/cp.txt"
  for n in 2 4 8; do
    [ "$n" -le "$gpus" ] || break
    step "cp $n: muse-small train step, 32768 tokens in one sequence, against one GPU"
    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 timeout 300 \
      mpiexec -np "$n" ./build-gpu/kiln bench train configs/muse-small.yaml --cp "$n" --tokens 32768 --seqs 1 --device cuda 2>&1 | tail -10 | tee -a "$out/cp.txt"
  done
else
  echo "cp: $gpus GPU(s) here; cp across GPUs needs 2 or more (nvidia-h100-x2)" | tee -a "$out/cp.txt"
fi
fi  # cp
if want tests; then
step "ctest -L cuda"
(cd build-gpu && ctest -L cuda --output-on-failure -V > "$tmp/ctest-cuda.log" 2>&1)
grep -E "bf16|agreement|nvfp4|grouped \+ fused|elements differ|Passed|Failed|tests passed|FAIL|Error|Failure|Expected|Which is|actual|diff" "$tmp/ctest-cuda.log" \
  | head -200 | tee -a "$out/tests.log"
# Left to CI: the CLI run (minutes), the tests against npm references (TokenizerReference, ...
# and TiktokenTest.GptOss*, which read files this machine cannot fetch) and the TensorBoard tests
# that need python3-protobuf, which the machine's /usr/bin/python3 lacks.
step "ctest -L cpu (same CUDA build, less what needs npm, python3-protobuf or minutes: CI runs those)"
(cd build-gpu && OMP_NUM_THREADS=2 ctest -L cpu -E "kiln_cli|Reference|TiktokenTest.GptOss|TensorBoard" -j"$(( jobs / 2 ))" \
  --output-on-failure 2>&1 | tail -15 | tee -a "$out/tests.log")

step "interop: safetensors, h5py and a PyTorch re-implementation read kiln's files"
./build-gpu/kiln init configs/muse-tiny.yaml "$tmp/ckpt" --seed 5 > /dev/null
for o in lp.safetensors lp.h5; do
  ./build-gpu/kiln forward --model "$tmp/ckpt" --tokens "72,101,108,108,111,32,49,43,50,61,51" --tokens "7" \
    --tokens "$(seq -s, 40 100)" --out "$tmp/$o" > /dev/null
done
python3 tests/interop/check_outputs.py "$tmp/ckpt" "$tmp/lp.safetensors" "$tmp/lp.h5" 2>&1 | tee -a "$out/tests.log"
./build-gpu/kiln quantize "$tmp/ckpt" "$tmp/nvfp4" > /dev/null
for o in nv.safetensors nv.h5; do
  ./build-gpu/kiln forward --model "$tmp/nvfp4" --tokens "72,101,108,108,111,32,49,43,50,61,51" --tokens "$(seq -s, 40 100)" \
    --out "$tmp/$o" > /dev/null
done
python3 tests/interop/check_outputs.py "$tmp/nvfp4" "$tmp/nv.safetensors" "$tmp/nv.h5" 2>&1 | tee -a "$out/tests.log"
./build-gpu/kiln generate --model "$tmp/ckpt" --prompt "12+34=" --prompt "ids:1,2,3" -n 3 --max-tokens 9 --quiet --out "$tmp/s.h5"
python3 - "$tmp/s.h5" <<'PY' 2>&1 | tee -a "$out/tests.log"
import sys, h5py, numpy as np
f = h5py.File(sys.argv[1], "r")
n = f["lengths"].shape[0]
assert n == 6 and (np.diff(f["offsets"][:]) == f["lengths"][:]).all()
assert f["tokens"].shape[0] == f["lengths"][:].sum() == f["logprobs"].shape[0]
assert f["routing"].shape[0] == (f["lengths"][:] + f["prompt_lengths"][:]).sum() and f["routing"].dtype == np.uint8
print("interop: h5py reads kiln generate's samples:", {k: f[k].shape for k in f})
PY
fi  # tests

if want grpo; then
step "GRPO smoke run: muse-small, bf16 trainer and rollout, R3 on and off"
./build-gpu/kiln train recipes/grpo-arith-small-gpu.yaml --out "$tmp/small" 2>&1 | tr '\r' '\n' | grep -v "^step " | tail -5
mismatch_report "$tmp/small/metrics.jsonl" | tee -a "$out/grpo.txt"
step "GRPO mismatch with an NVFP4 rollout: muse-small from an NVFP4 checkpoint, bf16 trainer dequantised from it"
./build-gpu/kiln init configs/muse-small.yaml "$tmp/small-bf16" --device cuda > /dev/null
./build-gpu/kiln quantize "$tmp/small-bf16" "$tmp/small-nvfp4" --device cuda
for q in none nvfp4 w4a4; do
  sed "s/^  quantization: nvfp4 /  quantization: $q /" recipes/grpo-arith-small-nvfp4-gpu.yaml > "$tmp/nv-$q.yaml"
  sed -i "s|config: ../configs|config: $PWD/configs|" "$tmp/nv-$q.yaml"
  ./build-gpu/kiln train "$tmp/nv-$q.yaml" --init-from "$tmp/small-nvfp4" --out "$tmp/nv-$q" 2>&1 | tr '\r' '\n' | grep -v "^step " | tail -2
  echo "rollout quantization: $q" | tee -a "$out/grpo.txt"
  mismatch_report "$tmp/nv-$q/metrics.jsonl" | tee -a "$out/grpo.txt"
done
# W4A4 with dynamic per-token activation scales: a checkpoint without input scales.
./build-gpu/kiln quantize "$tmp/small-bf16" "$tmp/small-nvfp4-dyn" --device cuda --no-calibrate > /dev/null
./build-gpu/kiln train "$tmp/nv-w4a4.yaml" --init-from "$tmp/small-nvfp4-dyn" --out "$tmp/nv-w4a4-dyn" 2>&1 | tr '\r' '\n' | grep -v "^step " | tail -2
echo "rollout quantization: w4a4, dynamic per-token scales (--no-calibrate)" | tee -a "$out/grpo.txt"
mismatch_report "$tmp/nv-w4a4-dyn/metrics.jsonl" | tee -a "$out/grpo.txt"
step "LoRA GRPO on the NVFP4 base: rank 32, alpha 64, adapter-only sync"
sed "s|config: ../configs|config: $PWD/configs|" recipes/grpo-arith-small-nvfp4-gpu.yaml > "$tmp/lora.yaml"
printf 'lora:\n  rank: 32\n  alpha: 64\n' >> "$tmp/lora.yaml"
./build-gpu/kiln train "$tmp/lora.yaml" --init-from "$tmp/small-nvfp4" --out "$tmp/lora" 2>&1 | tr '\r' '\n' | grep -v "^step " | tail -2
echo "LoRA rank 32 on the NVFP4 rollout" | tee -a "$out/grpo.txt"
mismatch_report "$tmp/lora/metrics.jsonl" | tee -a "$out/grpo.txt"
fi  # grpo
if want grpostep; then
step "GRPO step phases: muse-small, 16 prompts x 8 samples x 128 tokens, fused kernels on and off"
for fused in true false; do
  sed -e "s|config: ../configs|config: $PWD/configs|" -e "s/^  max_tokens: .*/  max_tokens: 128/" \
      -e "s/^  mismatch_ab: .*/  mismatch_ab: false\n  fused_kernels: $fused/" -e "s/^  every: .*/  every: 1000/" \
      -e "s/^  steps: .*/  steps: 4/" recipes/grpo-arith-small-gpu.yaml > "$tmp/step-$fused.yaml"
  ./build-gpu/kiln train "$tmp/step-$fused.yaml" --out "$tmp/step-$fused" 2>&1 | tr '\r' '\n' | grep -v "^step " | tail -2
  python3 - "$tmp/step-$fused/metrics.jsonl" "fused_kernels: $fused" <<'PY' 2>&1 | tee -a "$out/grpo.txt"
import sys, json, statistics as st
rows = [json.loads(l) for l in open(sys.argv[1]) if '"step_seconds"' in l][1:]  # the first step warms up
keys = ["rollout_seconds", "reward_seconds", "lp_old_seconds", "train_seconds", "sync_seconds"]
med = {k: st.median(r.get(k, 0.0) for r in rows) for k in keys}
total = st.median(r["step_seconds"] for r in rows)
toks = st.median(r.get("tokens", 0) for r in rows)
print(f"{sys.argv[2]}: step {total*1e3:.0f} ms (median of {len(rows)}), {toks:.0f} tokens; " +
      ", ".join(f"{k.split('_')[0]} {med[k]*1e3:.0f} ms ({100*med[k]/total:.1f}%)" for k in keys) +
      f", other {1e3*(total-sum(med.values())):.0f} ms")
PY
done
fi  # grpostep
if want calibrate; then
step "kiln plan against measured peaks: muse-small GRPO (bf16; LoRA; optimizer state in CPU memory, on NVMe; NVFP4 rollout)"
for v in ${KILN_CALIBRATE:-base lora cpu nvme nvfp4}; do  # a variant ending in 64: micro-batches of 64
  sed -e "s|config: ../configs|config: $PWD/configs|" -e "s/^  every: .*/  every: 1000/" -e "s/^  steps: .*/  steps: 3/" \
      -e "s/^  mismatch_ab: .*/  mismatch_ab: false/" recipes/grpo-arith-small-gpu.yaml > "$tmp/cal-$v.yaml"
  [ "$v" = cpu ] && sed -i "s/^optim:/optim:\n  state: cpu/" "$tmp/cal-$v.yaml"
  [ "$v" = nvme ] && mkdir -p "$tmp/cal-nvme-state" && sed -i "s|^optim:|optim:\n  state: nvme\n  nvme_dir: $tmp/cal-nvme-state|" "$tmp/cal-$v.yaml"
  [[ "$v" == *64 ]] && sed -i "s/^  micro_batch_seqs: .*/  micro_batch_seqs: 64/" "$tmp/cal-$v.yaml"
  [[ "$v" == lora* ]] && printf 'lora:\n  rank: 32\n  alpha: 64\n' >> "$tmp/cal-$v.yaml"
  [ "$v" = nvfp4 ] && sed -i "s/^rollout:/rollout:\n  quantization: nvfp4/" "$tmp/cal-$v.yaml"  # quantised from the bf16 init
  # The trainer's own memory line (what each part allocated) goes to calibrate.txt beside the plan.
  ./build-gpu/kiln train "$tmp/cal-$v.yaml" --out "$tmp/cal-$v" 2>&1 | tr '\r' '\n' | grep -v "^step " \
    | grep -E "device memory|train: done|rror" | sed "s/^/$v: /" | tee -a "$out/calibrate.txt" | tail -1
  seq=$(python3 -c "import json,sys; r=[json.loads(l) for l in open('$tmp/cal-$v/metrics.jsonl') if '\"tokens\"' in l]; print(max(1, round(max(x['tokens'] for x in r) / 128)))")
  ./build-gpu/kiln plan configs/muse-small.yaml "$tmp/cal-$v.yaml" --gpus-per-node 1 --seq-len "$seq" > "$tmp/plan-$v.txt"
  { echo "== $v"; cat "$tmp/plan-$v.txt"; } >> "$out/calibrate.txt"  # the plan's items, to set against the phases
  planned=$(grep -m1 "total, of" "$tmp/plan-$v.txt" | awk '{print $1, $2}')
  python3 - "$tmp/cal-$v/metrics.jsonl" "$v" "$seq" "$planned" <<'PY' 2>&1 | tee -a "$out/grpo.txt" "$out/calibrate.txt"
import sys, json
rows = [json.loads(l) for l in open(sys.argv[1]) if '"peak_memory_gb"' in l]
top = max(rows, key=lambda r: r["peak_memory_gb"])
gib = lambda gb: gb * 1e9 / 2**30
peak = gib(top["peak_memory_gb"])
n, unit = sys.argv[4].split()
plan = float(n) * {"GiB": 1, "MiB": 1 / 1024, "TiB": 1024}[unit] + 2.0  # + the recipe's 2 GiB KV cache
print(f"calibration {sys.argv[2]}: measured peak {peak:.2f} GiB, planned {plan:.2f} GiB (with the KV cache), "
      f"planned / measured {plan / peak:.3f} (sequences of {sys.argv[3]} tokens); phases of step {top['step']}: " +
      ", ".join(f"{k} {gib(v):.2f} GiB" for k, v in top.get("phase_peak_gb", {}).items()) +
      f"; allocated after it {gib(top.get('memory_after_gb', 0)):.2f} GiB")
tm = top.get("train_memory_gb")
if tm:
    print(f"  train phase of step {top['step']}: allocated at its start {gib(tm['start']):.2f} GiB, forwards and backwards "
          f"peak {gib(tm['backward']):.2f} GiB (+{gib(tm['backward'] - tm['start']):.2f}), clipping and optimizer peak "
          f"{gib(tm['optimizer']):.2f} GiB (+{gib(tm['optimizer'] - tm['start']):.2f})")
PY
  rm -rf "$tmp/cal-$v" "$tmp/cal-nvme-state"  # each run's weights (and the NVMe state, 17 GB): the disk is 64 GiB
done
fi  # calibrate
if want ncu; then
step "ncu: the fused path's MoE row kernels and RMSNorm backward on the full-width layer"
for k in "moe_expand:2" "moe_reduce:2" "rms_norm_backward:6"; do
  ncu --kernel-name "regex:${k%%:*}" --launch-count "${k##*:}" --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section Occupancy --section LaunchStats ./build-gpu/kiln bench train configs/muse-full-layer.yaml --device cuda \
    --only-fused 2>&1 | grep -vE "^==PROF==|^train step|^ +path" | tee -a "$out/profile.txt" | grep -E "Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Grid Size|Block Size|Registers" | head -60
done
fi  # ncu
if want train; then
step "bench train (muse-small, 8 x 1024 packed tokens) against the plain-PyTorch peer, eager and compiled"
./build-gpu/kiln bench train configs/muse-small.yaml --device cuda --profile "$tmp/kiln-train.json" 2>&1 | tee -a "$out/train.txt"
peer="${KILN_PEER_DIR:-.cache/peers}"
if [ -f "$peer/torch_peer.py" ]; then
  PYTHONUNBUFFERED=1 python3 "$peer/torch_peer.py" train 2>&1 | tee -a "$out/train.txt"
  python3 tools/peer_ratio.py "$out/train.txt" 2>&1 | tee -a "$out/train.txt"
  PYTHONUNBUFFERED=1 python3 tools/profile_peer.py "$peer" "$tmp" 2>&1 | tail -2
  step "bench train, one full-width latent-MoE layer (configs/muse-full-layer.yaml) against the peer's layer, eager"
  ./build-gpu/kiln bench train configs/muse-full-layer.yaml --device cuda --profile "$tmp/kiln-full.json" 2>&1 | tee "$tmp/full.txt" | tee -a "$out/train.txt"
  PYTHONUNBUFFERED=1 python3 tools/peer_layer.py "$peer" 2>&1 | tee -a "$tmp/full.txt" | tee -a "$out/train.txt"
  python3 tools/peer_ratio.py "$tmp/full.txt" "full-width layer, kiln / peer" 2>&1 | tee -a "$out/train.txt"
else
  echo "no peer in $peer (copy torch_peer.py and muse_torch.py there): no ratio measured" | tee -a "$out/train.txt"
fi
for t in kiln-train peer-eager peer-compiled kiln-full; do
  [ -f "$tmp/$t.json" ] && python3 tools/profile_summary.py "$tmp/$t.json" --label "$t" 2>&1 | tee -a "$out/profile.txt"
done
fi  # train

if want bench; then
step "bench rmsnorm"
./build-gpu/kiln bench rmsnorm --device cuda 2>&1 | tee -a "$out/bench.txt"
step "bench nvfp4 (W4A16 GEMMs vs BF16)"
./build-gpu/kiln bench nvfp4 --device cuda 2>&1 | tee -a "$out/bench.txt"
step "probe nvfp4 (the M = 1 GEMM's schedules, loaders, and memory and compute halves)"
./build-gpu/kiln_probe_nvfp4 2>&1 | tee -a "$out/bench.txt"
step "bench decode (muse-small)"
./build-gpu/kiln bench decode --device cuda --config configs/muse-small.yaml --len 1024 --gen 32 2>&1 | tee -a "$out/bench.txt"
step "bench decode (muse-small, NVFP4 W4A16 weights, against the bf16 engine)"
./build-gpu/kiln bench decode --device cuda --config configs/muse-small.yaml --len 1024 --gen 32 --quantization nvfp4 2>&1 | tee -a "$out/bench.txt"
step "bench forward (muse-small)"
./build-gpu/kiln bench forward --device cuda --config configs/muse-small.yaml --seqs 8 --len 1024 2>&1 | tee -a "$out/bench.txt"
fi  # bench
if want rollout; then
# The RL workload (issue 20): BF16 and NVFP4 engines, then the decode bench and the plain-PyTorch
# peer's eager decode (static KV cache) in the same call for the ratio. KILN_ROLLOUT_ARGS overrides
# the shape (default: the issue's 128 prompts x 8 samples, 256-token prompts, 1024 new tokens).
step "bench rollout (muse-small, BF16 and NVFP4)"
./build-gpu/kiln bench rollout --device cuda --config configs/muse-small.yaml --quantization nvfp4 \
  --profile "$tmp/rollout" ${KILN_ROLLOUT_ARGS:-} 2>&1 | tee -a "$out/rollout.txt"
for q in none nvfp4; do
  [ -f "$tmp/rollout-$q.json" ] && python3 tools/profile_summary.py "$tmp/rollout-$q.json" --label "decode-$q" --steps 5 2>&1 | tee -a "$out/profile.txt"
done
step "bench decode (muse-small, BF16 and NVFP4)"
./build-gpu/kiln bench decode --device cuda --config configs/muse-small.yaml --len 1024 --gen 32 --quantization nvfp4 \
  2>&1 | tee -a "$out/rollout.txt"
# With KILN_ROLLOUT_GEMM=wgmma, splitk or stagedtiles, the same two again with that NVFP4 GEMM
# choice (--nvfp4-gemm: wgmma everywhere above 16 rows; split-K where the experts take the
# grouped staged kernel, 17-192 rows per expert; or that kernel's tiled launch there, also at
# 17-64 where the default launches it per expert), in the same call. Off by default: each run
# costs device time.
if [ -n "${KILN_ROLLOUT_GEMM:-}" ]; then
step "bench rollout and decode, NVFP4 with --nvfp4-gemm $KILN_ROLLOUT_GEMM"
./build-gpu/kiln bench rollout --device cuda --config configs/muse-small.yaml --nvfp4-gemm "$KILN_ROLLOUT_GEMM" \
  --quantization nvfp4 ${KILN_ROLLOUT_ARGS:-} 2>&1 | tee -a "$out/rollout.txt"
./build-gpu/kiln bench decode --device cuda --config configs/muse-small.yaml --nvfp4-gemm "$KILN_ROLLOUT_GEMM" \
  --len 1024 --gen 32 --quantization nvfp4 2>&1 | tee -a "$out/rollout.txt"
fi
peer="${KILN_PEER_DIR:-.cache/peers}"
if [ -f "$peer/torch_peer.py" ]; then
  step "peer decode, eager (plain PyTorch, static KV cache)"
  PEER_BATCHES=1,16,64 PEER_DECODE=eager PYTHONUNBUFFERED=1 python3 "$peer/torch_peer.py" decode 2>&1 | tee -a "$out/rollout.txt"
fi
fi  # rollout
if want rolloutwide; then
# The same RL workload with more sequences in flight (KILN_ROLLOUT_WIDE, default 512 and 1024:
# half and all of the 1024 samples, as an RL job would configure the engine), BF16 and NVFP4,
# into rollout.txt. At 512, muse-small's NVFP4 experts get 64 rows each, 79 by the MoE's padded
# bound; at 1024, 128 and 143: both within the staged kernel's 192.
for seqs in ${KILN_ROLLOUT_WIDE:-512 1024}; do
  step "bench rollout, $seqs sequences at once (muse-small, BF16 and NVFP4)"
  ./build-gpu/kiln bench rollout --device cuda --config configs/muse-small.yaml --quantization nvfp4 \
    --max-seqs "$seqs" 2>&1 | tee -a "$out/rollout.txt"
done
fi  # rolloutwide
if want nvfp4; then
# The W4A16 GEMMs alone: their cuda tests and bench nvfp4 (every dense kernel against cuBLAS).
step "nvfp4: cuda tests of the GEMMs, then bench nvfp4"
tests_then_bench 'CudaNvfp4*' nvfp4 nvfp4.txt
fi  # nvfp4
if want experts; then
# The experts' W4A16 kernels alone at muse-small's 64 x 1024 x 1024 stacks: 256-2048 tokens x 8
# (32-256 rows per expert), each batch routed uniformly and unevenly, against the BF16 grouped GEMM.
step "experts: bench nvfp4 --grouped"
./build-gpu/kiln bench nvfp4 --device cuda --grouped ${KILN_EXPERTS_TOKENS:-256 512 1024 2048} 2>&1 | tee -a "$out/experts.txt"
fi  # experts
if want grouped; then
# Where the grouped W4A16 kernel's time goes on the experts' decode and rollout shapes (8 to 64
# rows per expert): the probe's other work splits and register budgets, then ncu of the
# dispatch's kernel at 32 rows per expert (the probe at 256 tokens x 8), into grouped.txt.
step "grouped W4A16: probe, then ncu at 32 rows per expert"
./build-gpu/kiln_probe_nvfp4 grouped 2>&1 | tee -a "$out/grouped.txt"
ncu --kernel-name-base demangled --kernel-name 'regex:grouped_kernel<\(int\)4, \(int\)4, \(bool\)0, \(bool\)1, \(int\)3>' --launch-count 1 \
  --set full ./build-gpu/kiln_probe_nvfp4 grouped 256 2>&1 | grep -vE "^==PROF==" > "$tmp/ncu-grouped.txt"
sed -n '/grouped_kernel/,$p' "$tmp/ncu-grouped.txt" | head -400 >> "$out/grouped.txt"
grep -E "Duration|DRAM Throughput|L1/TEX Hit|L2 Hit|L2 Cache Throughput|Achieved Occupancy|Registers|Stall|Issued Warp|Warp Cycles" \
  "$tmp/ncu-grouped.txt" | head -40
fi  # grouped
if want wgmmancu; then
# ncu of the wgmma W4A16 GEMM on muse-small's experts at 256 rows per expert (two warpgroups,
# 128-token tiles): where a stage's ~2,000 cycles go, against ~512 for its wgmmas at peak.
step "wgmma W4A16: ncu at 2048 x 8"
ncu --kernel-name-base mangled --kernel-name 'regex:wgmma_kernelILi128ELi2E' --launch-count 1 --set full \
  ./build-gpu/kiln bench nvfp4 --device cuda --grouped 2048 2>&1 | grep -vE "^==PROF==" > "$tmp/ncu-wgmma.txt"
sed -n '/wgmma_kernel/,$p' "$tmp/ncu-wgmma.txt" | head -500 > "$out/wgmma.txt"
grep -E "Duration|Throughput|Achieved Occupancy|Registers|Stall|Issued Warp|Warp Cycles" "$out/wgmma.txt" | head -40
fi  # wgmmancu
if want pdl; then
# What a kernel boundary costs inside a CUDA graph (a decode step has ~230): chains of decode-sized
# GEMVs and tiny kernels, plain and with programmatic dependent launch, into pdl.txt.
step "pdl: kernel chains in a graph, plain and with programmatic dependent launch"
./build-gpu/kiln_probe_pdl 2>&1 | tee -a "$out/pdl.txt"
fi  # pdl
if want attention; then
# Paged decode attention (issue 20): its cuda tests (every kernel against the reference on odd
# sizes) and bench attention (tensor cores against SIMT, and both against the copy bandwidth).
step "attention: cuda tests of the paged decode kernels, then bench attention"
tests_then_bench 'CudaPagedAttention*' attention attention.txt
fi  # attention
if want async; then
# Issue 23: asynchronous GRPO (grpo.async.max_staleness 1) against the synchronous step on the same
# recipe: muse-small, 64 prompts x 8 samples x 32 tokens, TIS on in both; steps per hour and rewards.
# Both runs start from the same short SFT (KILN_ASYNC_SFT_STEPS, default 30: 300 steps reach 98% and
# leave the reward nothing to gain), so that the reward curve moves.
step "async GRPO: SFT warm start, then synchronous vs max_staleness 1"
arith_sft async-sft "${KILN_ASYNC_SFT_STEPS:-30}" async.txt
for k in off 1; do
  sed -e "s|config: ../configs|config: $PWD/configs|" -e "s/^  prompts_per_step: .*/  prompts_per_step: 64/" \
      -e "s/^  max_tokens: .*/  max_tokens: 32/" -e "s/^  mismatch_ab: .*/  mismatch_ab: false/" \
      -e "s/^  every: .*/  every: 1000/" -e "s/^  steps: .*/  steps: ${KILN_ASYNC_STEPS:-30}/" \
      -e "s/^  aggregation: token-mean/  aggregation: token-mean\n  tis: true/" recipes/grpo-arith-small-gpu.yaml > "$tmp/async-$k.yaml"
  [ "$k" != off ] && sed -i "s/^  mismatch_ab: false/  mismatch_ab: false\n  async:\n    max_staleness: $k/" "$tmp/async-$k.yaml"
  ./build-gpu/kiln train "$tmp/async-$k.yaml" --init-from "$tmp/async-sft/sft" --out "$tmp/async-$k" 2>&1 | tr '\r' '\n' | grep -v "^step " | tail -2
  python3 - "$tmp/async-$k/metrics.jsonl" "max_staleness $k" <<'PY' 2>&1 | tee -a "$out/async.txt"
import sys, json, statistics as st
rows = [json.loads(l) for l in open(sys.argv[1]) if '"step_seconds"' in l]
warm = rows[2:] if len(rows) > 4 else rows
med = lambda k: st.median(r.get(k, 0.0) for r in warm)
print(f"{sys.argv[2]}: step {med('step_seconds')*1e3:.0f} ms median of {len(warm)} (after 2 warm-up steps), "
      f"{3600 / med('step_seconds'):.0f} steps/hour; rollout {med('rollout_seconds')*1e3:.0f} ms, lp_old "
      f"{med('lp_old_seconds')*1e3:.0f} ms, train {med('train_seconds')*1e3:.0f} ms, sync {med('sync_seconds')*1e3:.0f} ms, "
      f"waited for the batch {st.median(r.get('async', {}).get('wait_seconds', 0.0) for r in warm)*1e3:.0f} ms")
print("  staleness per step:", [r.get("async", {}).get("staleness", "-") for r in rows])
print("  reward per step:   ", [round(r["reward"], 3) for r in rows])
PY
done
rm -rf "$tmp"/async-*  # each run's checkpoints (weights and fp32 optimizer state) fill the disk otherwise
fi  # async
if want split; then
# Issue 23: grpo.async.placement split on CUDA ranks. Two ranks share the one GPU: rank 0 trains and
# rank 1 rolls out for it, the batches and the weights going between them over MPI. muse-small,
# 64 prompts x 8 samples x 32 tokens, k = 1, from a random init; each step's phases and exchanges.
step "async GRPO, placement split: two CUDA ranks on one GPU"
sed -e "s|config: ../configs|config: $PWD/configs|" -e "s/^  prompts_per_step: .*/  prompts_per_step: 64/" \
    -e "s/^  max_tokens: .*/  max_tokens: 32/" -e "s/^  mismatch_ab: .*/  mismatch_ab: false\n  async: {max_staleness: 1, placement: split}/" \
    -e "s/^  every: .*/  every: 1000/" -e "s/^  prompts: 64/  prompts: 8/" -e "s/^  steps: .*/  steps: 8/" \
    -e "s/^  aggregation: token-mean/  aggregation: token-mean\n  tis: true/" recipes/grpo-arith-small-gpu.yaml > "$tmp/split.yaml"
OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=4 timeout 400 \
  mpiexec --oversubscribe -np 2 ./build-gpu/kiln train "$tmp/split.yaml" --out "$tmp/split" 2>&1 | tr '\r' '\n' \
  | sed 's/^step [0-9]*\/[0-9]* .*\(kiln: error\)/\1/' | grep -v "^step [0-9]*/" | tail -40 | tee "$tmp/split.log" | tee -a "$out/split.txt"
df -h "$tmp" | tail -1 | tee -a "$out/split.txt"
symbolize "$tmp/split.log" split.txt  # a crash names offsets into files
python3 - "$tmp/split/metrics.jsonl" <<'PY' 2>&1 | tee -a "$out/split.txt"
import sys, json
for r in (json.loads(l) for l in open(sys.argv[1]) if '"step_seconds"' in l):
    a = r.get("async", {})
    print(f"step {r['step']}: {r['step_seconds']*1e3:.0f} ms (rollout {r['rollout_seconds']*1e3:.0f}, lp_old "
          f"{r['lp_old_seconds']*1e3:.0f}, train {r['train_seconds']*1e3:.0f}, weights out {r['sync_seconds']*1e3:.0f} ms "
          f"for {r['sync_bytes']/1e6:.0f} MB), staleness {a.get('staleness')}, trainer waited {a.get('wait_seconds', 0)*1e3:.0f} ms, "
          f"rollout waited {a.get('rollout_wait_seconds', 0)*1e3:.0f} ms, sync check {r.get('sync_check', -1):.2e}, reward {r['reward']:.3f}")
PY
fi  # split
if want bitwise; then
# Issue 22: what rollout.numerics: bitwise costs against the standard numerics on the same recipe:
# muse-small in bf16, KILN_BITWISE_PROMPTS prompts (default "16 64", each in turn) x 8 samples x 16
# tokens, mismatch with replay on and off; per step the phases and both mismatches (0 under
# bitwise), then the ratios of the steps after the first. bitwise runs the invariant GEMMs on their
# default (wgmma on the H200), bitwise-mma on mma.sync (--bitwise-gemm mma; KILN_BITWISE_MODES
# picks the modes).
for prompts in ${KILN_BITWISE_PROMPTS:-16 64}; do
step "bitwise numerics: the GRPO step, standard vs bitwise, $prompts prompts x 8"
echo "$prompts prompts x 8:" >> "$out/bitwise.txt"
for mode in ${KILN_BITWISE_MODES:-standard bitwise bitwise-mma}; do
  gemm=auto; [ "$mode" = bitwise-mma ] && gemm=mma
  sed -e "s|config: ../configs|config: $PWD/configs|" -e "s/^  prompts_per_step: .*/  prompts_per_step: $prompts/" \
      -e "s/^  every: .*/  every: 1000/" -e "s/^  prompts: 64/  prompts: 8/" -e "s/^  steps: .*/  steps: 4/" \
      -e "s/^  kv_cache_mb: .*/  kv_cache_mb: 2048\n  numerics: ${mode%-mma}/" recipes/grpo-arith-small-gpu.yaml > "$tmp/bitwise-$mode.yaml"
  rm -rf "$tmp/bitwise-$mode"
  timeout 240 ./build-gpu/kiln train "$tmp/bitwise-$mode.yaml" --out "$tmp/bitwise-$mode" --bitwise-gemm $gemm 2>&1 | tr '\r' '\n' | grep -v "^step " | tail -2
  python3 - "$tmp/bitwise-$mode/metrics.jsonl" "$mode" <<'PY' 2>&1 | tee -a "$out/bitwise.txt"
import sys, json
for r in (json.loads(l) for l in open(sys.argv[1]) if '"step_seconds"' in l):
    print(f"{sys.argv[2]} step {r['step']}: {r['step_seconds']:.2f} s (rollout {r['rollout_seconds']:.2f}, lp_old "
          f"{r['lp_old_seconds']:.2f}, train {r['train_seconds']:.2f}); max|d| R3 on {r['mismatch']['max_abs']:.3e}, "
          f"off {r['mismatch_no_replay']['max_abs']:.3e}; lp_old from the rollout: {r.get('lp_old_from_rollout', False)}")
PY
done
for gemm in ${KILN_BITWISE_MODES:-bitwise bitwise-mma}; do
[ "$gemm" = standard ] || [ ! -f "$tmp/bitwise-$gemm/metrics.jsonl" ] && continue
python3 - "$tmp/bitwise-standard/metrics.jsonl" "$tmp/bitwise-$gemm/metrics.jsonl" "$gemm" <<'PY' 2>&1 | tee -a "$out/bitwise.txt"
import sys, json
def mean(path, key):  # steps after the first (warm-up)
    rows = [json.loads(l) for l in open(path) if '"step_seconds"' in l][1:]
    return sum(r[key] for r in rows) / max(1, len(rows))
for key in ("step_seconds", "rollout_seconds", "lp_old_seconds", "train_seconds"):
    s, b = mean(sys.argv[1], key), mean(sys.argv[2], key)
    print(f"{key[:-8]:>8}: standard {s:.3f} s, {sys.argv[3]} {b:.3f} s, {sys.argv[3]} / standard {b / s:.2f}x")
PY
done
done
# The invariant GEMMs alone at the GRPO step's shapes and a decode step's: mma.sync, wgmma, cuBLAS.
step "bitwise numerics: bench invariant, 19456 rows"
./build-gpu/kiln bench invariant configs/muse-small.yaml --device cuda --tokens 19456 2>&1 | tee -a "$out/bitwise.txt"
step "bitwise numerics: bench train, 512 sequences x 38 tokens, GEMMs on mma.sync"
./build-gpu/kiln bench train configs/muse-small.yaml --device cuda --seqs 512 --tokens 19456 \
  --only-fused --bitwise --bitwise-gemm mma 2>&1 | tee -a "$out/bitwise.txt"
# The training step alone at the GRPO step's shape (64 prompts x 8 samples of about 38 tokens):
# the fused path against bitwise in one run, and where the bitwise step's kernel time goes.
step "bitwise numerics: bench train, 512 sequences x 38 tokens, profiled"
./build-gpu/kiln bench train configs/muse-small.yaml --device cuda --seqs 512 --tokens 19456 --only-fused --bitwise \
  --profile "$tmp/bitwise-train.json" 2>&1 | tee -a "$out/bitwise.txt"
[ -f "$tmp/bitwise-train.json" ] && python3 tools/profile_summary.py "$tmp/bitwise-train.json" --label bitwise-train --top 25 2>&1 | tee -a "$out/bitwise.txt"
# The rollout at the GRPO step's shape (64 prompts x 8, short prompts, 16 new tokens), BF16 against
# bitwise, and where a bitwise decode step goes (graph steps).
step "bitwise numerics: bench rollout, 64 prompts x 8, profiled"
./build-gpu/kiln bench rollout configs/muse-small.yaml --device cuda --prompts 64 --samples 8 --len 32 --gen 16 \
  --max-seqs 512 --bitwise --profile "$tmp/rollout-bw" 2>&1 | tee -a "$out/bitwise.txt"
[ -f "$tmp/rollout-bw-bitwise.json" ] && python3 tools/profile_summary.py "$tmp/rollout-bw-bitwise.json" --label bitwise-decode --steps 5 --top 20 2>&1 | tee -a "$out/bitwise.txt"
fi  # bitwise
if want long; then
# Issue 23: long responses. muse-small GRPO whose samples run to max_tokens (a random init rarely
# stops), 4 prompts x 4 samples, activations recomputed in the backward; per length: the step's
# phases, peak memory, the engine's preemptions and KV-cache peak.
for n in ${KILN_LONG_TOKENS:-8192 32768}; do
  step "long responses: $n tokens"
  sed -e "s|config: ../configs|config: $PWD/configs|" -e "s/^  prompts_per_step: .*/  prompts_per_step: 4/" \
      -e "s/^  samples_per_prompt: .*/  samples_per_prompt: 4/" -e "s/^  max_tokens: .*/  max_tokens: $n/" \
      -e "s/^  mismatch_ab: .*/  mismatch_ab: false\n  recompute: true/" -e "s/^  micro_batch_seqs: .*/  micro_batch_seqs: 1/" \
      -e "s/^  kv_cache_mb: .*/  kv_cache_mb: ${KILN_LONG_KV_MB:-8192}/" -e "s/^  max_num_seqs: .*/  max_num_seqs: 16/" \
      -e "s/^  every: .*/  every: 1000/" -e "s/^  prompts: 64/  prompts: 4/" -e "s/^  steps: .*/  steps: ${KILN_LONG_STEPS:-2}/" \
      recipes/grpo-arith-small-gpu.yaml > "$tmp/long-$n.yaml"  # the final eval: 4 prompts (64 x 8K tokens took minutes)
  ./build-gpu/kiln train "$tmp/long-$n.yaml" --out "$tmp/long-$n" 2>&1 | tr '\r' '\n' | grep -v "^step " | tail -2 | tee -a "$out/long.txt"
  python3 - "$tmp/long-$n/metrics.jsonl" "$n" <<'PY' 2>&1 | tee -a "$out/long.txt"
import sys, json
for r in (json.loads(l) for l in open(sys.argv[1]) if '"step_seconds"' in l):
    e = r.get("rollout_engine", {})
    print(f"max_tokens {sys.argv[2]} step {r['step']}: {r['step_seconds']:.1f} s (rollout {r['rollout_seconds']:.1f}, "
          f"lp_old {r['lp_old_seconds']:.1f}, train {r['train_seconds']:.1f}), {r['tokens']} tokens, mean response "
          f"{r['response_length']:.0f}, truncated {r['truncated_fraction']:.2f}, peak memory {r['peak_memory_gb']:.1f} GB, "
          f"preemptions {e.get('preemptions')}, KV peak {e.get('kv_peak', 0):.2f}, mismatch {r['mismatch']['mean_abs_token']:.2e}")
PY
done
fi  # long
if want tool; then
# Issue 23: the multi-turn tool recipe learns on the GPU. muse-small gets the demo's SFT warm start
# (direct answers), then 50 GRPO steps of episodes with the calculator environment.
step "tool: muse-small SFT warm start, then ${KILN_TOOL_STEPS:-50} multi-turn GRPO steps"
sed -e "s|config: ../configs/muse-tiny.yaml|config: $PWD/configs/muse-small.yaml|" -e "s/^  dtype: fp32/  dtype: bf16\n  device: cuda/" \
    -e "s/^  steps: 160 .*/  steps: ${KILN_SFT_STEPS:-300}/" -e "s/^  steps: 100/  steps: ${KILN_TOOL_STEPS:-50}/" \
    -e "s/^  lr: 0.0004 .*/  lr: 1.0e-5/" -e "s/^  lr: 0.003 .*/  lr: 0.001/" -e "s/^  kv_cache_mb: .*/  kv_cache_mb: 12288/" \
    -e "s/^  every: 25/  every: 10/" -e "s|python3, calculator_env.py|python3, $PWD/recipes/calculator_env.py|" \
    recipes/grpo-tool-tiny.yaml > "$tmp/tool.yaml"
./build-gpu/kiln sft "$tmp/tool.yaml" --out "$tmp/tool" 2>&1 | tr '\r' '\n' | grep -v "^sft [0-9]" | tail -2 | tee -a "$out/tool.txt"
# SIGTERM after KILN_TOOL_SECONDS (default 420) so that a run longer than the call still reports
# its curve: kiln checkpoints and exits cleanly on the signal.
timeout -s TERM "${KILN_TOOL_SECONDS:-420}" ./build-gpu/kiln train "$tmp/tool.yaml" --init-from "$tmp/tool/sft" \
  --out "$tmp/tool" > "$tmp/tool-train.log" 2>&1
echo "kiln train exited with $?" | tee -a "$out/tool.txt"
tr '\r' '\n' < "$tmp/tool-train.log" | grep -v "^step " | tail -40 | tee -a "$out/tool.txt"
symbolize "$tmp/tool-train.log" tool.txt
python3 - "$tmp/tool/metrics.jsonl" <<'PY' 2>&1 | tee -a "$out/tool.txt"
import sys, json
rows = [json.loads(l) for l in open(sys.argv[1])]
steps = [r for r in rows if '"step_seconds"' in json.dumps(r)]
print("reward per step:", [round(r["reward"], 3) for r in steps])
print("turns per episode:", [round(r.get("episodes", {}).get("turns", 0), 2) for r in steps])
print("tool calls per episode:", [round(r.get("reward_components", {}).get("tool_calls", 0), 2) for r in steps])
print("held-out mean@1:", [(r["step"], round(r["eval"]["mean_at_k"], 3)) for r in rows if "eval" in r])
print("seconds per step:", [round(r["step_seconds"], 1) for r in steps])
PY
fi  # tool
if want mismatch; then
# Issues 20 and 22: the train-vs-rollout gap of a trained model, not of a random init. muse-small
# gets a short SFT on two-digit addition (KILN_SFT_STEPS, default 300), then `kiln mismatch` samples
# 256 prompts x 8 from BF16, NVFP4 (W4A16) and W4A4 (dynamic per-token scales) rollouts of those
# same weights and rescores every token with the bf16 trainer, R3 on and off. No weight changes.
step "mismatch: muse-small after ${KILN_SFT_STEPS:-300} SFT steps"
arith_sft sft "${KILN_SFT_STEPS:-300}" mismatch.txt
python3 -c 'import random; r = random.Random(7)
for _ in range(256): print("{\"prompt\": \"%d+%d=\"}" % (r.randint(10, 99), r.randint(10, 99)))' > "$tmp/prompts.jsonl"
for q in none nvfp4 w4a4; do
  step "kiln mismatch, rollout weights $q" | tee -a "$out/mismatch.txt"
  ./build-gpu/kiln mismatch --model "$tmp/sft/sft" --prompts "$tmp/prompts.jsonl" -n 8 --max-tokens 8 --stop 10 \
    --dtype bf16 --device cuda --quantization $q --kv-cache-mb 4096 --max-num-seqs 256 --quiet 2>&1 \
    | tee -a "$out/mismatch.txt"
done
# A rank-32 LoRA adapter from 4 GRPO steps on that SFT, bf16 rollout: applied unmerged by both
# sides, then served merged (the gap merging makes).
sed -e "s|config: ../configs|config: $PWD/configs|" -e "s/^  steps: .*/  steps: 4/" -e "s/^  lr: 1.0e-5/  lr: 2.0e-3/" \
  recipes/grpo-arith-small-gpu.yaml > "$tmp/mm-lora.yaml"  # the adapters' learning rate, as the LoRA recipes
printf 'lora:\n  rank: 32\n  alpha: 64\n' >> "$tmp/mm-lora.yaml"
./build-gpu/kiln train "$tmp/mm-lora.yaml" --init-from "$tmp/sft/sft" --out "$tmp/mm-lora" 2>&1 | tr '\r' '\n' | grep -v "^step " | tail -1
for merged in "" --lora-merged; do
  step "kiln mismatch, bf16 rollout, LoRA ${merged:-unmerged}" | tee -a "$out/mismatch.txt"
  ./build-gpu/kiln mismatch --model "$tmp/sft/sft" --lora "$tmp/mm-lora/adapter" $merged --prompts "$tmp/prompts.jsonl" \
    -n 8 --max-tokens 8 --stop 10 --dtype bf16 --device cuda --kv-cache-mb 4096 --max-num-seqs 256 --quiet 2>&1 \
    | tee -a "$out/mismatch.txt"
done
fi  # mismatch
if want bench || want optim; then
step "bench optim (muse-small; NVMe state under /tmp)"
mkdir -p /tmp/kiln-nvme
./build-gpu/kiln bench optim --device cuda --config configs/muse-small.yaml --nvme-dir /tmp/kiln-nvme 2>&1 | tee -a "$out/bench.txt"
rm -rf /tmp/kiln-nvme
fi  # optim
rm -rf "$tmp"
step done
