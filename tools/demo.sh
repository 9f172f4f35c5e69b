#!/usr/bin/env bash
# The main job (until the GRPO demo lands): plan the full 816B model, then build muse-tiny and
# run a forward pass on the CPU. Expects tools/setup.sh to have built build/kiln.
set -euo pipefail
cd "$(dirname "$0")/.."
./build/kiln info configs/muse-spark-open-816b.yaml
echo
./build/kiln init configs/muse-tiny.yaml out/muse-tiny --seed 0
./build/kiln forward --model out/muse-tiny --tokens "$(printf '%d,' $(echo -n '12+34=46' | od -An -tu1) | sed 's/,$//')"
