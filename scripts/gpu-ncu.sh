#!/usr/bin/env bash
# One device call: Nsight Compute (ncu, present on the GPU machine under /usr/local/cuda/bin) on
# the decode kernels of one synthetic real-shape file, a few launches of each, and a table of
# what bounds them (time, DRAM throughput, achieved occupancy, registers).
# Usage (on the GPU machine): scripts/gpu-ncu.sh [BIN] [TOKENIZER_GGUF]
#   env: SHAPE=llama-3.2-1b TYPE=q4_k_m KERNELS='matvec|attn_split|rms_norm' SKIP=40 COUNT=12
#        NCU_EXTRA='--section WarpStateStats' (more sections, in ncu.txt)
set -uo pipefail
BIN=${1:-target/release/ferrolm}
TOK=${2:-}
W=${WORK:-/tmp/ferrolm-gpu}
mkdir -p "$W"
export FERROLM_HOME=$W/home
NCU=${NCU:-/usr/local/cuda/bin/ncu}
f=$W/${SHAPE:-llama-3.2-1b}-${TYPE:-q4_k_m}.gguf
[ -f "$f" ] || "$BIN" synth --shape "${SHAPE:-llama-3.2-1b}" --type "${TYPE:-q4_k_m}" \
  ${TOK:+--tokenizer-from "$TOK"} -o "$f" >/dev/null || exit 1
# Compile and cache the kernels outside the profiler.
"$BIN" bench -m "$f" --device cuda -p 0 -n 4 -r 1 >/dev/null 2>&1
out=$W/ncu.txt
"$NCU" --kernel-name "regex:${KERNELS:-matvec|attn_split|rms_norm|quantize_act|rope_store}" \
  --launch-skip "${SKIP:-40}" --launch-count "${COUNT:-12}" \
  --section SpeedOfLight --section Occupancy --section LaunchStats ${NCU_EXTRA:-} \
  "$BIN" bench -m "$f" --device cuda -p 0 -n 8 -r 1 > "$out" 2>&1 || { tail -20 "$out"; exit 1; }
[ -n "${OUT:-}" ] && cp "$out" "$OUT/ncu.txt"
echo "| kernel | grid x threads | us | DRAM GB/s | DRAM % | achieved occupancy | registers |"
echo "| --- | --- | ---: | ---: | ---: | ---: | ---: |"
awk '
  /^  [A-Za-z_0-9]+ \(/ {
    if (name != "") print row
    name = $1; g = $0; sub(/^[^(]*\(/, "", g); split(g, p, /[(), x]+/); grid = p[1] " x " p[4]
    dur = gbs = dram = occ = regs = ""
  }
  /Duration/ { dur = $NF }
  /DRAM Throughput/ { dram = $NF }
  /Memory Throughput.*byte\/s/ { gbs = $NF }
  /Achieved Occupancy/ { occ = $NF }
  /Registers Per Thread/ { regs = $NF }
  { row = "| " name " | " grid " | " dur " | " gbs " | " dram " | " occ " | " regs " |" }
  END { if (name != "") print row }
' "$out"
