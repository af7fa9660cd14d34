#!/usr/bin/env bash
# carpool against llama.cpp and vLLM-CPU (../shared/peers kits), one server at a time on a quiet machine.
# Usage: PEERS_OUT=DIR benchmarks/peers.sh OUT, DIR holding llama1b/ (random_llama.py), llama1b-bf16.gguf,
# llama1b-q4_k_m.gguf (llama.cpp convert + llama-quantize), llama1b-iq4_xs.gguf (llama-quantize ... IQ4_XS; for the
# iq4xs steps) and smollm2-135m-hf/ (gguf_to_hf.py). STEPS="..." picks steps; the big-* steps serve one stream
# of BIG_GGUF (e.g. `python -m carpool.model.gguf_encode random:llama-3.1-8b FILE`);
# LLAMA_EXTRA adds llama-server flags (--no-repack where its AMX repacking crashes on Q4_1).
# The *-alternate steps keep carpool and llama.cpp up together and run ROUNDS (default 6) single streams
# against each in turn, each round after a read of 512 MiB (the host's read rate that minute, in read-rate.txt):
# on a host whose memory speed moves 20-40% from minute to minute, only rounds side by side give a ratio.
set -uo pipefail
OUT="$1"; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
PY=$PWD/.venv/bin/python
CARPOOL=$PWD/.venv/bin/carpool
LLAMA=$HOME/.cache/carpool-peers/llamacpp/build/bin/llama-server
Q4KM=${PEERS_OUT:?set PEERS_OUT to the folder with the 1B files}/llama1b-q4_k_m.gguf
BF16=${PEERS_OUT:?set PEERS_OUT to the folder with the 1B files}/llama1b-bf16.gguf
IQ4XS=$PEERS_OUT/llama1b-iq4_xs.gguf
NP=16
wait_up() { # URL PID: until the server answers, or its process has died
  for i in $(seq 1 600); do curl -sf "$1/v1/models" >/dev/null && return 0; kill -0 "$2" 2>/dev/null || return 1; sleep 1; done; return 1; }
single() { # URL NAME MODEL
  $CARPOOL bench serving --arrivals burst --num-requests 1 --lengths fixed --prompt-len 256 --output-len 128 --qps 1 \
    --no-plots --no-logprobs --seed ${SEED:-1} --base-url "$1/v1" --served-model "$3" --output "$OUT/$2-single" > "$OUT/$2-single.log" 2>&1
}
burst() { # URL NAME MODEL
  $CARPOOL bench serving --arrivals burst --num-requests 16 --lengths uniform --prompt-range 64,1024 --output-range 64,256 \
    --qps 1 --no-plots --no-logprobs --seed 0 --base-url "$1/v1" --served-model "$3" --output "$OUT/$2-burst" > "$OUT/$2-burst.log" 2>&1
}
carpool_run() { # NAME MODEL KIND(single|both) [serve flags]
  local name=$1 model=$2 kind=$3; shift 3
  $CARPOOL serve --model "$model" --port 8011 "$@" > "$OUT/$name-server.log" 2>&1 & local pid=$!
  wait_up http://127.0.0.1:8011 $pid || { echo "$name did not start"; kill $pid; return; }
  local served=$(curl -s http://127.0.0.1:8011/v1/models | $PY -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
  single http://127.0.0.1:8011 "$name" "$served"
  [ "$kind" = both ] && burst http://127.0.0.1:8011 "$name" "$served"
  kill $pid; wait $pid 2>/dev/null
}
llama_run() { # NAME GGUF KIND
  local name=$1 model=$2 kind=$3
  "$LLAMA" -m "$model" --host 127.0.0.1 --port 8080 --alias peer -t "$(nproc)" -tb "$(nproc)" -np $NP -cb \
    -c $((NP * 1280)) --cache-ram 0 -fa off --metrics ${LLAMA_EXTRA:-} > "$OUT/$name-server.log" 2>&1 & local pid=$!
  wait_up http://127.0.0.1:8080 $pid || { echo "$name did not start"; kill $pid; return; }
  single http://127.0.0.1:8080 "$name" peer
  [ "$kind" = both ] && burst http://127.0.0.1:8080 "$name" peer
  kill $pid; wait $pid 2>/dev/null
}
read_rate() { # GB/s of summing 512 MiB with every core, the median of 5: what a batch-1 decode step can read
  $PY -c 'import time, torch
x = torch.ones(128 << 20)
def once():
    t = time.perf_counter(); x.sum(); return time.perf_counter() - t
print(round(x.numel() * 4 / sorted(once() for _ in range(5))[2] / 1e9, 1))'
}
alternate() { # NAME GGUF: both servers up, ROUNDS single streams against each in turn
  local name=$1 model=$2
  $CARPOOL serve --model "$model" --port 8011 > "$OUT/$name-carpool-server.log" 2>&1 & local cpid=$!
  wait_up http://127.0.0.1:8011 $cpid || { echo "$name: carpool did not start"; kill $cpid; return; }
  "$LLAMA" -m "$model" --host 127.0.0.1 --port 8080 --alias peer -t "$(nproc)" -tb "$(nproc)" -np $NP -cb \
    -c $((NP * 1280)) --cache-ram 0 -fa off --metrics ${LLAMA_EXTRA:-} > "$OUT/$name-llama-server.log" 2>&1 & local lpid=$!
  wait_up http://127.0.0.1:8080 $lpid || { echo "$name: llama.cpp did not start"; kill $cpid $lpid; return; }
  local served=$(curl -s http://127.0.0.1:8011/v1/models | $PY -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
  for round in $(seq 1 "${ROUNDS:-6}"); do
    echo "$round $(read_rate)" >> "$OUT/$name-read-rate.txt"
    SEED=$round single http://127.0.0.1:8011 "$name-carpool-$round" "$served"
    SEED=$round single http://127.0.0.1:8080 "$name-llama-$round" peer
  done
  kill $cpid $lpid; wait $cpid $lpid 2>/dev/null
}
vllm_run() { # NAME HF_FOLDER KIND
  local name=$1 model=$2 kind=$3
  bash ../shared/peers/vllm-cpu/serve.sh "$model" 8000 > "$OUT/$name-server.log" 2>&1 & local pid=$!
  wait_up http://127.0.0.1:8000 $pid || { echo "$name did not start"; kill $pid; return; }
  single http://127.0.0.1:8000 "$name" "$model"
  [ "$kind" = both ] && burst http://127.0.0.1:8000 "$name" "$model"
  kill $pid; wait $pid 2>/dev/null; pkill -f vllm.entrypoints || true
}
date > "$OUT/started"
for step in ${STEPS:-q4km-carpool q4km-llama q4km-carpool-fixed bf16-carpool bf16-llama bf16-vllm smol-carpool smol-llama smol-vllm}; do
  echo "== $step $(date +%T)"
  case $step in
    q4km-carpool) carpool_run q4km-carpool $Q4KM both ;;
    q4km-carpool-fixed) carpool_run q4km-carpool-fixed $Q4KM both --target-tbt-ms 0 ;;
    q4km-llama) llama_run q4km-llama $Q4KM both ;;
    iq4xs-carpool) carpool_run iq4xs-carpool $IQ4XS single ;;
    iq4xs-llama) llama_run iq4xs-llama $IQ4XS single ;;
    big-carpool) carpool_run big-carpool "${BIG_GGUF:?set BIG_GGUF}" single ;;
    big-llama) llama_run big-llama "${BIG_GGUF:?set BIG_GGUF}" single ;;
    q4km-alternate) alternate q4km-alternate $Q4KM ;;
    bf16-alternate) alternate bf16-alternate $BF16 ;;
    smol-alternate) alternate smol-alternate "$($PY -c 'from carpool.config import EngineConfig; print(EngineConfig().model)')" ;;
    bf16-carpool) carpool_run bf16-carpool $BF16 single ;;
    bf16-llama) llama_run bf16-llama $BF16 single ;;
    bf16-vllm) vllm_run bf16-vllm ${PEERS_OUT:?set PEERS_OUT to the folder with the 1B files}/llama1b single ;;
    smol-carpool) carpool_run smol-carpool "$($PY -c 'from carpool.config import EngineConfig; print(EngineConfig().model)')" both ;;
    smol-llama) llama_run smol-llama "$($PY -c 'from carpool.config import EngineConfig; print(EngineConfig().model)')" both ;;
    smol-vllm) vllm_run smol-vllm ${PEERS_OUT:?set PEERS_OUT to the folder with the 1B files}/smollm2-135m-hf both ;;
  esac
done
date > "$OUT/finished"
