#!/usr/bin/env python3
"""Issue 8, item 5: pp512 and tg128 of ferrolm against llama.cpp (llama-cpp-python==0.3.36) on a
synthetic Qwen3-MoE-shaped model scaled to a small machine, same file, same threads, one run.

Writes the file with `ferrolm synth --arch qwen3moe` (random weights in llama.cpp's layout) and
runs scripts/bench_vs_llamacpp.py on it (the two engines alternate rep by rep).

Default shape: 8 layers, width 1024, 16 query / 4 key-value heads of 64, 48 experts of 384 per
layer, top-8 (Qwen3-30B-A3B's routing, scaled down), 959-token vocabulary; every matrix Q8_0,
a type llama.cpp's CPU backend neither repacks nor tiles (its matmuls then do what ours do).
About 500 MB of weights, of which each token reads about 1/6 of the experts.

usage: scripts/moe_speed_bench.py [--threads 1 2] [-r 3] [--type q8_0] [--keep PATH]
"""
import argparse, os, subprocess, sys, tempfile

SHAPE = ["--arch", "qwen3moe", "--layers", "8", "--embd", "1024", "--heads", "16",
         "--kv-heads", "4", "--head-dim", "64", "--ff", "384", "--experts", "48",
         "--experts-used", "8", "--ctx", "4096"]

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("-r", type=int, default=3)
    ap.add_argument("--type", default="q8_0")
    ap.add_argument("--ferrolm", default="target/release/ferrolm")
    ap.add_argument("--keep", help="write the file here and keep it")
    a = ap.parse_args()
    here = os.path.dirname(os.path.abspath(__file__))
    with tempfile.TemporaryDirectory() as tmp:
        path = a.keep or os.path.join(tmp, "qwen3moe-bench.gguf")
        subprocess.run([a.ferrolm, "synth", *SHAPE, "--type", a.type, "-o", path], check=True)
        print(f"shape: {' '.join(SHAPE[1:])}, type {a.type}, "
              f"{os.path.getsize(path) / 1e6:.0f} MB", flush=True)
        subprocess.run([sys.executable, os.path.join(here, "bench_vs_llamacpp.py"), path,
                        "-p", "512", "-n", "128", "-r", str(a.r), "--ferrolm", a.ferrolm,
                        "--threads", *map(str, a.threads)], check=True)

if __name__ == "__main__":
    main()
