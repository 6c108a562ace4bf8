#!/usr/bin/env bash
# One device call: issue 18's whole table in one sitting, beside llama.cpp built from the same
# tree: `bench --batch 1,4,16,64 -p 128 -n 128` on the 1B and 8B Q4_K_M shapes,
# llama-batched-bench on the same files, `cuda-check --batch 16` on both, and
# scripts/load_test.py against `serve --device cuda` (the 1B, then the 8B) at 1, 8, 32 and 64
# clients. Run after `scripts/gpu-pack.sh` on the GPU machine (the carry list of
# scripts/gpu-pending.sh); on a machine that ran gpu-pending.sh it reuses its files and build.
# ENV: FERROLM_CUDA_* settings to run ferrolm with (space-separated), e.g.
#   ENV="FERROLM_CUDA_SKINNY_GEMM_MAX_ROWS=16" bash scripts/gpu-issue18.sh
# Everything lands in $OUT/issue18.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
LOG=${OUT:-/tmp}/issue18.txt
source scripts/gpu-call.sh
E="FERROLM_UNUSED=1 ${ENV:-}"
say "ferrolm settings: $E"
[ -f $W/8b.gguf ] || $B synth --shape llama-3.1-8b --type q4_k_m $T -o $W/8b.gguf > /dev/null
[ -f $W/1b.gguf ] || $B synth --shape llama-3.2-1b --type q4_k_m $T -o $W/1b.gguf > /dev/null
for f in 1b 8b; do
  say "== ferrolm $f ($(el) s)"
  env $E timeout 120 $B bench -m $W/$f.gguf --device cuda --batch 1,4,16,64 -p 128 -n 128 2>&1 |
    grep -E '^\||rror|anic' | tee -a $LOG
done
for f in 1b 8b; do
  say "== cuda-check --batch 16 $f ($(el) s)"
  env $E timeout 120 $B cuda-check -m $W/$f.gguf --batch 16 -p 64 -n 24 2>&1 | grep -E '^\| |rror' |
    tail -1 | tee -a $LOG
done
for f in 1b 8b; do
  for c in 1 8 32 64; do
    say "== serve $f, $c clients ($(el) s)"
    env $E timeout 150 python3 scripts/load_test.py --binary $B --model $W/$f.gguf --device cuda \
      --parallel 64 --concurrency $c --requests $((c < 4 ? 16 : 4 * c)) --max-tokens 128 \
      --ctx-size 512 2>&1 | tail -4 | tee -a $LOG
  done
done
while [ ! -x $L/llama-batched-bench ] && [ $(el) -lt 400 ]; do sleep 5; done
for f in 1b 8b; do
  say "== llama.cpp $f ($(el) s)"
  timeout 120 $L/llama-batched-bench -m $W/$f.gguf -ngl 99 -fa 1 -c 40000 -npp 128 -ntg 128 \
    -npl 1,4,16,64 2>&1 | grep -E '^\|' | tee -a $LOG
done
# (issue 24's file, where gpu-pending.sh made it on this machine: llama.cpp's resident figures)
if [ -f $W/moe30.gguf ] && [ $(el) -lt 480 ]; then
  say "== llama.cpp moe30 ($(el) s)"
  timeout 100 $L/llama-bench -m $W/moe30.gguf -ngl 99 -fa 1 -p 512 -n 64 -r 2 2>&1 | grep -E '^\|' | tee -a $LOG
fi
say "total $(el) s"
