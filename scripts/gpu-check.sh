#!/usr/bin/env bash
# One device call: synthetic models made on the spot, the CUDA backend checked against the CPU
# on each (every position's logits: mean KL, top-1; greedy continuations), then timed.
# Usage (on the GPU machine, with a release binary built elsewhere): scripts/gpu-check.sh [BIN]
set -uo pipefail
BIN=${1:-target/release/ferrolm}
W=${WORK:-/tmp/ferrolm-gpu}
mkdir -p "$W"
export FERROLM_HOME=$W/home
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
CHECK_FLAGS=()
check() { # name, synth flags...
  local name=$1; shift
  "$BIN" synth --arch "$@" -o "$W/$name.gguf" >/dev/null || { echo "synth $name failed"; fail=1; return; }
  echo "== $name"
  "$BIN" cuda-check -m "$W/$name.gguf" -p "${NP:-256}" -n "${NG:-64}" "${CHECK_FLAGS[@]}" || fail=1
}
# Small shapes, every block type the kernels read.
for t in q8_0 q4_0 q4_1 q4_k q6_k f16 f32; do
  check "small-$t" llama --layers 2 --type "$t"
done
check small-qwen2 qwen2 --layers 2 --type q8_0
check small-qwen3 qwen3 --layers 2 --head-dim 64 --type q4_0
check small-ropefreqs llama --layers 2 --type q8_0 --rope-freqs --tied
FERROLM_CUDA_NO_GRAPH=1 "$BIN" cuda-check -m "$W/small-q8_0.gguf" -p 16 -n 8 >/dev/null \
  && echo "no-graph mode agrees" || { echo "no-graph mode FAILED"; fail=1; }
# A Llama-3.2-1B-like shape (16 layers, 2048 wide, 32/8 heads, 8192 feed-forward).
CHECK_FLAGS=(--profile 16)
for t in ${BIG_TYPES:-q4_0 q8_0 q4_k}; do
  check "1b-$t" llama --layers 16 --embd 2048 --heads 32 --kv-heads 8 --ff 8192 --ctx 4096 --rope-base 500000 --type "$t"
  echo "-- bench 1b-$t"
  "$BIN" bench -m "$W/1b-$t.gguf" --device cuda -p 512 -n 128 -r 5
  [ -n "${SKIP_CPU:-}" ] || "$BIN" bench -m "$W/1b-$t.gguf" --device cpu -p 32 -n 16 -r 1
done
exit $fail
