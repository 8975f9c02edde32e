#!/usr/bin/env bash
# Launch the Rollplex hybrid server (policy + rollout engine + reference model + trainer) on one GPU
# for a real Qwen2.5-VL checkpoint. Every setting can be overridden from the environment; extra
# arguments go straight to `python -m rollplex.server` (see --help).
#
#   MODEL=/models/Qwen2.5-VL-3B-Instruct ROLLPLEX_API_KEY=... server/launch.sh --kl-coef 0.001
#
# Then: python server/client_example.py --url http://$HOST:$PORT --api-key $ROLLPLEX_API_KEY --image cat.png
set -euo pipefail

MODEL=${MODEL:-/models/Qwen2.5-VL-3B-Instruct}   # any local HF Qwen2.5-VL directory
HOST=${HOST:-127.0.0.1}                          # 0.0.0.0 only behind a firewall, and with an API key
PORT=${PORT:-30000}
CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}  # one process per GPU
MODE=${MODE:-rollplex}                           # rollplex | serial (verl's order, for comparison)
N=${N:-8}                                        # GRPO group size
LR=${LR:-1e-6}
KL_COEF=${KL_COEF:-0.001}                        # > 0 keeps a frozen reference model on the GPU
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-1024}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-4096}
GPU_MEM=${GPU_MEM:-0.5}                          # engine's share (weights + KV + workspace)

if [[ ! -f "$MODEL/config.json" ]]; then
  echo "launch.sh: $MODEL is not an HF checkpoint directory (set MODEL=...)" >&2
  exit 1
fi
if [[ -z "${ROLLPLEX_API_KEY:-}" ]]; then
  ROLLPLEX_API_KEY=$(python -c 'import secrets; print(secrets.token_hex(16))')
  echo "launch.sh: generated API key: $ROLLPLEX_API_KEY" >&2
fi
export CUDA_VISIBLE_DEVICES ROLLPLEX_API_KEY

exec python -m rollplex.server \
  --model "$MODEL" --host "$HOST" --port "$PORT" \
  --device cuda --dtype bfloat16 --mode "$MODE" \
  --n "$N" --lr "$LR" --kl-coef "$KL_COEF" \
  --max-new-tokens "$MAX_NEW_TOKENS" --max-model-len "$MAX_MODEL_LEN" \
  --gpu-memory-utilization "$GPU_MEM" \
  --rollout-ttl 600 --max-rollouts 16 \
  "$@"
