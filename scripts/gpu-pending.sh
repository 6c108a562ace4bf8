#!/usr/bin/env bash
# One device call: the measurements docs/PERFORMANCE.md's latest CUDA section leaves for the
# next call with a GPU, beside llama.cpp built in the same call. Run on the GPU machine from the
# repository root after `scripts/gpu-pack.sh` filled .bench/ here (carry only what it needs:
# the tracked tree is ~28 MB of the 64 MiB):
#   run(command="bash scripts/gpu-pending.sh", carry=[".bench/ferrolm.gz",
#       ".bench/kernels.tar.gz", ".bench/prep.sh", ".bench/build-llama-cpp.sh",
#       ".bench/llama.cpp.tar.gz", ".bench/tok.gguf", ".bench/gtok.gguf.gz"])   (about 10 min: split it in two if a call's limit nears)
# 1. the switches written after session 18's sitting, off until measured
#    (FERROLM_CUDA_FUSED_COMBINE=1, FERROLM_CUDA_PRODUCER_QUANT=1,
#    FERROLM_CUDA_ROPE_IN_ATTENTION=1): cuda-check with all three on the hybrid, small MoE files
#    (qwen2moe: its f32 shared-expert gate; qwen3moe, heads of 128) and the Gemma-3-270M shape,
#    then tg128 on issue 19's hybrid-1g and the Gemma shape with none, each and all, alternating;
# 2. issue 24: a Qwen3-30B-A3B-shaped file (48 layers, 128 experts top-8, Q4_0), resident
#    tg64 with none and both, pp512;
# 3. issue 18: the 8B Q4_K_M at B=16 with and without FERROLM_CUDA_BATCH_OVERLAP=1 (the batched
#    passes' kernels launched overlapping their predecessors), cuda-check --batch 16 with it;
# 4. llama.cpp's pp512 and tg128 on the same files (llama-bench), llama-batched-bench on the 8B.
# Everything lands in $OUT/pending.txt (and on stdout).
set -uo pipefail
cd "$(dirname "$0")/.."
source .bench/prep.sh
B=$PWD/.bench/ferrolm; W=/tmp/fw; L=/tmp/lcp-build/bin; LOG=${OUT:-/tmp}/pending.txt
mkdir -p $W; : > $LOG
say() { echo "$@" | tee -a $LOG; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a $LOG
[ -x $L/llama-bench ] ||
  (setsid nice -n 5 bash .bench/build-llama-cpp.sh .bench/llama.cpp /tmp/lcp-build > /tmp/lcp.out 2>&1 &)
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
T="--tokenizer-from .bench/tok.gguf"
[ -f $W/hy.gguf ] || $B synth --arch qwen3next --embd 2048 --layers 24 --heads 16 --kv-heads 2 \
  --head-dim 128 --ff 512 --experts 16 --experts-used 4 --ssm-state 128 --ssm-k-heads 16 \
  --ssm-v-heads 32 --full-attention-interval 4 --ctx 4096 --type q4_0 $T -o $W/hy.gguf > /dev/null
[ -f $W/q2m.gguf ] || $B synth --arch qwen2moe --layers 4 --embd 1024 --heads 16 --kv-heads 4 \
  --head-dim 64 --ff 512 --experts 32 --experts-used 4 --type q4_0 -o $W/q2m.gguf > /dev/null
[ -f $W/q3m.gguf ] || $B synth --arch qwen3moe --layers 4 --embd 1024 --heads 16 --kv-heads 4 \
  --head-dim 64 --ff 512 --experts 32 --experts-used 4 --type q4_0 -o $W/q3m.gguf > /dev/null
[ -f $W/moe30.gguf ] || $B synth --arch qwen3moe --layers 48 --embd 2048 --heads 32 --kv-heads 4 \
  --head-dim 128 --ff 768 --experts 128 --experts-used 8 --type q4_0 $T -o $W/moe30.gguf > /dev/null
say "== files $(el) s"
BOTH="FERROLM_CUDA_FUSED_COMBINE=1 FERROLM_CUDA_PRODUCER_QUANT=1 FERROLM_CUDA_ROPE_IN_ATTENTION=1"
[ -f $W/gtok.gguf ] || gunzip -c .bench/gtok.gguf.gz > $W/gtok.gguf
[ -f $W/g270.gguf ] || $B synth --arch gemma3 --layers 18 --embd 640 --ff 2048 --rope-base 1000000 \
  --heads 4 --kv-heads 1 --head-dim 256 --sliding-window 512 --tied --tokenizer-from $W/gtok.gguf \
  --type q5_0 --tensor-type attn_v=q8_0 --tensor-type attn_output=q4_k --tensor-type ffn_down=q6_k \
  --tensor-type token_embd=q8_0 -o $W/g270.gguf > /dev/null
for f in hy q2m q3m g270; do
  say "== $f cuda-check, both switches ($(el) s)"
  env $BOTH timeout 90 $B cuda-check -m $W/$f.gguf -p 128 -n 16 2>&1 | grep -E 'decode steps|prompt batch|kernels in' | tee -a $LOG
  say "== $f cuda-check, defaults ($(el) s)"
  timeout 90 $B cuda-check -m $W/$f.gguf -p 128 -n 16 2>&1 | grep -E 'decode steps|kernels in' | tee -a $LOG
done
for v in FERROLM_UNUSED=1 FERROLM_CUDA_FUSED_COMBINE=1 FERROLM_CUDA_PRODUCER_QUANT=1 FERROLM_CUDA_ROPE_IN_ATTENTION=1 "$BOTH" FERROLM_UNUSED=1 "$BOTH"; do
  for f in hy g270; do
    say "== $f tg128 $v ($(el) s)"
    env $v timeout 40 $B bench -m $W/$f.gguf --device cuda -p 0 -n 128 -r 3 2>&1 | grep -E 'tg128|rror|anic' | tee -a $LOG
  done
done
for v in FERROLM_UNUSED=1 "$BOTH" FERROLM_UNUSED=1 "$BOTH"; do
  say "== moe30 tg64 $v ($(el) s)"
  env $v timeout 60 $B bench -m $W/moe30.gguf --device cuda -p 0 -n 64 -r 2 2>&1 | grep -E 'tg64|rror|anic' | tee -a $LOG
done
[ -f $W/8b.gguf ] || $B synth --shape llama-3.1-8b --type q4_k_m $T -o $W/8b.gguf > /dev/null
OV=FERROLM_CUDA_BATCH_OVERLAP=1
say "== 8b cuda-check --batch 16, $OV ($(el) s)"
env $OV timeout 120 $B cuda-check -m $W/8b.gguf --batch 16 -p 64 -n 8 2>&1 | grep -E '^\| |rror' | tail -3 | tee -a $LOG
for v in FERROLM_UNUSED=1 $OV FERROLM_UNUSED=1 $OV; do
  say "== 8b B=16 $v ($(el) s)"
  env $v timeout 100 $B bench -m $W/8b.gguf --device cuda --batch 16 -p 128 -n 128 2>&1 | grep -E '^\| +[0-9]|rror|anic' | tee -a $LOG
done
for f in hy moe30; do
  say "== $f pp512 tg128, both ($(el) s)"
  env $BOTH timeout 90 $B bench -m $W/$f.gguf --device cuda -p 512 -n 128 -r 3 2>&1 | grep -E 'pp512|tg128|rror|anic' | tee -a $LOG
done
while [ ! -x $L/llama-bench ] && [ $(el) -lt 420 ]; do sleep 5; done
say "== llama.cpp ($(el) s)"
timeout 150 $L/llama-bench -m $W/hy.gguf,$W/moe30.gguf,$W/g270.gguf -ngl 99 -fa 1 -p 512 -n 128 -r 3 2>&1 | grep -E '^\|' | tee -a $LOG
timeout 60 $L/llama-batched-bench -m $W/8b.gguf -ngl 99 -fa 1 -c 40000 -npp 128 -ntg 128 -npl 16 2>&1 | grep -E '^\|' | tail -1 | tee -a $LOG
say "total $(el) s"
