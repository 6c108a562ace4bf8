#!/usr/bin/env python3
"""Checks files written by `ferrolm synth --shape` against llama.cpp (llama-cpp-python==0.3.36).

For each file: llama.cpp (one thread, f16 KV cache) loads it and evaluates one prompt of random
token ids (every position's logits must be finite); with --compare, ferrolm's CPU backend
evaluates the same ids (`ferrolm logits --device cpu`) and the script prints the mean and
largest KL divergence of ferrolm's distribution from llama.cpp's, and top-1 agreement (raw, and
with the 0.01 tie tolerance of MODELS.md).

usage: scripts/shape_check.py [--ferrolm target/release/ferrolm] [--compare] [--n 64] FILE ...
"""
import argparse, os, subprocess, sys, tempfile
import numpy as np
from llama_cpp import Llama


def log_softmax(x):
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ferrolm", default="target/release/ferrolm")
    ap.add_argument("--compare", action="store_true")
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("files", nargs="+")
    a = ap.parse_args()
    for path in a.files:
        llm = Llama(path, n_ctx=max(256, a.n), n_batch=512, n_threads=1, n_threads_batch=1,
                    logits_all=True, verbose=False, type_k=1, type_v=1, flash_attn=False)
        ids = [int(x) for x in np.random.default_rng(7).integers(0, llm.n_vocab(), a.n)]
        llm.reset()
        llm.eval(ids)
        ref = np.array(llm.scores[: len(ids)], dtype=np.float32)
        finite = bool(np.isfinite(ref).all())
        line = f"{os.path.basename(path)}: n_vocab {llm.n_vocab()}, llama.cpp logits finite {finite}, std {ref.std():.3f}"
        if a.compare:
            with tempfile.TemporaryDirectory() as d:
                out = os.path.join(d, "logits.f32")
                subprocess.run([a.ferrolm, "logits", "-m", path, "-t", "1", "--device", "cpu",
                                "--ids", ",".join(map(str, ids)), "-o", out], check=True)
                ours = np.fromfile(out, dtype=np.float32).reshape(len(ids), -1)
            lp, lq = log_softmax(ref), log_softmax(ours)
            kl = (np.exp(lp) * (lp - lq)).sum(axis=-1)
            pick = ours.argmax(axis=-1)
            top1 = (pick == ref.argmax(axis=-1)).mean()
            tol = (ref[np.arange(len(ids)), pick] >= ref.max(axis=-1) - 0.01).mean()
            diff = np.abs(ours - ref).max()
            line += f"; ferrolm: max |logit diff| {diff:.2e}, mean KL {kl.mean():.2e}, max KL {kl.max():.2e}, top-1 {top1:.3f} (within 0.01: {tol:.3f})"
        print(line, flush=True)
        del llm
        if not finite:
            sys.exit(1)


if __name__ == "__main__":
    main()
