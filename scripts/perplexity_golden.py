#!/usr/bin/env python3
"""Golden perplexities for `ferrolm perplexity`, from llama.cpp (llama-cpp-python 0.3.36).

llama-cpp-python has no llama-perplexity, so this reproduces what it computes, on llama.cpp's own
logits: the text tokenized with the vocabulary's specials added (not parsed), cut into chunks of
n_ctx tokens (as many whole chunks as fit), each evaluated alone from an empty cache in one batch
with its first token replaced by BOS when the vocabulary adds one, and the second half of each
chunk scored: the negative log-likelihood of each next token under a softmax taken as
llama-perplexity takes it (maximum and logits in f32, the sum of exponentials in f64). The result
is its "Final estimate: PPL = X +/- Y" and the running value after each chunk.

For Gemma 3 the figure is also made with llama.cpp's weight repacking and tiled K-quant products
off ("no_repack"): ferrolm mirrors the plain kernels, and the repacked ones sum in another order
(docs/PARITY.md), which moves this perplexity by about 0.3%.

Usage: scripts/perplexity_golden.py [OUT.json]  (models from ~/.cache/ferrolm/models, one thread)
"""
import json
import math
import os
import subprocess
import sys

NO_REPACK = "--no-repack-case" in sys.argv
if NO_REPACK:
    # Importing it turns off the tiled products and the repacking, as for the Gemma parity data.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import gemma_golden  # noqa: F401

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
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
