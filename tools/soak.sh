#!/usr/bin/env bash
# The soak test: muse-tiny GRPO on the CPU for many steps, rollouts async, scored by reward workers
# that crash every 80-120 requests and now and then hang past their timeout. It samples the run's
# resident memory, open file descriptors and child processes every second and counts the workers'
# restarts from metrics.jsonl. Then a run of up to 60 steps of the same recipe is killed at a
# random step and resumed, and its metrics (times and worker counters aside) must equal an
# uninterrupted one's: its checkpoints keep the batches made ahead. Exit 0 when all hold.
# Usage: tools/soak.sh [steps, default 2000] [out dir, default /tmp/kiln-soak] [kiln binary]
# (the kiln_soak ctest runs 24 steps; docs/RELIABILITY.md has the figures of the long run).
set -uo pipefail
steps=${1:-2000}
out=${2:-/tmp/kiln-soak}
kiln=$(realpath "${3:-build/kiln}")
src=$(cd "$(dirname "$0")/.." && pwd)
every=$(( steps >= 200 ? steps / 10 : 10 ))  # checkpoints: a kill loses less than this
rm -rf "$out" && mkdir -p "$out"

# The share of digits in the first line (an untrained model's rewards differ, so every step
# trains); the crash point and the hangs are drawn per process, so a request's reward never
# depends on which worker scored it (a retried request scores the same).
cat > "$out/worker.py" <<'PY'
import json, os, random, sys, time
rng = random.Random(os.getpid())
crash_at, seen = rng.randint(80, 120), 0
for line in sys.stdin:
    req = json.loads(line)
    seen += 1
    if seen == crash_at:
        os._exit(3)
    if rng.random() < 1 / 400:
        time.sleep(30)  # past timeout_s: killed and restarted, the request sent again
    first = req["response"].split("\n")[0]
    digits = sum(c.isdigit() for c in first) / max(len(first), 1)
    print(json.dumps({"id": req["id"], "reward": digits}), flush=True)
PY
cat > "$out/recipe.yaml" <<YAML
model:
  config: $src/configs/muse-tiny.yaml
  seed: 0
  dtype: fp32
data:
  task: arithmetic
  difficulty: 2
  num_problems: 2000
grpo:
  prompts_per_step: 8
  samples_per_prompt: 4
  max_tokens: 5
  async:
    max_staleness: 1
optim:
  lr: 0.0004
  micro_batch_seqs: 32
rollout:
  kv_cache_mb: 16
reward:
  type: worker
  command: [python3, $out/worker.py]
  num_workers: 2
  timeout_s: 2
  max_retries: 4
  max_restarts: 32
  on_failure: zero
eval:
  every: 0
  prompts: 16
run:
  steps: $steps
  checkpoint_every: $every
  tensorboard: false
YAML

# sample <pid> <file>: every second while the run lives, "seconds rss_kib fds children".
sample() {
  local pid=$1 t=0
  while kill -0 "$pid" 2>/dev/null; do
    local rss fds kids
    rss=$(awk '/^VmRSS/ {print $2}' "/proc/$pid/status" 2>/dev/null) || break
    fds=$(ls "/proc/$pid/fd" 2>/dev/null | wc -l)
    kids=$(pgrep -P "$pid" | wc -l)
    echo "$t ${rss:-0} $fds $kids" >> "$2"
    sleep 1
    t=$((t + 1))
  done
}

fails=0
start=$(date +%s)
"$kiln" train "$out/recipe.yaml" --out "$out/whole" > "$out/whole.log" 2>&1 &
pid=$!
sample "$pid" "$out/samples.txt"
wait "$pid" || { echo "soak: the run failed:"; tail -5 "$out/whole.log"; exit 1; }
seconds=$(( $(date +%s) - start ))

# The short runs (async too): one whole, one killed (SIGKILL, no checkpoint of its own) at a
# random step after its first checkpoint and resumed to the end.
short=$(( steps < 60 ? steps : 60 ))
sed -e "s/^  steps: .*/  steps: $short/; s/^  checkpoint_every: .*/  checkpoint_every: 10/" \
  "$out/recipe.yaml" > "$out/short.yaml"
"$kiln" train "$out/short.yaml" --out "$out/short" > "$out/short.log" 2>&1 \
  || { echo "soak: the short run failed:"; tail -5 "$out/short.log"; exit 1; }
kill_at=$(( 11 + RANDOM % (short - 11) ))
"$kiln" train "$out/short.yaml" --out "$out/killed" > "$out/killed.log" 2>&1 &
pid=$!
logged() { local n; n=$(grep -c '"reward"' "$out/killed/metrics.jsonl" 2>/dev/null); echo "${n:-0}"; }
while kill -0 "$pid" 2>/dev/null && [ "$(logged)" -lt "$kill_at" ]; do
  sleep 0.2
done
kill -9 "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
pkill -9 -f "$out/worker.py" 2>/dev/null  # the killed run's workers (their stdin closes too)
"$kiln" train "$out/short.yaml" --resume "$out/killed" > "$out/resumed.log" 2>&1 \
  || { echo "soak: the resume failed:"; tail -5 "$out/resumed.log"; fails=$((fails + 1)); }

python3 - "$out" "$steps" "$seconds" "$kill_at" <<'PY' || fails=$((fails + 1))
import json, sys
out, steps, seconds, kill_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rows = [list(map(int, l.split())) for l in open(f"{out}/samples.txt")]
rows = [r for r in rows if r[3] > 0] or rows  # the shutdown (workers gone) left out
warm = rows[len(rows) // 10:] or rows  # after warm-up: the first tenth of the run left out
rss = [r[1] for r in warm]; fds = [r[2] for r in warm]; kids = [r[3] for r in warm]
def untimed(j):  # a metrics object without times, memory and the workers' counters, at any depth
    if not isinstance(j, dict):
        return j
    return {k: untimed(v) for k, v in j.items()
            if not any(s in k for s in ("seconds", "per_second", "gbps", "_gb", "reward_worker"))}
def training(path):  # each step's line, untimed
    return [untimed(json.loads(line)) for line in open(path) if '"reward"' in line]
whole = [json.loads(l) for l in open(f"{out}/whole/metrics.jsonl") if '"reward"' in l]
restarts = sum(j.get("reward_worker", {}).get("restarts", 0) for j in whole)
timeouts = sum(j.get("reward_worker", {}).get("timeouts", 0) for j in whole)
answered = sum(j.get("reward_worker", {}).get("answered", 0) for j in whole)
failures = sum(j.get("reward_failures", 0) for j in whole)
# A step's own allocations swing the resident set by a few percent; growth shows in its level: the
# mean over each tenth of the run after warm-up.
tenth = max(1, len(warm) // 9)
levels = [sum(rss[i:i + tenth]) / len(rss[i:i + tenth]) for i in range(0, len(rss), tenth)]
growth = (max(levels) - min(levels)) / min(levels)
print(f"soak: {len(whole)} steps in {seconds} s; resident memory after warm-up {min(rss) / 1024:.1f}-{max(rss) / 1024:.1f} MiB, "
      f"its level (the mean of each tenth) {min(levels) / 1024:.1f}-{max(levels) / 1024:.1f} MiB ({100 * growth:.1f}% apart); open fds {min(fds)}-{max(fds)} (usually {sorted(fds)[len(fds) // 2]}); children {min(kids)}-{max(kids)}; "
      f"{answered} requests answered, {restarts} worker restarts, {timeouts} timeouts, {failures} failed samples; "
      f"an async run killed at step {kill_at} and resumed")
ok = True
def check(cond, what):
    global ok
    if not cond:
        print("FAIL:", what)
        ok = False
check(len(whole) == steps, f"the run logged {len(whole)} steps, not {steps}")
# A short run is mostly warm-up (the allocator's pools still fill): the bound holds for long ones.
if steps >= 500:
    check(growth <= 0.05, f"resident memory's level moved {100 * growth:.1f}% after warm-up (more than 5%)")
# A leak raises the count above its usual level; a worker mid-restart dips below it for a moment.
usual = sorted(fds)[len(fds) // 2]
check(max(fds) <= usual + 4, f"open file descriptors rose to {max(fds)}, {max(fds) - usual} above their usual {usual}")
check(max(kids) <= 2, f"up to {max(kids)} child processes (2 workers)")
check(restarts > 0, "no worker restarted: the crashes did not happen")
check(any(j.get("grad_norm", 0) > 0 for j in whole), "no step had a gradient: the comparison would be empty")
check(training(f"{out}/killed/metrics.jsonl") == training(f"{out}/short/metrics.jsonl"),
      "the run killed and resumed differs from the uninterrupted one")
sys.exit(0 if ok else 1)
PY
exit $fails
