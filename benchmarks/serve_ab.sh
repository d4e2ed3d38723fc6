#!/usr/bin/env bash
# A/B of two `raylm serve` flag sets under vLLM's own load client: both servers up (each with a Ray
# of its own), warmed with the whole workload, then ROUNDS rounds alternating which goes first; the
# per-round ratio A/B and its median. The machine's speed drifts by tens of percent within minutes,
# which one run of each, minutes apart, measures more than the flags.
# Usage: ARGS_A="" ARGS_B="--gil-switch-interval-ms 5" benchmarks/serve_ab.sh   (needs make venv, make peers)
# Two builds: TREE_B=/tmp/base benchmarks/serve_ab.sh (an absolute path) serves B from that checkout's own .venv (e.g.
# `git worktree add /tmp/base HEAD~1 && make -C /tmp/base venv`; each venv imports its own tree).
set -euo pipefail
# shellcheck source=benchmarks/serve_common.sh
source "$(dirname "$0")/serve_common.sh"
ROUNDS=${ROUNDS:-6}
LOG=${LOG_DIR:-/tmp/raylm-serve-ab}
mkdir -p "$LOG"
start() {  # port args tree
  # shellcheck disable=SC2086
  "$3/.venv/bin/raylm" serve --dtype float32 --max-num-seqs 64 --served-model-name "$NAME" --port "$1" \
    --name "ab-$1" --address local $2 >"$LOG/serve-$1.log" 2>&1 &
  PIDS+=($!)
}
PIDS=()
trap 'kill -INT "${PIDS[@]}" 2>/dev/null || true' EXIT
start 8341 "${ARGS_A:-}" "${TREE_A:-.}"
start 8342 "${ARGS_B:-}" "${TREE_B:-.}"
wait_healthy 8341 "${PIDS[0]}"
wait_healthy 8342 "${PIDS[1]}"
load() {  # port seed -> output tok/s
  vllm_bench "$1" "$2" | awk '/Output token throughput/ {print $NF}'
}
load 8341 1 >/dev/null; load 8342 1 >/dev/null
RATIOS=()
for r in $(seq 1 "$ROUNDS"); do
  if [ $((r % 2)) = 1 ]; then a=$(load 8341 0); b=$(load 8342 0); else b=$(load 8342 0); a=$(load 8341 0); fi
  RATIOS+=("$(python3 -c "print(f'{$a / $b:.2f}')")")
  echo "round $r: A ${TREE_A:-.} ${ARGS_A:-(defaults)} $a, B ${TREE_B:-.} ${ARGS_B:-(defaults)} $b out tok/s: A/B ${RATIOS[-1]}"
done
# the median, and the order-balanced ratio: whichever server goes first in a round measured faster here,
# so the rounds where A went first and those where B did are averaged apart, then together (geometric)
python3 -c "
import math, statistics, sys
r = list(map(float, sys.argv[1:]))
print(f'A/B median over {len(r)} rounds: {statistics.median(r):.2f}x')
if len(r) > 1:
    first, second = r[0::2], r[1::2]  # A went first in odd rounds
    g = lambda v: math.exp(sum(map(math.log, v)) / len(v))
    print(f'A/B balanced: {math.sqrt(g(first) * g(second)):.2f}x (A first {g(first):.2f}x, B first {g(second):.2f}x)')
" "${RATIOS[@]}"
