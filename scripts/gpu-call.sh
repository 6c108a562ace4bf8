# Sourced (from the repository root, LOG set) by the scripts of a device call, gpu-pending.sh
# and gpu-issue18.sh: the binary, kernels and tokenizer from .bench/ (scripts/gpu-pack.sh),
# files under /tmp/fw (kept between calls on a warm machine), `say` (stdout and LOG), `el`
# (seconds since this started), `moe30` (issue 24's Qwen3-30B-A3B-shaped file made as
# $W/moe30.gguf where no earlier call made it), the GPU named in LOG, and llama.cpp's build
# started in the background where no earlier call of the machine built it or is building it.
source .bench/prep.sh
B=$PWD/.bench/ferrolm; W=/tmp/fw; L=/tmp/lcp-build/bin
T="--tokenizer-from .bench/tok.gguf"
mkdir -p $W; : > $LOG
say() { echo "$@" | tee -a $LOG; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a $LOG
{ [ -x $L/llama-bench ] && [ -x $L/llama-batched-bench ]; } || pgrep -f build-llama-cpp.sh > /dev/null ||
  (setsid nice -n 5 bash .bench/build-llama-cpp.sh .bench/llama.cpp /tmp/lcp-build > /tmp/lcp.out 2>&1 &)
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
moe30() {
  [ -f $W/moe30.gguf ] || { PYTHONPATH=.bench/llama.cpp/gguf-py python3 .bench/make_moe.py \
    qwen3-30b-a3b $W/moe30.tmp > /tmp/moe30.out 2>&1 && mv $W/moe30.tmp $W/moe30.gguf; }
}
