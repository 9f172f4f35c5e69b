#!/usr/bin/env bash
# The main job: the tiny GRPO demo on the CPU. A supervised warm start (kiln sft), GRPO with
# routing replay from that checkpoint (kiln train), then a plot of reward, accuracy and mismatch
# (kiln plot). Expects tools/setup.sh to have built build/kiln. Usage: tools/demo.sh [run_dir]
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-runs/grpo-arith-tiny}"
recipe=recipes/grpo-arith-tiny.yaml
start=$(date +%s)
./build/kiln sft "$recipe" --out "$out" --overwrite    # ends with the warm start's held-out accuracy; a rerun replaces the last
echo
./build/kiln train "$recipe" --init-from "$out/sft" --out "$out" --overwrite    # ends with GRPO's
echo
./build/kiln plot "$out"
echo "demo: $(( $(date +%s) - start )) s; run directory $out"
