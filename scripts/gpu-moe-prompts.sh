#!/usr/bin/env bash
# One device call (the carry of gpu-pending.sh; about 6 min on a machine gpu-pending.sh or
# gpu-cpu-tier.sh warmed, else it makes the file first): issue 24's prompts under a budget and
# experts streamed from the file. The 48-layer Qwen3-30B-A3B-shaped file under
# `--gpu-memory 6`: pp512 with the CPU tier in prompt batches off (`PROMPT_CPU_EXPERTS=0`, the
# bus alone), adapted (the default) and fixed at 32, 48, 64 and 80 of the 128 experts, with the
# selections the CPU computed (`--expert-stats`); batched decode of 4 and 16 sequences with the
# share off (per-pair products over the bus, graphs) and on (grouped, launch by launch); then
# the model loaded with its experts
# streamed (`--expert-cache 4096`, the CPU computing every expert of the layers off the GPU)
# pp512 and tg64; cuda-check of a 512-token prompt and decode steps in both; llama.cpp's pp512
# with `-ncmoe 36` (its best under 6 GB) in the same sitting. Everything lands in
# $OUT/moe-prompts.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
LOG=${OUT:-/tmp}/moe-prompts.txt
source scripts/gpu-call.sh
moe30
G="--gpu-memory 6"; PE=FERROLM_CUDA_PROMPT_CPU_EXPERTS
for v in "$PE=0" "$PE=auto" "$PE=32" "$PE=48" "$PE=64" "$PE=80" "$PE=auto"; do
  say "== moe30 $G pp512, $v ($(el) s)"
  env $v timeout 100 $B bench -m $W/moe30.gguf --device cuda $G -t 16 -p 512 -n 0 -r 2 2>&1 |
    grep -E 'pp512|rror|anic' | tee -a $LOG
done
say "== moe30 $G run --expert-stats, a 512-token prompt ($(el) s)"
timeout 100 $B run -m $W/moe30.gguf --device cuda $G -t 16 --expert-stats -n 4 --temp 0 \
  -p "$(python3 -c 'print(" ".join(["tiers"] * 500))')" 2>&1 | grep -E 'expert tiers|rror|anic' |
  tee -a $LOG
for v in "$PE=0" "$PE=auto"; do
  say "== moe30 $G batched decode --batch 4,16, $v ($(el) s)"
  env $v timeout 150 $B bench -m $W/moe30.gguf --device cuda $G -t 16 --batch 4,16 -p 64 -n 32 2>&1 |
    grep -E '^\| +[0-9]|rror|anic' | tee -a $LOG
done
say "== moe30 on the CPU alone, pp512 (the prompt share's CPU side) ($(el) s)"
timeout 150 $B bench -m $W/moe30.gguf --device cpu -t 14 -p 512 -n 0 -r 1 2>&1 |
  grep -E 'pp512|rror|anic' | tee -a $LOG
S="--expert-cache 4096"
say "== moe30 $G $S (streamed) pp512 and tg64 ($(el) s)"
timeout 150 $B bench -m $W/moe30.gguf --device cuda $G $S -t 16 -p 512 -n 64 -r 1 2>&1 |
  grep -E 'pp512|tg64|stream|rror|anic' | tee -a $LOG
for s in "" "$S"; do
  say "== moe30 $G $s cuda-check -p 512 ($(el) s)"
  timeout 150 $B cuda-check -m $W/moe30.gguf $G $s -t 16 -p 512 -n 8 2>&1 |
    grep -E 'decode steps|prompt batch|rror|anic' | tee -a $LOG
done
say "== the host's CPU: $(lscpu | sed -n 's/^Model name: *//p'); $(grep -o 'amx[a-z_0-9]*\|avx512_vnni' /proc/cpuinfo | sort -u | tr '\n' ' ')"
while [ ! -x $L/llama-bench ] && [ $(el) -lt 420 ]; do sleep 5; done
if [ -x $L/llama-bench ]; then
  # (with its op offload, the default, and without: which of the CPU and the bus it uses)
  for po in 0 1; do
    say "== llama.cpp -ncmoe 36 pp512, --no-op-offload $po ($(el) s)"
    timeout 150 $L/llama-bench -m $W/moe30.gguf -ngl 99 -fa 1 -ncmoe 36 -t 16 -p 512 -n 0 -r 2 \
      -nopo $po 2>&1 | grep -E '^\||rror' | tee -a $LOG
  done
fi
say "total $(el) s"
