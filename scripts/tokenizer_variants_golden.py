#!/usr/bin/env python3
"""Golden ids for pre-tokenizers and vocabulary options that no packaged model uses.

Writes vocab-only GGUFs (no tensors) that copy a real model's metadata with one tokenizer key
changed -- SmolLM2's BPE vocabulary under other `tokenizer.ggml.pre` values, Gemma 3's
SentencePiece vocabulary with `add_space_prefix` on -- and records llama.cpp's ids for a
subset of the corpus (add_special and parse_special on) and its detokenization (special off).
The Rust test builds the same metadata from the real model and compares.
Writes crates/ferrolm-tokenizer/tests/golden/variants.json.
Usage: python3 scripts/tokenizer_variants_golden.py [FERROLM_HOME]
"""
import json
import os
import sys
import tempfile

import gguf
import llama_cpp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tokenizer_golden import GOLDEN, HOME, detok, text_field  # noqa: E402

SMOL = os.path.join(HOME, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
GEMMA = os.path.join(HOME, "models", "gemma-3-270m-q4_k_m.gguf")

BPE_PRES = ["default", "llama-bpe", "qwen2", "gpt-2", "deepseek-llm", "deepseek-coder", "deepseek-v3", "tekken",
            "falcon", "starcoder", "poro-chat", "viking", "gpt-4o", "stablelm2", "bailingmoe", "seed-coder",
            "chatglm-bpe", "dbrx", "command-r", "ufakzeka", "laguna"]


def field_value(f):
    t = f.types[0]
    if t == gguf.GGUFValueType.ARRAY:
        sub = f.types[1]
        if sub == gguf.GGUFValueType.STRING:
            return [bytes(f.parts[i]).decode("utf-8") for i in f.data], t, sub
        return [f.parts[i].tolist()[0] for i in f.data], t, sub
    if t == gguf.GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]]).decode("utf-8"), t, None
    return f.parts[f.data[0]].tolist()[0], t, None


def write_variant(src, path, changes):
    r = gguf.GGUFReader(src)
    arch = field_value(r.fields["general.architecture"])[0]
    w = gguf.GGUFWriter(path, arch)
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture" or k in changes:
            continue
        v, t, sub = field_value(f)
        if t == gguf.GGUFValueType.ARRAY:
            w.add_key_value(k, v, t, sub_type=sub)
        else:
            w.add_key_value(k, v, t)
    for k, (v, t) in changes.items():
        w.add_key_value(k, v, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main():
    with open(os.path.join(GOLDEN, "corpus.json"), encoding="utf-8") as f:
        corpus = json.load(f)
    subset = [i for i, s in enumerate(corpus) if len(s) <= 48 and i % 2 == 0]
    variants = [("smollm2", p, {"tokenizer.ggml.pre": (p, gguf.GGUFValueType.STRING)}) for p in BPE_PRES]
    variants.append(("gemma3", "add_space_prefix",
                     {"tokenizer.ggml.add_space_prefix": (True, gguf.GGUFValueType.BOOL)}))
    out = {"generator": "scripts/tokenizer_variants_golden.py, llama-cpp-python " + llama_cpp.__version__,
           "strings": subset, "variants": []}
    with tempfile.TemporaryDirectory() as tmp:
        for base, name, changes in variants:
            path = os.path.join(tmp, f"{base}-{name}.gguf")
            write_variant(SMOL if base == "smollm2" else GEMMA, path, changes)
            llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
            vocab = llama_cpp.llama_model_get_vocab(llm.model)
            ids = [llm.tokenize(corpus[i].encode("utf-8"), add_bos=True, special=True) for i in subset]
            dec = [text_field(detok(vocab, x, False)) for x in ids]
            out["variants"].append({"base": base, "name": name,
                                    "changes": {k: v for k, (v, _) in changes.items()},
                                    "ids": ids, "decode_plain": dec})
            print(base, name, sum(map(len, ids)), "ids")
            del llm
    dst = os.path.join(GOLDEN, "variants.json")
    with open(dst, "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")
    print(dst, os.path.getsize(dst), "bytes")


if __name__ == "__main__":
    main()
