#!/usr/bin/env python3
"""Golden data for the synthetic-model parity tests, made by llama.cpp (llama-cpp-python==0.3.36).

Writes each synthetic file with `ferrolm synth` (random weights in the real metadata layout of an
architecture, MODELS.md "Synthetic files"), runs llama.cpp on it and writes
crates/ferrolm-model/tests/golden/synthetic-NAME.{json,topk}: the file's sha256 (the test
regenerates the file from the same spec and checks it wrote the same bytes), and for each prompt
of token ids the top-K logits of every position with the row's log-sum-exp, and the greedy
continuation. Same layout as scripts/parity_golden.py.

usage: scripts/synthetic_golden.py [--ferrolm target/release/ferrolm] [NAME ...]

The reference runs with one thread, the f16 KV cache (llama.cpp's default, as ferrolm's) and flash
attention off. The matrices are Q8_0, Q4_1, Q5_0, Q5_1 and F16 (synthetic.rs `mixed_types`):
types llama.cpp's CPU backend neither repacks nor tiles, whose dot products ferrolm mirrors;
llama-iquants and llama-lowbit put the i-quants, TQ1_0, TQ2_0, Q1_0, Q2_0 and NVFP4 in front.
"""
import argparse, hashlib, json, os, struct, subprocess, sys, tempfile
import numpy as np
from llama_cpp import Llama

K = 64
N_CONT = 32

# name -> `ferrolm synth` flags; crates/ferrolm-model/tests/synthetic_parity.rs builds the same specs.
FILES = {
    "qwen2": ["--arch", "qwen2"],
    "qwen3": ["--arch", "qwen3"],
    "llama": ["--arch", "llama"],  # Mistral-style: 8 heads / 2 kv heads, sliding_window key
    "llama-ropefreqs": ["--arch", "llama", "--rope-freqs", "--rope-base", "500000", "--seed", "7"],
    # Q/K/V and attention-output biases in a llama file (llama.cpp applies them when present)
    "llama-biases": ["--arch", "llama", "--attention-biases", "--seed", "11"],
    "gemma2": ["--arch", "gemma2"],
    "gemma3": ["--arch", "gemma3"],
    "granite": ["--arch", "granite"],
    "phi3": ["--arch", "phi3"],  # fused attn_qkv and gate/up, 24 of 32 dimensions rotate
    # LongRoPE: one file (trained context 8192, original 1024), two contexts: llama.cpp rotates
    # with the short factors at n_ctx 1024 (not above the original), the long ones at 2048.
    "phi3-longrope-short": ["--arch", "phi3", "--ctx", "8192", "--long-rope", "1024"],
    "phi3-longrope-long": ["--arch", "phi3", "--ctx", "8192", "--long-rope", "1024"],
    "qwen3moe": ["--arch", "qwen3moe"],  # 8 experts, top-2, renormalized; Q/K norms
    "llama-moe": ["--arch", "llama", "--experts", "4", "--experts-used", "2"],  # Mixtral-style
    "qwen2moe": ["--arch", "qwen2moe"],  # 8 experts, top-2, not renormalized; sigmoid-gated shared expert; QKV biases
    "qwen3-yarn": ["--arch", "qwen3", "--yarn", "4:256"],  # YaRN x4 over an original context of 256
    "gpt-oss": ["--arch", "gpt-oss"],  # 8 MXFP4 experts with biases, top-4 then softmax, clamped SwiGLU; sinks; even layers slide (64); YaRN x4 over 256
    "dots1": ["--arch", "dots1"],  # layer 0 dense; 16 experts in 4 groups (2 kept), top-4 of sigmoid + exp_probs_b, renormalized, x2.5; shared expert
    # hybrid: 3 gated delta-net layers (4 key / 8 value heads of 32, 4-tap conv) then 1 attention
    # layer (gated output, 16 of 64 dimensions rotate); 8 experts top-2 + gated shared expert
    "qwen3next": ["--arch", "qwen3next"],
    # the other layout (attn_qkv + attn_gate), attention every other layer
    "qwen3next-split": ["--arch", "qwen3next", "--ssm-split", "--full-attention-interval", "2", "--seed", "7"],
    # Qwen3.5 (dense): attn_qkv + attn_gate, ssm_beta + ssm_alpha, value heads tiling key heads,
    # rope.dimension_sections [3, 3, 2, 0]
    "qwen35": ["--arch", "qwen35"],
    "qwen35moe": ["--arch", "qwen35moe"],  # qwen35's layout with qwen3next's experts and gated shared expert
    # every i-quant, one per matrix kind (random valid blocks: ferrolm_quant::random_blocks)
    "llama-iquants": ["--arch", "llama", "--tensor-type", "attn_q.=iq2_xxs", "--tensor-type", "attn_k.=iq2_xs",
                      "--tensor-type", "attn_v.=iq2_s", "--tensor-type", "attn_output=iq3_xxs",
                      "--tensor-type", "ffn_gate=iq3_s", "--tensor-type", "ffn_up=iq1_s",
                      "--tensor-type", "ffn_down=iq1_m", "--tensor-type", "output.weight=iq4_xs"],
    # ternary, 1-bit, 2-bit and NVFP4 matrices, an IQ4_XS embedding
    "llama-lowbit": ["--arch", "llama", "--seed", "5", "--tensor-type", "attn_q.=tq1_0",
                     "--tensor-type", "attn_k.=tq2_0", "--tensor-type", "attn_v.=q1_0",
                     "--tensor-type", "attn_output=q2_0", "--tensor-type", "ffn_gate=nvfp4",
                     "--tensor-type", "ffn_up=iq4_xs", "--tensor-type", "ffn_down=tq2_0",
                     "--tensor-type", "token_embd=iq4_xs"],
    # llama-quantize's IQ2_M mix of this 8-layer shape (b11312's llama_tensor_get_type, checked
    # with its dry run): IQ2_S, IQ3_S embedding / attention output / blk.0 ffn_down, Q4_K V, Q5_K head
    "llama-iq2m": ["--arch", "llama", "--layers", "8", "--tensor-type", "attn_output=iq3_s",
                   "--tensor-type", "output.weight=q5_k", "--tensor-type", "token_embd=iq3_s",
                   "--tensor-type", "attn_v.=q4_k", "--tensor-type", "blk.0.ffn_down=iq3_s",
                   "--tensor-type", "attn_q.=iq2_s", "--tensor-type", "attn_k.=iq2_s",
                   "--tensor-type", "ffn_gate=iq2_s", "--tensor-type", "ffn_up=iq2_s",
                   "--tensor-type", "ffn_down=iq2_s"],
}
# The context llama.cpp is created with, where not 1024 (the tests use the same, from the JSON).
N_CTX = {"phi3-longrope-long": 2048}
# Files written by the ferrolm-model example instead of the CLI (same spec: SyntheticSpec::small).
EXAMPLE_WRITER = ["cargo", "run", "--release", "-q", "-p", "ferrolm-model", "--example", "synth", "--"]

TEXTS = [
    "the quick brown fox jumps over the lazy dog",
    "once upon a time, in a small village by the sea, there lived an old fisherman.",
    "def main():\n    print('hello world')\n",
    "photosynthesis converts light energy into chemical energy in plants and algae",
]

def prompts(llm):
    rng = np.random.default_rng(1234)
    out = []
    for n in [1, 8, 17, 33, 64, 100, 150, 257]:
        out.append([int(x) for x in rng.integers(0, llm.n_vocab(), n)])
    for t in TEXTS:
        out.append(llm.tokenize(t.encode(), add_bos=False, special=False))
    # one long prompt over two batches of llama.cpp (n_batch 512) and ferrolm (BATCH 512)
    out.append([int(x) for x in rng.integers(0, llm.n_vocab(), 600)])
    if WRAP:
        # past the 768-cell ring of a 64-position sliding window (synthetic gemma files)
        out.append([int(x) for x in np.random.default_rng(99).integers(0, llm.n_vocab(), 900)])
    return out

WRAP = False

def golden(ferrolm, name, flags, outdir, tmp):
    global WRAP
    WRAP = name.startswith("gemma")
    path = os.path.join(tmp, f"synthetic-{name}.gguf")
    if ferrolm == "example":
        subprocess.run([*EXAMPLE_WRITER, flags[1], path], check=True)
    else:
        subprocess.run([ferrolm, "synth", *flags, "-o", path], check=True)
    sha = hashlib.sha256(open(path, "rb").read()).hexdigest()
    n_ctx = N_CTX.get(name, 1024)
    llm = Llama(model_path=path, n_ctx=n_ctx, n_batch=512, n_threads=1, n_threads_batch=1,
                logits_all=True, flash_attn=False, verbose=False)
    cases, topk = [], bytearray()
    for ids in prompts(llm):
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
        cases.append({"ids": ids, "greedy": cont})
        print(f"{name}: {len(ids):4d} tokens", file=sys.stderr)
    meta = {"model": f"synthetic-{name}", "synth": flags, "sha256": sha, "k": K,
            "n_vocab": llm.n_vocab(), "n_ctx": n_ctx,
            "reference": "llama-cpp-python==0.3.36, n_threads=1, f16 KV cache, flash_attn=False",
            "cases": cases}
    with open(f"{outdir}/synthetic-{name}.json", "w") as f:
        json.dump(meta, f, indent=0)
    with open(f"{outdir}/synthetic-{name}.topk", "wb") as f:
        f.write(topk)

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("names", nargs="*")
    ap.add_argument("--ferrolm", default="target/release/ferrolm")
    ap.add_argument("--outdir", default="crates/ferrolm-model/tests/golden")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.names or FILES:
            golden(a.ferrolm, name, FILES[name], a.outdir, tmp)

if __name__ == "__main__":
    main()
