#!/usr/bin/env bash
# One device call (the carry of gpu-pending.sh; about 5 min, on the machine gpu-pending.sh
# warmed, else it makes the file again): issue 24's CPU tier (`FERROLM_CUDA_CPU_EXPERTS=c`: in
# the layers a `--gpu-memory` budget leaves in host memory, the CPU computes the last c of each
# token's chosen experts while the GPU reads the others over the bus). The 48-layer
# Qwen3-30B-A3B-shaped file under `--gpu-memory 6`: tg64 at c = 0, 2, auto, 4, 6 and with other
# thread counts (half the cores by default; all of them measured twenty times slower); the expert slot cache (`FERROLM_CUDA_EXPERT_SLOTS=1`: every stack in host memory,
# the rest of the budget as slots for each layer's most chosen experts, staged before the
# products) alone and with c = 4; cuda-check with c = 4, and with the slots; and llama.cpp's
# tg64 with `-ncmoe 36` (its best under 6 GB) in the same sitting. Everything lands in
# $OUT/cpu-tier.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
LOG=${OUT:-/tmp}/cpu-tier.txt
source scripts/gpu-call.sh
moe30
G="--gpu-memory 6"
CE=FERROLM_CUDA_CPU_EXPERTS; ES=FERROLM_CUDA_EXPERT_SLOTS=1
for v in "$CE=0" "$CE=2" "$CE=auto" "$CE=4" "$CE=6" "$CE=4 FERROLM_CUDA_CPU_TIER_THREADS=12" \
  "$CE=2 FERROLM_CUDA_CPU_TIER_THREADS=6" "$ES $CE=0" "$ES" "$CE=0"; do
  say "== moe30 $G tg64, $v ($(el) s)"
  env $v timeout 100 $B bench -m $W/moe30.gguf --device cuda $G -t 16 -p 0 -n 64 -r 2 2>&1 |
    grep -E 'tg64|rror|anic' | tee -a $LOG
done
for v in "$CE=2" "$ES $CE=0" "$ES"; do
  say "== moe30 $G cuda-check, $v ($(el) s)"
  env $v timeout 120 $B cuda-check -m $W/moe30.gguf $G -t 16 -p 32 -n 8 2>&1 |
    grep -E 'decode steps|prompt batch|rror|anic' | tee -a $LOG
done
while [ ! -x $L/llama-bench ] && [ $(el) -lt 420 ]; do sleep 5; done
if [ -x $L/llama-bench ]; then
  say "== llama.cpp -ncmoe 36 ($(el) s)"
  timeout 120 $L/llama-bench -m $W/moe30.gguf -ngl 99 -fa 1 -ncmoe 36 -t 16 -p 0 -n 64 -r 2 2>&1 |
    grep -E '^\|' | tee -a $LOG
fi
say "total $(el) s"
