#!/usr/bin/env bash
# A real job: chat prompts in JSONL, a Hugging Face tokenizer and its chat template, and a Python
# reward worker. Fetches the Qwen3 tokenizer (tools/fetch_references.sh), writes the chat dataset
# (recipes/make_arith_chat.py), then kiln sft, kiln train and kiln plot.
# Usage: tools/demo_chat.sh [recipe] [run_dir]   (default: the CPU recipe grpo-chat-tiny-qwen3;
# recipes/grpo-chat-small-qwen3-gpu.yaml is the GPU one). Expects tools/setup.sh to have built build/kiln.
set -euo pipefail
cd "$(dirname "$0")/.."
recipe="${1:-recipes/grpo-chat-tiny-qwen3.yaml}"
out="${2:-runs/$(basename "$recipe" .yaml)}"
start=$(date +%s)
tools/fetch_references.sh > /dev/null
python3 recipes/make_arith_chat.py runs/arith-chat
./build/kiln sft "$recipe" --out "$out" --overwrite
echo
./build/kiln train "$recipe" --init-from "$out/sft" --out "$out" --overwrite
echo
if command -v gnuplot > /dev/null; then ./build/kiln plot "$out"; fi
echo "demo_chat: $(( $(date +%s) - start )) s; run directory $out"
