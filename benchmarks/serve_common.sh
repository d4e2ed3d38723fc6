# Sourced by serve_vs_vllm.sh and serve_ab.sh: the repo root, vLLM's venv, the bundled model, and
# the issue's workload under vLLM's own load client.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PEERS=${PEERS:-${RAYLM_PEERS_VENV:-.venv-peers}}  # what `make peers` creates
MODEL=$(.venv/bin/python -c "from workers.loader import bundled_model_path; print(bundled_model_path())")
NAME=tiny
N=${NUM_PROMPTS:-128}

wait_healthy() {  # port pid: until /health is 200; fails when the server exits or 15 minutes pass
  for _ in $(seq 1 900); do
    if curl -sf "http://127.0.0.1:$1/health" >/dev/null; then return 0; fi
    kill -0 "$2" 2>/dev/null || { echo "server $2 exited"; return 1; }
    sleep 1
  done
  return 1
}

vllm_bench() {  # port seed [more vllm bench serve flags]: the workload, 128-token prompts, 64 tokens out
  local port=$1 seed=$2
  shift 2
  "$PEERS/bin/vllm" bench serve --backend openai --base-url "http://127.0.0.1:$port" --model "$MODEL" \
    --served-model-name "$NAME" --tokenizer "$MODEL" --dataset-name random --random-input-len 128 \
    --random-output-len 64 --num-prompts "$N" --request-rate inf --ignore-eos --seed "$seed" "$@" 2>&1
}
