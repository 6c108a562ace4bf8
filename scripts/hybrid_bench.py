#!/usr/bin/env python3
"""Speed of a hybrid recurrent model (qwen3next) against llama.cpp (llama-cpp-python==0.3.36) on
the same synthetic file, one thread each: pp512 and tg128 (scripts/bench_vs_llamacpp.py), then
decode speed at context depths 32 and 4096, to show that the gated delta-net layers' cost per
token does not grow with the context (only the attention layers', one in four, does).

usage: scripts/hybrid_bench.py [--ferrolm target/release/ferrolm] [-r 3] [--depths 32 4096]

The file: 12 layers 1024 wide (9 delta-net layers: 4 key / 8 value heads of 128, 4-tap conv;
3 attention layers: 8 heads of 128, 2 KV heads), 8 experts top-2 of 512 plus a shared expert,
every matrix Q8_0. Built here with `ferrolm synth` (cargo build --release -p ferrolm first, and
cargo build --release -p ferrolm-model --example tg_depth).
"""
import argparse, json, os, random, statistics, subprocess, sys, tempfile, time

SYNTH = ["--arch", "qwen3next", "--embd", "1024", "--layers", "12", "--heads", "8",
         "--kv-heads", "2", "--head-dim", "128", "--ff", "512", "--experts", "8",
         "--experts-used", "2", "--ssm-state", "128", "--ssm-k-heads", "4", "--ssm-v-heads", "8",
         "--ctx", "8192", "--type", "q8_0"]
TG_DEPTH = "target/release/examples/tg_depth"

def llama_tg_at(llm, depth, n, seed):
    rng = random.Random(seed)
    ids = [rng.randrange(llm.n_vocab()) for _ in range(depth)]
    llm.reset()
    if hasattr(llm._ctx, "memory_clear"):
        llm._ctx.memory_clear(True)
    llm.eval(ids)
    tok = int(llm.scores[llm.n_tokens - 1].argmax())
    t = time.perf_counter()
    for _ in range(n):
        llm.eval([tok])
        tok = int(llm.scores[llm.n_tokens - 1].argmax())
    return n / (time.perf_counter() - t)

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ferrolm", default="target/release/ferrolm")
    ap.add_argument("-r", type=int, default=3)
    ap.add_argument("-n", type=int, default=64, help="decode steps timed at each depth")
    ap.add_argument("--depths", type=int, nargs="+", default=[32, 4096])
    ap.add_argument("--skip-pp", action="store_true", help="only the decode-at-depth table")
    ap.add_argument("--full-attention-interval", type=int, default=4,
                    help="every N-th layer attention (12: only the last, which isolates the "
                         "delta-nets' decode cost; llama.cpp b11312 aborts on a file without "
                         "attention layers)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "qwen3next-bench.gguf")
        subprocess.run([a.ferrolm, "synth", *SYNTH, "--full-attention-interval",
                        str(a.full_attention_interval), "-o", path], check=True)
        here = os.path.dirname(os.path.abspath(__file__))
        if not a.skip_pp:
            subprocess.run([sys.executable, os.path.join(here, "bench_vs_llamacpp.py"), path,
                            "--threads", "1", "-r", str(a.r), "--ferrolm", a.ferrolm], check=True)
        from llama_cpp import Llama
        # logits_all: llama-cpp-python keeps a row of scores per position only then (the
        # prompt's logits are not timed, only the decode steps after it).
        llm = Llama(model_path=path, n_ctx=max(a.depths) + a.n + 16, n_batch=512, n_threads=1,
                    n_threads_batch=1, logits_all=True, verbose=False)
        rows = []
        for depth in a.depths:
            f, l = [], []
            for r in range(a.r):
                out = subprocess.run([TG_DEPTH, path, str(depth), str(a.n), "1"], check=True,
                                     capture_output=True, text=True).stdout
                f.append(json.loads(out)["tg"])
                l.append(llama_tg_at(llm, depth, a.n, r))
            rows.append((depth, statistics.median(f), statistics.median(l)))
        print(f"\ndecode at context depth, {a.n} tokens timed, 1 thread, reps: {a.r} (median)")
        print("| depth | ferrolm tg t/s | llama.cpp tg t/s | ratio |")
        print("| ---: | ---: | ---: | ---: |")
        for depth, fm, lm in rows:
            print(f"| {depth} | {fm:.2f} | {lm:.2f} | {fm / lm:.2f}x |")

if __name__ == "__main__":
    main()
