#!/usr/bin/env bash
# One device call: synthetic models made on the spot, the CUDA backend checked against the CPU
# on each (every position's logits of a random prompt through decode steps and as one prompt
# batch: mean KL, top-1; greedy continuations), then timed; one summary table at the end.
# Usage (on the GPU machine, with a release binary built elsewhere):
#   [QUANT_DIR=DIR] scripts/gpu-check.sh [BIN] [TOKENIZER_GGUF]
# TOKENIZER_GGUF: a GGUF holding the default model's tokenizer.* keys (the GPU machine cannot
# fetch the default model); the real-shape files borrow it. Env: SECTIONS="small shapes"
# (and "newer": the i-quant, ternary, 1-bit and NVFP4 types, the hybrids and gpt-oss;
# "prompts": the prompt kernels of the hybrids and the experts, heads of 64 and 128, and
# issue 19's 1 GB qwen3next file timed; "hybrid": issue 19's 1 GB
# qwen3next file, checked and timed; "gemma": heads of 256 on the tensor cores, issue 19's
# Gemma-3-1B shape checked and timed, with GEMMA_TOK's tokenizer where given).
# The first CUDA start on a fresh machine compiles the kernels with NVRTC (minutes); the
# kernels are compiled first here, while the files are made, and cached in $FERROLM_HOME.
# KERNEL_CACHE=DIR: *.cubin files made beforehand on any machine with NVRTC (`cargo run --release
# -p ferrolm-cuda --example compile_kernels`, FERROLM_HOME=...) put in that cache first.
set -uo pipefail
BIN=${1:-target/release/ferrolm}
TOK=${2:-}
W=${WORK:-/tmp/ferrolm-gpu}
mkdir -p "$W"
export FERROLM_HOME=$W/home
[ -n "${KERNEL_CACHE:-}" ] && mkdir -p "$FERROLM_HOME/kernels" && cp "$KERNEL_CACHE"/*.cubin "$FERROLM_HOME/kernels/"
SUMMARY=$W/summary.md
: > "$SUMMARY"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader || true
python3 - <<'PY' 2>/dev/null || echo "(no torch: copy bandwidth not measured)"
import torch, time
n = 2 << 30
a = torch.empty(n, dtype=torch.uint8, device="cuda"); b = torch.empty_like(a)
for _ in range(3): b.copy_(a)
torch.cuda.synchronize(); t = time.perf_counter()
for _ in range(20): b.copy_(a)
torch.cuda.synchronize(); dt = (time.perf_counter() - t) / 20
print(f"device-to-device copy: {2 * n / dt / 1e12:.2f} TB/s (read + write)")
PY
fail=0
# Compile (and cache) the kernels in the background while the first files are made.
"$BIN" synth --arch llama --layers 1 -o "$W/warm.gguf" >/dev/null 2>&1 &&
  ( "$BIN" cuda-check -m "$W/warm.gguf" -p 4 -n 2 >/dev/null 2>&1 & )
# check NAME NP NG: cuda-check of $W/NAME.gguf; its rows go to the summary.
check() {
  local name=$1 np=$2 ng=$3
  echo "== $name"
  local out
  out=$("$BIN" cuda-check -m "$W/$name.gguf" -p "$np" -n "$ng" ${PROFILE:+--profile $PROFILE} 2>&1) || fail=1
  echo "$out"
  echo "$out" | grep -E '^\| [^ ]+\.gguf \| (decode steps|prompt batch) ' >> "$SUMMARY.check"
  echo "$out" | grep -q "^ferrolm: error" && echo "| $name | FAILED: $(echo "$out" | grep '^ferrolm: error' | head -1) |" >> "$SUMMARY.check"
}
# run_text NAME: `ferrolm run` greedy on the CPU and on CUDA (the generation loop that queues each
# step before reading the token before it); how many bytes of the text agree (informational:
# a near-tie of a random-weight file can part them, as cuda-check's greedy rows show).
run_text() {
  local name=$1 a b n=0
  a=$("$BIN" run -m "$W/$name.gguf" --device cpu --temp 0 -n 48 "Once upon a time" 2>/dev/null)
  b=$("$BIN" run -m "$W/$name.gguf" --device cuda --temp 0 -n 48 "Once upon a time" 2>/dev/null)
  while [ $n -lt ${#a} ] && [ "${a:$n:1}" = "${b:$n:1}" ]; do n=$((n + 1)); done
  echo "run --temp 0 -n 48: CUDA's text agrees with the CPU's on the first $n of ${#a} bytes (CUDA: ${#b})"
}
bench() {
  local name=$1
  local out
  out=$("$BIN" bench -m "$W/$name.gguf" --device cuda -p 512 -n 128 -r "${REPS:-5}" 2>&1) || fail=1
  echo "$out"
  local pp tg bw
  pp=$(echo "$out" | awk -F'|' '/ pp512 /{gsub(/ /,"",$7); print $7}')
  tg=$(echo "$out" | awk -F'|' '/ tg128 /{gsub(/ /,"",$7); print $7}')
  bw=$(echo "$out" | sed -n 's/.* \([0-9]*\) GB\/s at .*/\1/p')
  # llama.cpp's figures from issue 6 (b11312, CUDA, flash attention, an H200), where known
  local ref rpp rtg
  ref=$(case $name in
    smollm2-135m-q4_k_m) echo "51800 860" ;;
    llama-3.2-1b-q4_k_m) echo "36400 870" ;;
    llama-3.2-1b-q4_0) echo "38400 958" ;;
    llama-3.2-1b-q8_0) echo "45400 812" ;;
    llama-3.1-8b-q4_k_m) echo "9700 268" ;;
    llama-3.1-8b-f16) echo "24000 209" ;;
  esac)
  rpp=${ref% *}; rtg=${ref#* }
  ratio() { [ -n "$2" ] && [ -n "$1" ] && awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2fx", a / b }'; }
  echo "| $name | $pp | ${rpp} | $(ratio "$pp" "$rpp") | $tg | ${rtg} | $(ratio "$tg" "$rtg") | $bw |" >> "$SUMMARY.bench"
}
# Issue 19's hybrid benchmark file: qwen3next, 24 layers 2048 wide (attention every 4th: 16
# heads of 128, 2 KV heads; delta-nets of 16 key / 32 value heads of 128), 16 experts top-4 of
# 512, every matrix Q4_0: 1.09 GB, as $W/hybrid-1g.gguf.
hybrid_1g() {
  "$BIN" synth --arch qwen3next --embd 2048 --layers 24 --heads 16 --kv-heads 2 --head-dim 128 \
    --ff 512 --experts 16 --experts-used 4 --ssm-state 128 --ssm-k-heads 16 --ssm-v-heads 32 \
    --full-attention-interval 4 --ctx 4096 --type q4_0 ${TOK:+--tokenizer-from "$TOK"} \
    -o "$W/hybrid-1g.gguf" >/dev/null
}
for section in ${SECTIONS:-small shapes}; do
  if [ "$section" = small ]; then
    # Small files of every block type the kernels read, and the layer features.
    for t in q8_0 q4_0 q4_1 q5_0 q5_1 q4_k q6_k f16 f32; do
      "$BIN" synth --arch llama --layers 2 --type "$t" -o "$W/small-$t.gguf" >/dev/null && check "small-$t" 256 64
    done
    "$BIN" synth --arch qwen2 --layers 2 --type q8_0 -o "$W/small-qwen2.gguf" >/dev/null && check small-qwen2 256 64
    "$BIN" synth --arch qwen3 --layers 2 --head-dim 64 --type q4_0 -o "$W/small-qwen3.gguf" >/dev/null && check small-qwen3 256 64
    "$BIN" synth --arch llama --layers 2 --type q8_0 --rope-freqs --tied -o "$W/small-ropefreqs.gguf" >/dev/null && check small-ropefreqs 256 64
    # Files of other block types made elsewhere (llama-quantize --pure of an F16 synthetic file,
    # or `ferrolm synth --type bf16|mxfp4`): QUANT_DIR/small-*.gguf.
    for f in ${QUANT_DIR:+$QUANT_DIR/small-*.gguf}; do
      name=$(basename "$f" .gguf); cp "$f" "$W/$name.gguf" && check "$name" 256 64
    done
    FERROLM_CUDA_NO_GRAPH=1 "$BIN" cuda-check -m "$W/small-q8_0.gguf" -p 16 -n 8 >/dev/null \
      && echo "no-graph mode agrees" || { echo "no-graph mode FAILED"; fail=1; }
  fi
  if [ "$section" = newer ]; then
    # The i-quant, ternary, 1-bit and NVFP4 block types, the hybrids' gated delta-nets and
    # gated attention, gpt-oss (first compared on a GPU 2026-12-02, docs/PARITY.md).
    for t in iq1_s iq1_m iq2_xxs iq2_xs iq2_s iq3_xxs iq3_s iq4_xs tq1_0 tq2_0 q1_0 q2_0 nvfp4; do
      "$BIN" synth --arch llama --layers 2 --type "$t" -o "$W/small-$t.gguf" >/dev/null && check "small-$t" 256 64
    done
    for a in qwen3next qwen35 qwen35moe gpt-oss; do
      "$BIN" synth --arch "$a" -o "$W/small-$a.gguf" >/dev/null && check "small-$a" 128 32
      # several sequences a step, joining and leaving (each row its own states, sinks, biases)
      "$BIN" cuda-check -m "$W/small-$a.gguf" --batch 4 -p 64 -n 16 2>&1 | tail -3 || fail=1
    done
    "$BIN" synth --arch qwen3next --ssm-split -o "$W/small-qwen3next-split.gguf" >/dev/null \
      && check small-qwen3next-split 128 32
  fi
  if [ "$section" = prompts ]; then
    # The prompts' delta-net convolution in runs and chunked delta rule (heads of 64 and 128)
    # and moe_group_warp, on small files; then the 1 GB hybrid checked and timed.
    for spec in "qwen3next:--ssm-state 64" "qwen3next-split:--ssm-split --ssm-state 64" \
      "qwen35:--ssm-state 128" "qwen35moe:--ssm-state 64" "qwen3moe:--head-dim 64"; do
      name=${spec%%:*}; a=${name%-split}
      "$BIN" synth --arch "$a" ${spec#*:} -o "$W/prompt-$name.gguf" >/dev/null &&
        check "prompt-$name" 256 32
    done
    hybrid_1g && check hybrid-1g 256 8 && bench hybrid-1g
  fi
  if [ "$section" = hybrid ]; then
    # Issue 19's hybrid benchmark file (hybrid_1g), checked, then timed; LLAMA_BENCH (a
    # llama-bench binary) times llama.cpp on the same file in the same sitting.
    hybrid_1g && check hybrid-1g 128 16 && bench hybrid-1g
    [ -n "${LLAMA_BENCH:-}" ] && "$LLAMA_BENCH" -m "$W/hybrid-1g.gguf" -ngl 99 -fa 1 -p 512 -n 128
  fi
  if [ "$section" = gemma ]; then
    # Heads of 256 (attn_mma_256) on a small gemma3 file, then the Gemma-3-1B shape (the
    # 262,144-token vocabulary with GEMMA_TOK, a GGUF holding Gemma 3's tokenizer); LLAMA_BENCH
    # times llama.cpp on it in the same sitting.
    "$BIN" synth --arch gemma3 --layers 4 --embd 512 --heads 4 --kv-heads 1 --head-dim 256 \
      --ff 1024 --sliding-window 64 --type q8_0 -o "$W/gemma-256.gguf" >/dev/null &&
      check gemma-256 256 16
    "$BIN" synth --arch gemma3 --layers 26 --embd 1152 --heads 4 --kv-heads 1 --head-dim 256 \
      --ff 6912 --sliding-window 512 --tied --type q8_0 ${GEMMA_TOK:+--tokenizer-from "$GEMMA_TOK"} \
      -o "$W/gemma-1b.gguf" >/dev/null && check gemma-1b 256 8 && bench gemma-1b
    [ -n "${LLAMA_BENCH:-}" ] && "$LLAMA_BENCH" -m "$W/gemma-1b.gguf" -ngl 99 -fa 1 -p 512 -n 128
  fi
  if [ "$section" = shapes ]; then
    # Real models' shapes and llama-quantize's type mixes (issue 6's table).
    for st in ${SHAPES:-smollm2-135m:q4_k_m llama-3.2-1b:q4_k_m llama-3.2-1b:q4_0 llama-3.2-1b:q8_0 qwen2.5-0.5b:q4_k_m llama-3.1-8b:q4_k_m llama-3.1-8b:f16}; do
      shape=${st%%:*}; type=${st##*:}; name=$shape-$type
      "$BIN" synth --shape "$shape" --type "$type" ${TOK:+--tokenizer-from "$TOK"} -o "$W/$name.gguf" || { fail=1; continue; }
      case $shape in *8b) check "$name" 128 16 ;; *) check "$name" 256 64 ;; esac
      [ "$shape" = smollm2-135m ] && run_text "$name"
      bench "$name"
      rm -f "$W/$name.gguf"
    done
  fi
done
{
  echo "### exactness: CUDA against ferrolm's CPU backend on the same file"
  echo "| file | CUDA path | positions | mean KL | max KL | top-1 (ties within 0.01) | top-1 raw | max abs logit diff | greedy same | CPU pp tok/s | CUDA tok/s |"
  echo "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
  cat "$SUMMARY.check" 2>/dev/null
  echo
  echo "### speed: ferrolm bench --device cuda -p 512 -n 128 -r ${REPS:-5} (median)"
  echo "| file | pp512 tok/s | llama.cpp | ratio | tg128 tok/s | llama.cpp | ratio | tg GB/s (weights + KV read per token) |"
  echo "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
  cat "$SUMMARY.bench" 2>/dev/null
} > "$SUMMARY"
rm -f "$SUMMARY.check" "$SUMMARY.bench"
cat "$SUMMARY"
[ -n "${OUT:-}" ] && cp "$SUMMARY" "$OUT/summary.md"
exit $fail
