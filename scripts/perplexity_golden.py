#!/usr/bin/env python3
"""Golden perplexities for `ferrolm perplexity`, from llama.cpp (llama-cpp-python 0.3.36).

llama-cpp-python has no llama-perplexity, so this reproduces what it computes, on llama.cpp's own
logits: the text tokenized with the vocabulary's specials added (not parsed), cut into chunks of
n_ctx tokens (as many whole chunks as fit), each evaluated alone from an empty cache in one batch
with its first token replaced by BOS when the vocabulary adds one, and the second half of each
chunk scored: the negative log-likelihood of each next token under a softmax taken as
llama-perplexity takes it (maximum and logits in f32, the sum of exponentials in f64). The result
is its "Final estimate: PPL = X +/- Y" and the running value after each chunk. And one
--kl-divergence case: SmolLM2 Q4_1 as the base against the Q8_0 llama-quantize makes from its F16
form (ferrolm quantize makes the same bytes), two chunks of 512, scored as llama-perplexity does
(the base's distributions rounded to its u16 rows).

For Gemma 3 the figure is also made with llama.cpp's weight repacking and tiled K-quant products
off ("no_repack"): their kernels sum in another order than the plain ones (docs/PARITY.md), which
moves this perplexity by about 0.3%; ferrolm mirrors both (`perplexity` with and without
`--no-repack --no-tiled`).

Usage: scripts/perplexity_golden.py [OUT.json]  (models from ~/.cache/ferrolm/models, one thread)
"""
import json
import math
import os
import subprocess
import sys

NO_REPACK = "--no-repack-case" in sys.argv
if NO_REPACK:
    # The tiled products and the repacking off, as for the Gemma parity data made with --plain.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import gemma_golden
    gemma_golden.use_plain_reference()

import numpy as np
from llama_cpp import Llama

HOME = os.environ.get("FERROLM_HOME", os.path.expanduser("~/.cache/ferrolm"))
TEXT = os.path.join(os.path.dirname(__file__), "..", "crates", "ferrolm", "tests", "data", "perplexity.txt")
CASES = [
    ("smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", 512, None, False),
    ("gemma3", "gemma-3-270m-q4_k_m.gguf", 256, 4, True),
]


def nll_of(logits, tok):
    """-log softmax(logits)[tok] as llama-perplexity's log_softmax computes it."""
    logits = logits.astype(np.float32)
    mx = np.float32(logits.max())
    sum_exp = float(np.sum(np.exp(logits - mx).astype(np.float64)))
    return -(float(np.float32(logits[tok] - mx)) - math.log(sum_exp))


def perplexity(path, n_ctx, max_chunks, text):
    llm = Llama(model_path=path, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True,
                n_threads=1, n_threads_batch=1, verbose=False)
    if NO_REPACK:
        assert not llm.model_params.use_extra_bufts
    tokens = llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)
    add_bos = llm._model.add_bos_token() if hasattr(llm._model, "add_bos_token") else None
    bos = llm.token_bos()
    n_chunk = len(tokens) // n_ctx
    if max_chunks is not None:
        n_chunk = min(n_chunk, max_chunks)
    first = n_ctx // 2
    nll = nll2 = 0.0
    count = 0
    running = []
    for c in range(n_chunk):
        ids = list(tokens[c * n_ctx:(c + 1) * n_ctx])
        if add_bos:
            ids[0] = bos
        llm.reset()
        llm.eval(ids)
        scores = np.array(llm.scores[:n_ctx], dtype=np.float32)
        for i in range(first, n_ctx - 1):
            v = nll_of(scores[i], tokens[c * n_ctx + i + 1])
            nll += v
            nll2 += v * v
        count += n_ctx - first - 1
        running.append(math.exp(nll / count))
    mean = nll / count
    var = nll2 / count - mean * mean
    ppl = math.exp(mean)
    return {
        "n_ctx": n_ctx,
        "n_chunk": n_chunk,
        "n_tokens": len(tokens),
        "add_bos": bool(add_bos),
        "first_ids": list(tokens[:16]),
        "ppl": ppl,
        "ppl_uncertainty": math.sqrt(var / (count - 1)) * ppl,
        "running": running,
    }


def chunk_scores(llm, tokens, c, n_ctx, add_bos, bos):
    ids = list(tokens[c * n_ctx:(c + 1) * n_ctx])
    if add_bos:
        ids[0] = bos
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[:n_ctx], dtype=np.float32)


def saved_row(logits):
    """llama-perplexity's u16 row of a base file: (scale, min_log_prob, values)."""
    mx = np.float32(logits.max())
    mn = max(np.float32(logits.min()), np.float32(mx - np.float32(16)))
    sum_exp = float(np.sum(np.exp(logits - mx).astype(np.float64)))
    log_sum_exp = np.float32(math.log(sum_exp))
    min_log_prob = np.float32(mn - mx - log_sum_exp)
    scale = np.float32((mx - mn) / np.float32(65535))
    if scale == 0:
        q = np.zeros(len(logits), dtype=np.uint16)
    else:
        inv = np.float32(1) / scale
        x = (inv * (logits - mn)).astype(np.float32)
        q = np.where(logits > mn, np.rint(x), 0).astype(np.uint16)  # rint: ties to even, as nearest_int
    return scale, min_log_prob, q


def kl_position(logits, base, tok):
    """One position of llama-perplexity's --kl-divergence: (kld, p_diff, same_top, nll, nll_base)."""
    scale, min_log_prob, q = base
    mx = np.float32(logits.max())
    imax = int(np.argmax(logits))
    sum_exp = float(np.sum(np.exp(logits - mx).astype(np.float64)))
    log_sum_exp = np.float32(math.log(sum_exp))
    nll = np.float32(mx + log_sum_exp - logits[tok])
    p_log_base = (scale * q.astype(np.float32) + min_log_prob).astype(np.float32)
    nll_base = np.float32(-p_log_base[tok])
    keep = p_log_base > np.float32(-16)
    terms = np.exp(p_log_base[keep]) * (p_log_base[keep] - logits[keep] + (mx + log_sum_exp))
    kld = float(np.sum(terms.astype(np.float32).astype(np.float64)))
    imax_base = int(np.argmax(p_log_base))
    p_diff = float(np.exp(-nll) - np.exp(-nll_base))
    return kld, p_diff, imax == imax_base, float(nll), float(nll_base)


def kl_divergence(base_path, model_path, n_ctx, n_chunk, text):
    """Mean KLD, same top rate and the two perplexities of model against base on text."""
    rows = []
    for path in (base_path, model_path):
        llm = Llama(model_path=path, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True,
                    n_threads=1, n_threads_batch=1, verbose=False)
        tokens = llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)
        add_bos, bos = llm._model.add_bos_token(), llm.token_bos()
        rows.append([chunk_scores(llm, tokens, c, n_ctx, add_bos, bos) for c in range(n_chunk)])
        del llm
    first = n_ctx // 2
    klds, p_diffs, same, nll, nll_base = [], [], 0, 0.0, 0.0
    for c in range(n_chunk):
        for i in range(first, n_ctx - 1):
            tok = tokens[c * n_ctx + i + 1]
            k, d, s, a, b = kl_position(rows[1][c][i], saved_row(rows[0][c][i]), tok)
            klds.append(k)
            p_diffs.append(d)
            same += s
            nll += a
            nll_base += b
    n = len(klds)
    return {"n_ctx": n_ctx, "n_chunk": n_chunk, "mean_kld": sum(klds) / n,
            "max_kld": max(klds), "same_top": same / n,
            "ppl": math.exp(nll / n), "ppl_base": math.exp(nll_base / n)}


def kl_case(text):
    """SmolLM2 Q4_1 (base) against its Q8_0 made by llama-quantize from its F16 form."""
    import ctypes
    import tempfile
    import llama_cpp
    src = os.path.join(HOME, "models", CASES[0][1])
    with tempfile.TemporaryDirectory() as tmp:
        f16, q8 = os.path.join(tmp, "input-f16.gguf"), os.path.join(tmp, "q8_0.gguf")
        for (a, b, ftype, requant) in ((src, f16, 1, True), (f16, q8, 7, False)):
            p = llama_cpp.llama_model_quantize_default_params()
            p.ftype, p.nthread, p.allow_requantize = ftype, 1, requant
            assert llama_cpp.llama_model_quantize(a.encode(), b.encode(), ctypes.byref(p)) == 0
        return kl_divergence(src, q8, 512, 2, text)


def main():
    if NO_REPACK:
        name = sys.argv[sys.argv.index("--no-repack-case") + 1]
        _, file, n_ctx, chunks, _ = next(c for c in CASES if c[0] == name)
        text = open(TEXT, encoding="utf-8").read()
        print(json.dumps(perplexity(os.path.join(HOME, "models", file), n_ctx, chunks, text)))
        return
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(__file__), "..", "crates", "ferrolm", "tests", "golden", "perplexity.json")
    text = open(TEXT, encoding="utf-8").read()
    result = {"source": "llama-cpp-python 0.3.36 (llama.cpp b11312), scripts/perplexity_golden.py",
              "text": "crates/ferrolm/tests/data/perplexity.txt", "models": {}}
    for name, file, n_ctx, chunks, no_repack in CASES:
        r = perplexity(os.path.join(HOME, "models", file), n_ctx, chunks, text)
        if no_repack:
            run = subprocess.run([sys.executable, __file__, "--no-repack-case", name],
                                 check=True, capture_output=True, text=True)
            r["no_repack"] = json.loads(run.stdout.strip().splitlines()[-1])
        print(name, r["ppl"], r["ppl_uncertainty"], r.get("no_repack", {}).get("ppl"), file=sys.stderr)
        result["models"][name] = r
    result["kl_smollm2_q4_1_vs_q8_0"] = kl_case(text)
    print("kl", result["kl_smollm2_q4_1_vs_q8_0"], file=sys.stderr)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
