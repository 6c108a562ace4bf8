#!/usr/bin/env python3
"""Golden data for the Gemma 3 270M parity test, made by llama.cpp (llama-cpp-python==0.3.36).

Same layout and prompts as scripts/parity_golden.py (Gemma chat template), plus two prompts longer
than Gemma 3's 512-token sliding window, so that prefill crosses the window. Written to
crates/ferrolm-model/tests/golden/gemma3.{json,topk}.

usage: scripts/gemma_golden.py ~/.cache/ferrolm/models/gemma-3-270m-q4_k_m.gguf NAME [--plain]

The reference runs with one thread, the f16 KV cache and flash attention off. By default it is
llama.cpp as a user runs it: its Q4_K matrices repacked at load (CPU_REPACK, the interleaved
`ggml_gemv/gemm_q4_K_8x8_q8_K` kernels) and its tiled K-quant product for batches of 8 or more
(written as gemma3.*). With --plain, without both (`llama_model_params.use_extra_bufts = False`,
GGML_CPU_TILED_MM=0): every product goes through the type's `vec_dot` (or tinyBLAS for Q8_0/Q5_0
batches) (written as gemma3-plain.*). ferrolm mirrors either (`KernelOptions`, docs/PARITY.md).
"""
import json, struct, sys
import os
PLAIN = "--plain" in sys.argv
import numpy as np
import llama_cpp
from llama_cpp import Llama

sys.path.insert(0, __import__("os").path.dirname(__file__))
import parity_golden as pg

K = 32
N_CONT = 64

_default_params = llama_cpp.llama_model_default_params
def _no_repack():
    p = _default_params()
    p.use_extra_bufts = False
    return p


def use_plain_reference():
    """llama.cpp with its weight repacking and its tiled K-quant products off, for every model
    loaded from here on (also used by perplexity_golden.py)."""
    os.environ["GGML_CPU_TILED_MM"] = "0"  # read by ggml at its first matrix product
    llama_cpp.llama_model_default_params = _no_repack
    llama_cpp.llama.llama_cpp.llama_model_default_params = _no_repack


if PLAIN:
    use_plain_reference()

def prompts():
    out = pg.prompts("gemma")
    out.append(" ".join(pg.PARAGRAPHS) + "\n\n" + " ".join(pg.PARAGRAPHS[:3]))   # past the window
    out.append(pg.chat("gemma", "Answer briefly after reading all of this.\n\n" + " ".join(pg.PARAGRAPHS)
                       + "\n\n" + " ".join(pg.PARAGRAPHS[2:6]) + "\n\nWhat did Gutenberg combine?"))
    return out

def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    model, name = args[0], args[1]
    outdir = "crates/ferrolm-model/tests/golden"
    llm = Llama(model_path=model, n_ctx=1024, n_batch=512, n_threads=1, n_threads_batch=1,
                logits_all=True, flash_attn=False, verbose=False)
    assert llm.model_params.use_extra_bufts != PLAIN
    cases, topk = [], bytearray()
    for text in prompts():
        ids = llm.tokenize(text.encode(), add_bos=True, special=True)
        llm.reset()
        llm.eval(ids)
        scores = np.array(llm.scores[: len(ids)], dtype=np.float32)
        for row in scores:
            m = row.max()
            lse = float(m + np.log(np.exp((row - m).astype(np.float64)).sum()))
            top = np.argsort(-row, kind="stable")[:K]
            topk += struct.pack("<f", lse)
            for i in top:
                topk += struct.pack("<If", int(i), float(row[i]))
        cont, last = [], scores[-1]
        for _ in range(N_CONT):
            tok = int(last.argmax())
            cont.append(tok)
            llm.eval([tok])
            last = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        cases.append({"text": text, "ids": ids, "greedy": cont})
        print(f"{len(ids):4d} tokens: {text[:40]!r}", file=sys.stderr)
    meta = {"model": model.split("/")[-1], "k": K, "n_vocab": llm.n_vocab(),
            "reference": "llama-cpp-python==0.3.36 (GGML_NATIVE, AMD EPYC with AVX512 VNNI), "
                         "n_threads=1, f16 KV cache, flash_attn=False, "
                         + ("use_extra_bufts=False (no weight repacking), GGML_CPU_TILED_MM=0"
                            if PLAIN else "default (weights repacked, tiled K-quant batches)"),
            "cases": cases}
    with open(f"{outdir}/{name}.json", "w") as f:
        json.dump(meta, f, indent=0)
    with open(f"{outdir}/{name}.topk", "wb") as f:
        f.write(topk)

if __name__ == "__main__":
    main()
