#!/usr/bin/env bash
# raylm serve vs vllm serve under vLLM's own load client, all three servers up and taking turns, then
# raylm served vs in-process on the same requests (raylm bench --serve-http --in-process).
# Needs .venv (make venv) and a vLLM CPU build in $PEERS (default .venv-peers: make peers; see
# ../shared/PEERS.md).
# Usage: benchmarks/serve_vs_vllm.sh [OUT_DIR]   (results: OUT_DIR/*.json, logs beside them)
set -euo pipefail
OUT=${1:-/tmp/raylm-serve-vs-vllm}
# shellcheck source=benchmarks/serve_common.sh
source "$(dirname "$0")/serve_common.sh"
mkdir -p "$OUT"
export VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-$(($(nproc) - 1)) VLLM_CPU_NUM_OF_RESERVED_CPU=0

load() {  # port label
  vllm_bench "$1" 0 --save-result --save-detailed --result-dir "$OUT" --result-filename "$2.json" | tee "$OUT/$2.txt" | \
    grep -E "throughput|TTFT|TPOT|ITL|Successful|Failed|Benchmark duration"
}

warm() {  # port: the same workload once, untimed (other prompts), so a fresh server's first burst, which
  # ran 15-25% slower than the next on raylm (new batch shapes), stays out of the timed run; both servers get it
  vllm_bench "$1" 1 >/dev/null || true
}

# All three servers stay up (idle between loads: raylm's engine blocks, vLLM's engine core waits on
# its input queue) and take turns, ROUNDS rounds in a rotating order: this machine's speed drifts by
# tens of percent within minutes, so one run of each, minutes apart, compared the drift more than
# the servers. raylm serve at its defaults; vLLM with both cores for its OMP threads, and with one
# (VLLM_CPU_OMP_THREADS_BIND=0: the other core left to its API server, as raylm serve leaves one).
ROUNDS=${ROUNDS:-3}
PIDS=()
trap 'for p in "${PIDS[@]}"; do kill -INT "$p" 2>/dev/null || true; done' EXIT
.venv/bin/raylm serve --dtype float32 --max-num-seqs 64 --served-model-name "$NAME" --port 8301 \
  --name raylm-vs-vllm --address local >"$OUT/raylm-serve.log" 2>&1 &
PIDS+=($!); declare -A PORT_OF=([raylm]=8301)
wait_healthy 8301 "${PIDS[-1]}"
SERVERS=(raylm)
PORT=8302
for BIND in 0-$(($(nproc) - 1)) 0; do
  VLLM_CPU_OMP_THREADS_BIND=$BIND "$PEERS/bin/vllm" serve "$MODEL" --dtype float32 --max-num-seqs 64 \
    --served-model-name "$NAME" --port $PORT >"$OUT/vllm-serve-$BIND.log" 2>&1 &
  PIDS+=($!); PORT_OF[vllm-$BIND]=$PORT; SERVERS+=("vllm-$BIND")
  wait_healthy $PORT "${PIDS[-1]}"
  PORT=$((PORT + 1))
  [ "$(nproc)" -gt 1 ] || break
done
for S in "${SERVERS[@]}"; do warm "${PORT_OF[$S]}"; done
for R in $(seq 1 "$ROUNDS"); do
  for i in "${!SERVERS[@]}"; do
    S=${SERVERS[$(( (i + R - 1) % ${#SERVERS[@]} ))]}
    echo "== round $R: $S (load average $(cut -d' ' -f1 /proc/loadavg))"
    load "${PORT_OF[$S]}" "$S-$R"
  done
done
for p in "${PIDS[@]}"; do kill -INT "$p" 2>/dev/null || true; done
for p in "${PIDS[@]}"; do wait "$p" || true; done
trap - EXIT

echo "== raylm served vs in-process, same requests (load average $(cut -d' ' -f1 /proc/loadavg))"
# each at its default (served: one worker thread, a core left to the server; in-process: every core),
# then both with the served run's one thread, which isolates what the HTTP path itself costs; three
# alternating rounds each (this machine's speed drifts by tens of percent within minutes), the median
.venv/bin/raylm bench --serve-http --in-process --repeat 3 --num-requests "$N" --input-len 128 --output-len 64 \
  --rate inf --batch-size 64 --compute-dtype float32 --json "$OUT/raylm-served-vs-in-process.json"
.venv/bin/raylm bench --serve-http --in-process --repeat 3 --num-requests "$N" --input-len 128 --output-len 64 \
  --rate inf --batch-size 64 --compute-dtype float32 --threads-per-worker 1 \
  --json "$OUT/raylm-served-vs-in-process-1t.json"

.venv/bin/python - "$OUT" "$ROUNDS" <<'PY'
import glob, json, re, statistics, sys
d, rounds = sys.argv[1], int(sys.argv[2])
runs = {}
for p in glob.glob(f"{d}/*.json"):
    m = re.fullmatch(r"(raylm|vllm-[0-9-]+)-([0-9]+)\.json", p[len(d) + 1:])
    if m is None:
        continue
    name, r = m.groups()
    runs.setdefault(name, {})[int(r)] = json.load(open(p))
def med(name, key):
    return statistics.median(x[key] for x in runs[name].values())
for name in sorted(runs):
    xs = [runs[name][r]["output_throughput"] for r in sorted(runs[name])]
    print(f"  {name}: median {med(name, 'output_throughput'):.0f} out tok/s ({', '.join(f'{x:.0f}' for x in xs)}), "
          f"TTFT p50 {med(name, 'median_ttft_ms'):.0f} ms, TPOT p50 {med(name, 'median_tpot_ms'):.1f} ms")
best = max((n for n in runs if n.startswith("vllm")), key=lambda n: med(n, "output_throughput"))
ratios = [runs["raylm"][r]["output_throughput"] / runs[best][r]["output_throughput"] for r in range(1, rounds + 1)]
print(f"raylm serve against the better vllm serve ({best}), per round: {', '.join(f'{x:.2f}' for x in ratios)}; "
      f"median {statistics.median(ratios):.2f}x; TTFT p50 {med('raylm', 'median_ttft_ms'):.0f} vs "
      f"{med(best, 'median_ttft_ms'):.0f} ms, TPOT p50 {med('raylm', 'median_tpot_ms'):.1f} vs "
      f"{med(best, 'median_tpot_ms'):.1f} ms (medians over the rounds)")
PY
