#!/usr/bin/env python3
"""Golden token ids and detokenized text from llama.cpp (llama-cpp-python==0.3.36, llama.cpp b11312).

For each model in ../shared/MODELS.md, every string of tests/golden/corpus.json is tokenized by
llama.cpp with (add_special, parse_special) in {(True, True), (False, False)} (and all four
combinations when the string holds '<'), and each id sequence is detokenized with llama_detokenize
(remove_special=False, unparse_special=True and False), which is what ferrolm's decode() mirrors.
A few random id sequences (byte tokens, specials, pieces of multi-byte characters) are detokenized too.

Usage: python3 scripts/tokenizer_golden.py [FERROLM_HOME]   (needs llama_cpp installed)
Writes crates/ferrolm-tokenizer/tests/golden/<model>.json. CI never runs this; it reads the results.
"""
import ctypes
import hashlib
import json
import os
import random
import sys

import llama_cpp

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
GOLDEN = os.path.join(ROOT, "crates", "ferrolm-tokenizer", "tests", "golden")
HOME = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("FERROLM_HOME", os.path.expanduser("~/.cache/ferrolm"))
MODELS = {
    "smollm2": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "gemma3": "gemma-3-270m-q4_k_m.gguf",
}


def detok(vocab, ids, unparse_special):
    arr = (llama_cpp.llama_token * max(1, len(ids)))(*ids)
    cap = 64 + 64 * len(ids)
    buf = ctypes.create_string_buffer(cap)
    n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, cap, False, unparse_special)
    if n < 0:
        cap = -n + 16
        buf = ctypes.create_string_buffer(cap)
        n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, cap, False, unparse_special)
    return buf.raw[:n]


def text_field(b):
    try:
        return {"text": b.decode("utf-8")}
    except UnicodeDecodeError:
        return {"hex": b.hex()}


def main():
    with open(os.path.join(GOLDEN, "corpus.json"), encoding="utf-8") as f:
        corpus = json.load(f)
    for name, fname in MODELS.items():
        path = os.path.join(HOME, "models", fname)
        with open(path, "rb") as f:
            sha = hashlib.sha256(f.read()).hexdigest()
        llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
        vocab = llama_cpp.llama_model_get_vocab(llm.model)
        n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
        cases = []
        for i, s in enumerate(corpus):
            combos = [(True, True), (False, False)]
            if "<" in s:
                combos += [(True, False), (False, True)]
            for add, parse in combos:
                ids = llm.tokenize(s.encode("utf-8"), add_bos=add, special=parse)
                case = {"i": i, "add_special": add, "parse_special": parse, "ids": ids}
                if (add, parse) == (True, True):
                    case["decode_special"] = text_field(detok(vocab, ids, True))
                    case["decode_plain"] = text_field(detok(vocab, ids, False))
                cases.append(case)
        rng = random.Random(7 + len(name))
        special_ids = [t for t in range(n_vocab) if llama_cpp.llama_vocab_get_attr(vocab, t) & (1 | 8 | 16)]
        byte_ids = [t for t in range(n_vocab) if llama_cpp.llama_vocab_get_attr(vocab, t) & 32]
        pool = special_ids[:50] + byte_ids
        if not byte_ids:  # byte-level BPE: single-byte tokens of the GPT-2 byte alphabet
            pool += list(range(min(n_vocab, 400)))
        decodes = []
        for _ in range(60):
            n = rng.randint(1, 12)
            ids = [rng.choice(pool) if rng.random() < 0.5 else rng.randrange(n_vocab) for _ in range(n)]
            decodes.append({"ids": ids,
                            "decode_special": text_field(detok(vocab, ids, True)),
                            "decode_plain": text_field(detok(vocab, ids, False))})
        eog = [t for t in range(n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, t)]
        out = {
            "model": fname,
            "sha256": sha,
            "generator": "scripts/tokenizer_golden.py, llama-cpp-python " + llama_cpp.__version__,
            "n_vocab": n_vocab,
            "bos": llama_cpp.llama_vocab_bos(vocab),
            "eos": llama_cpp.llama_vocab_eos(vocab),
            "eog": eog,
            "cases": cases,
            "decodes": decodes,
        }
        dst = os.path.join(GOLDEN, name + ".json")
        with open(dst, "w", encoding="utf-8") as f:
            json.dump(out, f, ensure_ascii=False, separators=(",", ":"))
            f.write("\n")
        print(name, len(cases), "cases", os.path.getsize(dst), "bytes")


if __name__ == "__main__":
    main()
