#!/usr/bin/env bash
# One device call: the measurements docs/PERFORMANCE.md's latest CUDA section leaves for the
# next call with a GPU, beside llama.cpp built in the same call. Run on the GPU machine from the
# repository root after `scripts/gpu-pack.sh` filled .bench/ here:
#   run(command="bash scripts/gpu-pending.sh", carry=[".bench"])   (about 8 minutes)
# 1. issue 18: the 8B Q4_K_M at B=16, `dq4k_gemm` (the default) against the pipelined layouts
#    (FERROLM_CUDA_DQ_PIPE=4x3|4x2|8x2) and against itself held to 85 registers
#    (FERROLM_CUDA_DEFINES=DQ_MIN_BLOCKS=3), beside llama-batched-bench;
# 2. issue 19: Gemma-3-shaped files (270M and 1B, 4 heads of 256), tg128 with and without
#    FERROLM_CUDA_FINE_SPLITS=1 and FERROLM_CUDA_HELD_POST_NORM=1, alternating, cuda-check with
#    them, beside llama-bench;
# 3. a small qwen3moe file through cuda-check.
# Everything lands in $OUT/pending.txt (and on stdout).
set -uo pipefail
cd "$(dirname "$0")/.."
source .bench/prep.sh
B=$PWD/.bench/ferrolm; W=/tmp/fw; L=/tmp/lcp-build/bin; LOG=${OUT:-/tmp}/pending.txt
mkdir -p $W; : > $LOG
say() { echo "$@" | tee -a $LOG; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a $LOG
[ -x $L/llama-batched-bench ] ||
  (setsid nice -n 5 bash .bench/build-llama-cpp.sh .bench/llama.cpp /tmp/lcp-build > /tmp/lcp.out 2>&1 &)
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
[ -f $W/gtok.gguf ] || gunzip -c .bench/gtok.gguf.gz > $W/gtok.gguf
[ -f $W/8b.gguf ] || $B synth --shape llama-3.1-8b --type q4_k_m --tokenizer-from .bench/tok.gguf -o $W/8b.gguf > /dev/null
G="--heads 4 --kv-heads 1 --head-dim 256 --sliding-window 512 --tied --tokenizer-from $W/gtok.gguf"
[ -f $W/g270.gguf ] || $B synth --arch gemma3 --layers 18 --embd 640 --ff 2048 --rope-base 1000000 $G --type q5_0 --tensor-type attn_v=q8_0 --tensor-type attn_output=q4_k --tensor-type ffn_down=q6_k --tensor-type token_embd=q8_0 -o $W/g270.gguf > /dev/null
[ -f $W/g1b.gguf ] || $B synth --arch gemma3 --layers 26 --embd 1152 --ff 6912 $G --type q8_0 -o $W/g1b.gguf > /dev/null
[ -f $W/moe.gguf ] || $B synth --arch qwen3moe --layers 4 --embd 1024 --heads 16 --kv-heads 4 --head-dim 64 --ff 512 --experts 32 --experts-used 4 --type q4_0 -o $W/moe.gguf > /dev/null
say "== files $(el) s"
# (DQ_MIN_BLOCKS=3: dq4k_gemm within 85 registers, three 8-warp blocks an SM; a define changes
# the source, so that run compiles the kernels first, about 100 s)
for v in FERROLM_UNUSED=1 FERROLM_CUDA_DQ_PIPE=4x3 FERROLM_CUDA_DQ_PIPE=4x2 FERROLM_CUDA_DQ_PIPE=8x2 FERROLM_CUDA_DEFINES=DQ_MIN_BLOCKS=3 FERROLM_UNUSED=1; do
  say "== 8b B=16 $v ($(el) s)"
  env $v timeout 240 $B bench -m $W/8b.gguf --device cuda --batch 16 -p 128 -n 128 2>&1 | grep -E '^\| +[0-9]|rror|anic' | tee -a $LOG
done
FINE=FERROLM_CUDA_FINE_SPLITS=1; HELD=FERROLM_CUDA_HELD_POST_NORM=1
for f in g270 g1b; do
  for v in FERROLM_UNUSED=1 $FINE $HELD "$FINE $HELD" FERROLM_UNUSED=1 "$FINE $HELD"; do
    say "== $f tg128 $v ($(el) s)"
    env $v timeout 40 $B bench -m $W/$f.gguf --device cuda -p 0 -n 128 -r 3 2>&1 | grep -E 'tg128|rror|anic' | tee -a $LOG
  done
  say "== $f cuda-check with $FINE $HELD ($(el) s)"
  env $FINE $HELD timeout 60 $B cuda-check -m $W/$f.gguf -p 300 -n 32 2>&1 | grep -E 'decode steps|prompt batch|kernels in|rror' | tee -a $LOG
done
say "== moe cuda-check ($(el) s)"
timeout 60 $B cuda-check -m $W/moe.gguf -p 100 -n 30 2>&1 | grep -E 'decode steps|prompt batch|rror' | tee -a $LOG
while [ ! -x $L/llama-batched-bench ] && [ $(el) -lt 420 ]; do sleep 5; done
say "== llama.cpp ($(el) s)"
timeout 40 $L/llama-batched-bench -m $W/8b.gguf -ngl 99 -fa 1 -c 40000 -npp 128 -ntg 128 -npl 16 2>&1 | grep -E '^\|' | tail -1 | tee -a $LOG
timeout 60 $L/llama-bench -m $W/g270.gguf,$W/g1b.gguf -ngl 99 -fa 1 -p 0 -n 128 -r 3 2>&1 | grep -E '^\|' | tee -a $LOG
say "total $(el) s"
