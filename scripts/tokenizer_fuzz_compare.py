#!/usr/bin/env python3
"""Ad-hoc differential check (not run by CI): N pseudo-random strings over many scripts, and
special-token fragments, tokenized by llama.cpp and by ferrolm (examples/encode_json.rs).
Usage: python3 scripts/tokenizer_fuzz_compare.py [N] [SEED]"""
import json
import os
import random
import subprocess
import sys

import llama_cpp

HOME = os.environ.get("FERROLM_HOME", os.path.expanduser("~/.cache/ferrolm"))
N = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
rng = random.Random(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
RANGES = [(0x20, 0x7E)] * 6 + [(0x09, 0x0D), (0xA0, 0x24F), (0x300, 0x36F), (0x370, 0x4FF), (0x590, 0x6FF),
          (0x900, 0x97F), (0xE00, 0xE7F), (0x2000, 0x206F), (0x3000, 0x30FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3),
          (0xFF00, 0xFFEF), (0x1F300, 0x1FAFF), (0x10000, 0x10FFFF)]
PIECES = ["<|im_start|>", "<|im_end|>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<|endoftext|>",
          " ", "  ", "\n", "'s", "'LL", "123456", "▁", "<0x41>", "<unused3>", "<mask>", "</s>", "<pad>"]


def rand_string():
    out = []
    for _ in range(rng.randint(1, 40)):
        if rng.random() < 0.1:
            out.append(rng.choice(PIECES))
            continue
        a, b = rng.choice(RANGES)
        c = rng.randint(a, b)
        if 0xD800 <= c <= 0xDFFF:
            continue
        out.append(chr(c))
    return "".join(out)


strings = [rand_string() for _ in range(N)]
root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
for fname in ["SmolLM2-135M-Instruct.Q4_1.gguf", "gemma-3-270m-q4_k_m.gguf"]:
    path = os.path.join(HOME, "models", fname)
    llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
    for add, parse in [(True, True), (False, False)]:
        want = [llm.tokenize(s.encode(), add_bos=add, special=parse) for s in strings]
        got = json.loads(subprocess.run(
            ["cargo", "run", "--release", "-q", "-p", "ferrolm-tokenizer", "--example", "encode_json", "--", path,
             str(add).lower(), str(parse).lower()], cwd=root, input=json.dumps(strings), capture_output=True,
            text=True, check=True).stdout)
        bad = [i for i in range(N) if want[i] != got[i]]
        print(f"{fname} add={add} parse={parse}: {N - len(bad)}/{N} identical")
        for i in bad[:5]:
            print("  ", repr(strings[i]), want[i], got[i])
