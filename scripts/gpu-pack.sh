#!/usr/bin/env bash
# On the development machine: fills .bench/ (an ignored folder, listed in .git/info/exclude) with
# what a device call carries, so that a call runs ferrolm and llama.cpp without compiling either
# ferrolm or its kernels there:
#   ferrolm.gz       the stripped release binary, gzipped (~6 MB)
#   kernels.tar.gz   the kernels' CUBIN for sm_90 (NVRTC here: a fresh GPU machine would spend
#                    minutes compiling them), as kernels/<hash>-sm_90.cubin
#   tok.gguf         a one-layer GGUF holding the default model's tokenizer, for `synth
#                    --tokenizer-from` there (the GPU machine cannot fetch the default model)
#   gtok.gguf.gz     the same of Gemma 3 270M's tokenizer (gzipped, ~6 MB)
#   llama.cpp.tar.gz llama.cpp b11312's trimmed source (../shared/bench/fetch-llama-cpp.sh)
#   prep.sh          sourced by a call's script: unpacks the three into /tmp/fw, FERROLM_HOME set
#   and ../shared/bench's scripts (shared/ does not travel).
# Then: run(command="bash .bench/<call>.sh", carry=[".bench"]). The binary and kernels are made
# again on every use; the tokenizer file and llama.cpp's source only once.
#   scripts/gpu-pack.sh
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
B="$ROOT/.bench"
SHARED="$ROOT/../shared/bench"
mkdir -p "$B"
grep -qx '/.bench/' "$ROOT/.git/info/exclude" 2>/dev/null || echo '/.bench/' >> "$ROOT/.git/info/exclude"
cd "$ROOT"
cargo build --release --quiet -p ferrolm
strip -o "$B/ferrolm.stripped" target/release/ferrolm
gzip -c "$B/ferrolm.stripped" > "$B/ferrolm.gz"
rm -f "$B/ferrolm.stripped"
# (NVRTC from the wheel scripts/test installs)
NVRTC_DIR="${FERROLM_HOME:-$HOME/.cache/ferrolm}/nvrtc"
[ -d "$NVRTC_DIR/nvidia/cuda_nvrtc/lib" ] ||
  python3 -m pip install --quiet --no-deps --target "$NVRTC_DIR" nvidia-cuda-nvrtc-cu12==12.9.86
HOME_K=$(mktemp -d)
FERROLM_HOME="$HOME_K" LD_LIBRARY_PATH="$NVRTC_DIR/nvidia/cuda_nvrtc/lib" \
  cargo run --release --quiet -p ferrolm-cuda --example compile_kernels
tar czf "$B/kernels.tar.gz" -C "$HOME_K" kernels
rm -rf "$HOME_K"
if [ ! -f "$B/tok.gguf" ]; then
  DEFAULT="${FERROLM_HOME:-$HOME/.cache/ferrolm}/models/SmolLM2-135M-Instruct.Q4_1.gguf"
  [ -f "$DEFAULT" ] || target/release/ferrolm pull all
  target/release/ferrolm synth --arch llama --layers 1 --embd 64 --heads 2 --kv-heads 1 --ff 64 \
    --tokenizer-from "$DEFAULT" -o "$B/tok.gguf" > /dev/null
fi
if [ ! -f "$B/gtok.gguf.gz" ]; then
  # (Gemma 3's 262,144-token vocabulary, for the Gemma-shaped files of scripts/gpu-pending.sh)
  GEMMA="${FERROLM_HOME:-$HOME/.cache/ferrolm}/models/gemma-3-270m-q4_k_m.gguf"
  [ -f "$GEMMA" ] || target/release/ferrolm pull all
  target/release/ferrolm synth --arch gemma3 --layers 1 --embd 32 --heads 1 --kv-heads 1 \
    --head-dim 32 --ff 32 --type q4_0 --tied --tokenizer-from "$GEMMA" -o "$B/gtok.gguf" > /dev/null
  gzip -f "$B/gtok.gguf"
fi
if [ ! -f "$B/llama.cpp.tar.gz" ]; then
  T=$(mktemp -d)
  bash "$SHARED/fetch-llama-cpp.sh" "$T/llama.cpp" > /dev/null
  tar czf "$B/llama.cpp.tar.gz" -C "$T" llama.cpp
  rm -rf "$T"
fi
for s in build-llama-cpp.sh make_gguf.py make_moe.py side-by-side.sh llama-floor.sh; do
  [ -f "$SHARED/$s" ] && cp -f "$SHARED/$s" "$B/"
done
cat > "$B/prep.sh" <<'PREP'
# Sourced by a device call's script: the carried binary, kernel cache and llama.cpp source
# unpacked (FERROLM_HOME=/tmp/fw/home; the binary at .bench/ferrolm).
cd "$(dirname "${BASH_SOURCE[0]}")"
# (a warm machine keeps the binary an earlier call unpacked: unpacked again when older)
[ ferrolm -nt ferrolm.gz ] || { gunzip -c ferrolm.gz > ferrolm; chmod +x ferrolm; }
[ -d llama.cpp ] || tar xzf llama.cpp.tar.gz
W=/tmp/fw; mkdir -p $W/home; export FERROLM_HOME=$W/home
tar xzf kernels.tar.gz -C $FERROLM_HOME
cd - >/dev/null
PREP
du -sh "$B"
