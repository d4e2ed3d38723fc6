#!/usr/bin/env bash
# raylm serve vs vllm serve under vLLM's own load client, one after the other, then raylm
# served vs in-process on the same requests (raylm bench --serve-http --in-process).
# Needs .venv (make venv) and a vLLM CPU build in $PEERS (default .venv-peers: make peers; see
# ../shared/PEERS.md).
# Usage: benchmarks/serve_vs_vllm.sh [OUT_DIR]   (results: OUT_DIR/*.json, logs beside them)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/raylm-serve-vs-vllm}
PEERS=${PEERS:-${RAYLM_PEERS_VENV:-.venv-peers}}  # what `make peers` creates
MODEL=$(.venv/bin/python -c "from workers.loader import bundled_model_path; print(bundled_model_path())")
NAME=tiny
N=${NUM_PROMPTS:-128}
mkdir -p "$OUT"
export VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-$(($(nproc) - 1)) VLLM_CPU_NUM_OF_RESERVED_CPU=0

wait_healthy() {  # port pid
  for _ in $(seq 1 900); do
    if curl -sf "http://127.0.0.1:$1/health" >/dev/null; then return 0; fi
    kill -0 "$2" 2>/dev/null || { echo "server $2 exited"; return 1; }
    sleep 1
  done
  return 1
}

load() {  # port label
  "$PEERS/bin/vllm" bench serve --backend openai --base-url "http://127.0.0.1:$1" --model "$MODEL" \
    --served-model-name "$NAME" --tokenizer "$MODEL" --dataset-name random --random-input-len 128 \
    --random-output-len 64 --num-prompts "$N" --request-rate inf --ignore-eos --seed 0 \
    --save-result --save-detailed --result-dir "$OUT" --result-filename "$2.json" 2>&1 | tee "$OUT/$2.txt" | \
    grep -E "throughput|TTFT|TPOT|ITL|Successful|Failed|Benchmark duration"
}

warm() {  # port: a few requests so first-request compiles stay out of the timed run
  "$PEERS/bin/vllm" bench serve --backend openai --base-url "http://127.0.0.1:$1" --model "$MODEL" \
    --served-model-name "$NAME" --tokenizer "$MODEL" --dataset-name random --random-input-len 128 \
    --random-output-len 8 --num-prompts 8 --request-rate inf --ignore-eos --seed 1 >/dev/null 2>&1 || true
}

echo "== raylm serve (load average $(cut -d' ' -f1 /proc/loadavg))"
PORT=8301
.venv/bin/raylm serve --dtype float32 --max-num-seqs 64 --served-model-name "$NAME" --port $PORT \
  --name raylm-vs-vllm --address local >"$OUT/raylm-serve.log" 2>&1 &
PID=$!
trap 'kill -INT $PID 2>/dev/null || true' EXIT
wait_healthy $PORT $PID
warm $PORT
load $PORT raylm
kill -INT $PID; wait $PID || true

# vLLM with both cores for its OMP threads, then with one (VLLM_CPU_OMP_THREADS_BIND=0: the other
# core left to its API server, as raylm serve leaves one by default); raylm is compared to the better
for BIND in 0-$(($(nproc) - 1)) 0; do
  echo "== vllm serve, OMP threads bound to $BIND (load average $(cut -d' ' -f1 /proc/loadavg))"
  PORT=8302
  VLLM_CPU_OMP_THREADS_BIND=$BIND "$PEERS/bin/vllm" serve "$MODEL" --dtype float32 --max-num-seqs 64 \
    --served-model-name "$NAME" --port $PORT >"$OUT/vllm-serve-$BIND.log" 2>&1 &
  PID=$!
  wait_healthy $PORT $PID
  warm $PORT
  load $PORT "vllm-$BIND"
  kill -INT $PID; wait $PID || true
  [ "$(nproc)" -gt 1 ] || break
done
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

.venv/bin/python - "$OUT" <<'PY'
import glob, json, sys
d = sys.argv[1]
r = json.load(open(f"{d}/raylm.json"))
vs = {p: json.load(open(p)) for p in sorted(glob.glob(f"{d}/vllm-*.json"))}
for p, x in vs.items():
    print(f"  {p}: {x['output_throughput']:.0f} out tok/s, TTFT p50 {x['median_ttft_ms']:.0f} ms, "
          f"TPOT p50 {x['median_tpot_ms']:.1f} ms")
v = max(vs.values(), key=lambda x: x["output_throughput"])
print(f"raylm serve: {r['output_throughput']:.0f} out tok/s; against the better vllm serve: "
      f"{r['output_throughput'] / v['output_throughput']:.2f}x, "
      f"TTFT p50 {r['median_ttft_ms']:.0f} vs {v['median_ttft_ms']:.0f} ms, "
      f"TPOT p50 {r['median_tpot_ms']:.1f} vs {v['median_tpot_ms']:.1f} ms")
PY
