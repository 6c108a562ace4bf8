#!/usr/bin/env bash
# One device call: issue 18's batched decode beside llama.cpp, with exactness and a profile.
# On the GPU machine, with a release binary built elsewhere and llama.cpp's source beside it
# (scripts/gpu-pack.sh puts them in .bench/):
#   scripts/gpu-batched.sh BIN TOKENIZER_GGUF LLAMA_SRC
# TOKENIZER_GGUF: a GGUF holding the default model's tokenizer.* keys (`ferrolm synth --arch llama
# --layers 1 --embd 64 --heads 2 --kv-heads 1 --ff 64` borrows them); LLAMA_SRC: llama.cpp's
# source (../shared/bench/fetch-llama-cpp.sh). BUILD_LLAMA: ../shared/bench/build-llama-cpp.sh,
# copied into the carried folder (shared/ beside the checkout does not travel). Env: SHAPES="llama-3.1-8b llama-3.2-1b",
# BATCHES=1,2,4,8,16,64, VARIANTS="default" or FERROLM_CUDA_* settings to compare (several in one
# variant joined by commas), e.g. VARIANTS="default FERROLM_CUDA_DQ_PIPE=4x3
# FERROLM_CUDA_DQ_PIPE=4x3,FERROLM_CUDA_DQ6_PIPE=1"; CHECK_ENV: settings (commas) for the
# exactness checks; NCU=1 profiles a few of the 16-row
# decode steps' dq4k_gemm launches with Nsight Compute (prompts do not launch it).
# llama.cpp builds in the background (about 3-5 minutes on 16 cores) while ferrolm runs; the
# first cuda-check of a call is slow while it builds (its CPU reference shares the cores).
set -uo pipefail
BIN=${1:?usage: gpu-batched.sh BIN TOKENIZER_GGUF LLAMA_SRC}
TOK=${2:?}
SRC=${3:?}
W=${WORK:-/tmp/ferrolm-gpu}
CHECK_ENV=${CHECK_ENV:-}
mkdir -p "$W"
export FERROLM_HOME=${FERROLM_HOME:-$W/home}
HERE=$(cd "$(dirname "$0")" && pwd)
BUILD_LLAMA=${BUILD_LLAMA:-$HERE/../../shared/bench/build-llama-cpp.sh}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
(setsid nice -n 5 bash "$BUILD_LLAMA" "$SRC" /tmp/lcp-build >/tmp/lcp.out 2>&1 &)
t0=$(date +%s)
for shape in ${SHAPES:-llama-3.1-8b llama-3.2-1b}; do
  [ -f "$W/$shape.gguf" ] || "$BIN" synth --shape "$shape" --type q4_k_m --tokenizer-from "$TOK" \
    -o "$W/$shape.gguf" >/dev/null || exit 1
done
for shape in ${SHAPES:-llama-3.1-8b llama-3.2-1b}; do
  for v in ${VARIANTS:-default}; do
    echo "== $shape $v"
    [ "$v" = default ] && v=FERROLM_UNUSED=1
    env ${v//,/ } "$BIN" bench -m "$W/$shape.gguf" --device cuda --batch "${BATCHES:-1,2,4,8,16,64}" \
      -p 128 -n 128 2>&1 | grep -E '^\|'
  done
done
shape=${SHAPES:-llama-3.2-1b}; shape=${shape##* }
echo "== exactness, $shape, 16 and 8 sequences joining and leaving"
for b in 16 8; do
  env ${CHECK_ENV//,/ } FERROLM_UNUSED=1 "$BIN" cuda-check -m "$W/$shape.gguf" --batch $b -p 160 -n 40 2>&1 | tail -1
done
if [ "${NCU:-}" = 1 ]; then
  big=${SHAPES:-llama-3.1-8b}; big=${big%% *}
  /usr/local/cuda/bin/ncu --clock-control none --kernel-name "regex:dq[46]k_" \
    --launch-skip 10 --launch-count 6 --section SpeedOfLight --section Occupancy \
    --section LaunchStats --section WarpStateStats \
    "$BIN" bench -m "$W/$big.gguf" --device cuda --batch 16 -p 1 -n 4 -r 1 > "$W/ncu.txt" 2>&1
  grep -E "dq4k|skinny|Duration|DRAM Throughput|Achieved Occupancy|Registers Per|Stall" "$W/ncu.txt" | head -80
  [ -n "${OUT:-}" ] && cp "$W/ncu.txt" "$OUT/ncu.txt"
fi
while [ ! -x /tmp/lcp-build/bin/llama-batched-bench ] && [ $(($(date +%s) - t0)) -lt 420 ]; do sleep 5; done
for shape in ${SHAPES:-llama-3.1-8b llama-3.2-1b}; do
  echo "== llama.cpp $shape"
  /tmp/lcp-build/bin/llama-batched-bench -m "$W/$shape.gguf" -ngl 99 -fa 1 -c 40000 -npp 128 \
    -ntg 128 -npl "${BATCHES:-1,2,4,8,16,64}" 2>&1 | grep -E '^\|'
done
echo "total $(($(date +%s) - t0)) s"
