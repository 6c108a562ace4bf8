#!/usr/bin/env python3
"""Tokenizer speed: ferrolm vs llama.cpp on 1 MB of English text, one thread each.

Builds the text from English documentation found on this machine (Rust release notes, Python
IDLE news), then times llama.cpp's tokenizer (llama-cpp-python, best of N) and ferrolm's
(`examples/tokenize_bench.rs`, best of N) on the same text and the same GGUF.
Usage: python3 scripts/tokenizer_bench.py [MODEL.gguf] [N]
"""
import glob
import os
import subprocess
import sys
import time

import llama_cpp

HOME = os.environ.get("FERROLM_HOME", os.path.expanduser("~/.cache/ferrolm"))
model = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HOME, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
n = int(sys.argv[2]) if len(sys.argv) > 2 else 5
sources = sorted(glob.glob(os.path.expanduser("~/.rustup/toolchains/*/share/doc/rust/html/releases.md")))[:1] + \
    sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/*/lib/python3*/idlelib/NEWS.txt")))[:1] + \
    sorted(glob.glob("/usr/share/vim/vim*/doc/version*.txt"))
text = ""
for s in sources:
    with open(s, encoding="utf-8", errors="replace") as f:
        text += f.read() + "\n"
    if len(text.encode()) >= 1_000_000:
        break
data = text.encode()[:1_000_000].decode("utf-8", errors="ignore")
path = "/tmp/ferrolm-english-1mb.txt"
with open(path, "w", encoding="utf-8") as f:
    f.write(data)
raw = data.encode()
print(f"text: {len(raw)} bytes from {', '.join(sources[:3])} ...")

llm = llama_cpp.Llama(model_path=model, vocab_only=True, verbose=False, n_threads=1, n_threads_batch=1)
vocab = llama_cpp.llama_model_get_vocab(llm.model)
buf = (llama_cpp.llama_token * (len(raw) + 16))()
best = float("inf")
for _ in range(n):
    t = time.perf_counter()
    k = llama_cpp.llama_tokenize(vocab, raw, len(raw), buf, len(raw) + 16, True, True)
    best = min(best, time.perf_counter() - t)
print(f"llama.cpp: {len(raw)} bytes -> {k} tokens, best of {n}: {best*1e3:.1f} ms ({len(raw)/best/1e6:.2f} MB/s)")
root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
subprocess.run(["cargo", "run", "--release", "-q", "-p", "ferrolm-tokenizer", "--example", "tokenize_bench", "--",
                model, path, str(n), "/tmp/ferrolm-bench-ids.txt"], cwd=root, check=True)
with open("/tmp/ferrolm-bench-ids.txt") as f:
    ours = [int(x) for x in f.read().split()]
theirs = list(buf[:k])
same = ours == theirs
first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
print("ids identical to llama.cpp:", same, "" if same else f"(first difference at token {first})")
