#!/usr/bin/env bash
# One device call: the measurements docs/PERFORMANCE.md's latest CUDA section leaves for the
# next call with a GPU, beside llama.cpp built in the same call. Run on the GPU machine from the
# repository root after `scripts/gpu-pack.sh` filled .bench/ here (carry only what it needs:
# the tracked tree is ~28 MB of the 64 MiB):
#   run(command="bash scripts/gpu-pending.sh", carry=[".bench/ferrolm.gz",
#       ".bench/kernels.tar.gz", ".bench/prep.sh", ".bench/build-llama-cpp.sh",
#       ".bench/llama.cpp.tar.gz", ".bench/tok.gguf", ".bench/make_moe.py",
#       ".bench/make_gguf.py"])   (about 9 min)
# 1. (with HYBRID=1) `FERROLM_CUDA_SHARED_IN_GRID=1` (the shared expert as one more grid row of
#    the routed experts' launches) and `FERROLM_CUDA_DELTA_RUNS=1` (the decode delta rule's state
#    read in runs of 16), both off until measured: cuda-check on the hybrid and qwen2moe, then
#    tg128 on issue 19's hybrid-1g with neither, each and both, alternating;
# 2. issue 24: a Qwen3-30B-A3B-shaped file (48 layers, 128 experts top-8, Q4_0, by make_moe.py
#    in the background from the start), resident pp512 and tg64 with and without
#    `FERROLM_CUDA_ROUTER_IN_ROUTE=1` (its rows in runs of columns since session 22), and
#    cuda-check with and without it; under `--gpu-memory 6` the CPU tier
#    (`FERROLM_CUDA_CPU_EXPERTS`, 2 by default) and the slot cache (`FERROLM_CUDA_EXPERT_SLOTS=1`);
# 3. issue 18: the 8B Q4_K_M at B=16 with the defaults (Q, K, V and gate, up as one launch each,
#    gate, up and the activation as one), without them, and with the Q6_K matrices' f16 copies
#    through `skinny_gemm_16`; cuda-check --batch 16;
# 4. llama.cpp's pp512 and tg on the same files (llama-bench, and `-ncmoe 36`),
#    llama-batched-bench on the 8B; and the pinned host-to-device copy rate.
# Everything lands in $OUT/pending.txt (and on stdout).
set -uo pipefail
cd "$(dirname "$0")/.."
LOG=${OUT:-/tmp}/pending.txt
source scripts/gpu-call.sh
# (make_moe.py: random Q4_0 blocks from torch on the GPU, about 25 s; `ferrolm synth --arch`
# took over 230 s for this file in session 19, drawing on one core then)
[ -f $W/moe30.gguf ] || (PYTHONPATH=.bench/llama.cpp/gguf-py setsid python3 .bench/make_moe.py \
  qwen3-30b-a3b $W/moe30.tmp > /tmp/moe30.out 2>&1 && mv $W/moe30.tmp $W/moe30.gguf &)
[ -f $W/8b.gguf ] || (setsid $B synth --shape llama-3.1-8b --type q4_k_m $T -o $W/8b.tmp \
  > /dev/null 2>&1 && mv $W/8b.tmp $W/8b.gguf &)
[ "${HYBRID:-0}" = 0 ] || [ -f $W/hy.gguf ] || $B synth --arch qwen3next --embd 2048 --layers 24 --heads 16 --kv-heads 2 \
  --head-dim 128 --ff 512 --experts 16 --experts-used 4 --ssm-state 128 --ssm-k-heads 16 \
  --ssm-v-heads 32 --full-attention-interval 4 --ctx 4096 --type q4_0 $T -o $W/hy.gguf > /dev/null
[ "${HYBRID:-0}" = 0 ] || [ -f $W/q2m.gguf ] || $B synth --arch qwen2moe --layers 4 --embd 1024 --heads 16 --kv-heads 4 \
  --head-dim 64 --ff 512 --experts 32 --experts-used 4 --type q4_0 -o $W/q2m.gguf > /dev/null
say "== files $(el) s"
# (issue 24's bus arithmetic, docs/EXPERT_STREAMING.md: the pinned host-to-device copy rate)
python3 - <<'PY' 2>&1 | tee -a $LOG
import torch, time
a = torch.empty(2 << 30, dtype=torch.uint8).pin_memory(); b = torch.empty_like(a, device="cuda")
for _ in range(2): b.copy_(a, non_blocking=True)
torch.cuda.synchronize(); t = time.perf_counter()
for _ in range(5): b.copy_(a, non_blocking=True)
torch.cuda.synchronize(); print(f"pinned host-to-device copy: {5 * a.numel() / (time.perf_counter() - t) / 1e9:.1f} GB/s")
PY
while [ ! -f $W/8b.gguf ] && [ $(el) -lt 300 ]; do sleep 5; done
NO="FERROLM_CUDA_NO_DQ_SEGMENTS=1 FERROLM_CUDA_NO_DQ_GLU=1"
SK=FERROLM_CUDA_SKINNY_GEMM_MAX_ROWS=16
for v in FERROLM_UNUSED=1 "$NO" $SK FERROLM_UNUSED=1; do
  say "== 8b B=16 $v ($(el) s)"
  env $v timeout 60 $B bench -m $W/8b.gguf --device cuda --batch 16 -p 128 -n 128 2>&1 | grep -E '^\| +[0-9]|rror|anic' | tee -a $LOG | tee /tmp/row
  tg=$(awk -F'|' '/^\| +[0-9]/{printf "%d", $9}' /tmp/row)
  # (the fastest settings, for a gpu-issue18.sh call on the same machine: ENV="$(cat /tmp/best-env)")
  if [ -n "$tg" ] && [ "$tg" -gt "${best:-0}" ]; then best=$tg; echo "$v" > /tmp/best-env; fi
done
say "fastest at B=16: $(cat /tmp/best-env) ($best)"
say "== 8b cuda-check --batch 16 ($(el) s)"
timeout 90 $B cuda-check -m $W/8b.gguf --batch 16 -p 32 -n 4 2>&1 | grep -E '^\| |rror' | tail -2 | tee -a $LOG
while [ ! -f $W/moe30.gguf ] && [ $(el) -lt 360 ]; do sleep 5; done
say "== moe30 pp512 tg64 ($(el) s)"
timeout 90 $B bench -m $W/moe30.gguf --device cuda -p 512 -n 64 -r 2 2>&1 | grep -E 'pp512|tg64|rror|anic' | tee -a $LOG
say "== moe30 cuda-check (moe_route's block sum, session 22) ($(el) s)"
timeout 60 $B cuda-check -m $W/moe30.gguf -p 32 -n 8 2>&1 | grep -E 'decode steps|prompt batch|rror' | tee -a $LOG
RR=FERROLM_CUDA_ROUTER_IN_ROUTE=1
say "== moe30 tg64 $RR, then cuda-check with it ($(el) s)"
env $RR timeout 60 $B bench -m $W/moe30.gguf --device cuda -p 0 -n 64 -r 2 2>&1 | grep -E 'tg64|rror|anic' | tee -a $LOG
env $RR timeout 60 $B cuda-check -m $W/moe30.gguf -p 32 -n 8 2>&1 | grep -E 'decode steps|rror' | tee -a $LOG
# Issue 24's CPU tier and slot cache under --gpu-memory 6 (scripts/gpu-cpu-tier.sh has more).
CE=FERROLM_CUDA_CPU_EXPERTS; ES=FERROLM_CUDA_EXPERT_SLOTS=1
for v in "$CE=0" "$CE=2" "$ES $CE=0" "$ES"; do
  say "== moe30 --gpu-memory 6 tg64, $v ($(el) s)"
  env $v timeout 90 $B bench -m $W/moe30.gguf --device cuda --gpu-memory 6 -t 16 -p 0 -n 64 -r 2 2>&1 |
    grep -E 'tg64|rror|anic' | tee -a $LOG
done
say "== moe30 --gpu-memory 6 cuda-check, $ES ($(el) s)"
env $ES timeout 90 $B cuda-check -m $W/moe30.gguf --gpu-memory 6 -t 16 -p 32 -n 8 2>&1 |
  grep -E 'decode steps|prompt batch|rror|anic' | tee -a $LOG
if [ "${HYBRID:-0}" = 1 ]; then
SG=FERROLM_CUDA_SHARED_IN_GRID=1
for f in hy q2m; do
  say "== $f cuda-check, $SG ($(el) s)"
  env $SG timeout 90 $B cuda-check -m $W/$f.gguf -p 128 -n 16 2>&1 | grep -E 'decode steps|prompt batch|kernels in' | tee -a $LOG
done
DR=FERROLM_CUDA_DELTA_RUNS=1
say "== hy cuda-check, $DR ($(el) s)"
env $DR timeout 90 $B cuda-check -m $W/hy.gguf -p 128 -n 16 2>&1 | grep -E 'decode steps|prompt batch' | tee -a $LOG
for v in FERROLM_UNUSED=1 $SG $DR "$SG $DR" FERROLM_UNUSED=1 "$SG $DR"; do
  say "== hy tg128 $v ($(el) s)"
  env $v timeout 40 $B bench -m $W/hy.gguf --device cuda -p 0 -n 128 -r 3 2>&1 | grep -E 'tg128|rror|anic' | tee -a $LOG
done
fi
# llama.cpp where its build (started in the background) is done by now; else gpu-issue18.sh on
# the same machine runs it (the build goes on between calls on a warm machine).
while [ ! -x $L/llama-bench ] && [ $(el) -lt 400 ]; do sleep 5; done
if [ -x $L/llama-bench ]; then
  say "== llama.cpp ($(el) s)"
  timeout 60 $L/llama-batched-bench -m $W/8b.gguf -ngl 99 -fa 1 -c 40000 -npp 128 -ntg 128 -npl 16 2>&1 | grep -E '^\|' | tail -1 | tee -a $LOG
  timeout 120 $L/llama-bench -m $W/moe30.gguf -ngl 99 -fa 1 -p 512 -n 64 -r 2 2>&1 | grep -E '^\|' | tee -a $LOG
  timeout 100 $L/llama-bench -m $W/moe30.gguf -ngl 99 -fa 1 -ncmoe 36 -t 16 -p 0 -n 64 -r 2 2>&1 | grep -E '^\|' | tee -a $LOG
fi
# Where the MoE token and the 8B's batched step spend their time now (events, kernel by kernel).
timeout 60 $B cuda-check -m $W/moe30.gguf -p 16 -n 2 --profile 16 > ${OUT:-/tmp}/moe30-profile.txt 2>&1
env $(cat /tmp/best-env) timeout 40 $B cuda-check -m $W/8b.gguf --batch 16 -p 16 -n 2 --profile 1 \
  > ${OUT:-/tmp}/8b-b16-profile.txt 2>&1
say "total $(el) s"
