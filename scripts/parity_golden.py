#!/usr/bin/env python3
"""Golden data for the forward-pass parity tests, made by llama.cpp (llama-cpp-python==0.3.36).

For each prompt: the ids llama.cpp tokenizes it to, the top-K logits of every position (with the
log-sum-exp of the full row, so that the reference probabilities of those K tokens are exact), and
the greedy 64-token continuation. Written to crates/ferrolm-model/tests/golden/NAME.{json,topk}.

usage: scripts/parity_golden.py MODEL.gguf NAME [--chat-template chatml|gemma]

The reference runs with one thread, the f16 KV cache (llama.cpp's default) and flash attention off.
topk layout (little-endian): for each prompt, for each position: f32 lse, then K x (u32 id, f32 logit).
"""
import argparse, json, struct, sys
import numpy as np
from llama_cpp import Llama

K = 64
N_CONT = 64

PARAGRAPHS = [
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden press adapted from those used to make "
    "wine. Within fifty years, presses had spread to more than two hundred cities across Europe, and "
    "millions of books had been printed. Scholars argue about how quickly this changed ordinary life, "
    "but few doubt that cheap books altered religion, science and politics.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    a, b = 0, 1\n    for _ in range(n):\n"
    "        a, b = b, a + b\n    return a\n\n\nif __name__ == '__main__':\n    for i in range(10):\n"
    "        print(i, fibonacci(i))\n",
    "Photosynthesis converts light energy into chemical energy. In the light-dependent reactions, "
    "chlorophyll absorbs photons and water is split, releasing oxygen. The Calvin cycle then uses "
    "ATP and NADPH to fix carbon dioxide into sugars. Plants, algae and cyanobacteria all rely on it.",
    "fn main() {\n    let words = vec![\"alpha\", \"beta\", \"gamma\"];\n    let total: usize = words.iter().map(|w| w.len()).sum();\n"
    "    println!(\"{} words, {} letters\", words.len(), total);\n}\n",
    "In 1969, Apollo 11 landed on the Moon. Neil Armstrong and Buzz Aldrin spent about two and a half "
    "hours outside the lunar module, collecting samples and setting up experiments, while Michael "
    "Collins orbited above in the command module Columbia.",
    "Recipe: whisk two eggs with 100 g of flour and 250 ml of milk until smooth. Rest the batter for "
    "thirty minutes, then fry thin pancakes in a hot buttered pan, about one minute per side.",
    "SELECT customers.name, COUNT(orders.id) AS n\nFROM customers\nJOIN orders ON orders.customer_id = customers.id\n"
    "WHERE orders.created_at > '2024-01-01'\nGROUP BY customers.name\nORDER BY n DESC\nLIMIT 10;",
    "The mitochondrion is often called the powerhouse of the cell. It has its own small circular "
    "genome, inherited from the mother, and produces most of the cell's ATP through oxidative "
    "phosphorylation along the inner membrane.",
]

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain recursion to a ten-year-old.",
    "List three uses of a paperclip.",
    "How many legs does a spider have?",
    "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue?",
    "Give me a short tip for learning to code.",
]

def chat(template, text):
    if template == "gemma":
        return f"<start_of_turn>user\n{text}<end_of_turn>\n<start_of_turn>model\n"
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"

def prompts(template):
    out = []
    out.append("Once upon a time, in a small village by the sea,")  # short
    out.append("The quick brown fox jumps over the lazy dog.")
    for q in QUESTIONS:                                        # 8 chat prompts
        out.append(chat(template, q))
    for p in PARAGRAPHS:                                       # 8 raw paragraphs
        out.append(p)
    out.append(" ".join(PARAGRAPHS[:4]))                       # long
    out.append(chat(template, "Summarize this text:\n\n" + " ".join(PARAGRAPHS[:6])))  # longest
    return out

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model"); ap.add_argument("name")
    ap.add_argument("--chat-template", default="chatml")
    ap.add_argument("--outdir", default="crates/ferrolm-model/tests/golden")
    a = ap.parse_args()
    llm = Llama(model_path=a.model, n_ctx=1024, n_batch=512, n_threads=1, n_threads_batch=1,
                logits_all=True, flash_attn=False, verbose=False)
    add_bos = llm.metadata.get("tokenizer.ggml.add_bos_token", "true") == "true"
    cases = []
    topk = bytearray()
    for text in prompts(a.chat_template):
        ids = llm.tokenize(text.encode(), add_bos=add_bos, special=True)
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
        # Greedy continuation on the same context.
        cont = []
        last = scores[-1]
        for _ in range(N_CONT):
            tok = int(last.argmax())
            cont.append(tok)
            llm.eval([tok])
            last = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        cases.append({"text": text, "ids": ids, "greedy": cont})
        print(f"{len(ids):4d} tokens: {text[:40]!r}", file=sys.stderr)
    meta = {"model": a.model.split("/")[-1], "k": K, "n_vocab": llm.n_vocab(),
            "reference": "llama-cpp-python==0.3.36, n_threads=1, f16 KV cache, flash_attn=False",
            "cases": cases}
    with open(f"{a.outdir}/{a.name}.json", "w") as f:
        json.dump(meta, f, indent=0)
    with open(f"{a.outdir}/{a.name}.topk", "wb") as f:
        f.write(topk)

if __name__ == "__main__":
    main()
