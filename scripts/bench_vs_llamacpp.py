#!/usr/bin/env python3
"""pp and tg of ferrolm and llama.cpp (llama-cpp-python==0.3.36) on the same file, same threads,
in one run, alternating the two engines rep by rep so that machine noise hits both alike.

usage: scripts/bench_vs_llamacpp.py MODEL.gguf [--threads 1 2] [-p 512] [-n 128] [-r 3]
Prints a markdown table with the medians and the ratio ferrolm / llama.cpp.
"""
import argparse, json, random, statistics, subprocess, time, os

def llama_pp_tg(llm, n_vocab, p, n, seed):
    rng = random.Random(seed)
    ids = [rng.randrange(n_vocab) for _ in range(p)]
    res = {}
    if p:
        llm.reset(); llm._ctx.memory_clear(True) if hasattr(llm._ctx, "memory_clear") else None
        t = time.perf_counter(); llm.eval(ids); res["pp"] = p / (time.perf_counter() - t)
    if n:
        llm.reset(); llm._ctx.memory_clear(True) if hasattr(llm._ctx, "memory_clear") else None
        tok = ids[0]
        t = time.perf_counter()
        for _ in range(n):
            llm.eval([tok])
            tok = int(llm.scores[llm.n_tokens - 1].argmax())
        res["tg"] = n / (time.perf_counter() - t)
    return res

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-r", type=int, default=3)
    ap.add_argument("--ferrolm", default="target/release/ferrolm")
    a = ap.parse_args()
    from llama_cpp import Llama
    rows = []
    for th in a.threads:
        llm = Llama(model_path=a.model, n_ctx=a.p + a.n + 16, n_batch=512, n_threads=th,
                    n_threads_batch=th, verbose=False)
        n_vocab = llm.n_vocab()
        f, l = {"pp": [], "tg": []}, {"pp": [], "tg": []}
        for r in range(a.r):
            out = subprocess.run([a.ferrolm, "bench", "-m", a.model, "-p", str(a.p), "-n", str(a.n),
                                  "-r", "1", "-t", str(th), "--json"], check=True,
                                 capture_output=True, text=True).stdout
            d = json.loads(out)
            f["pp"].append(d[f"pp{a.p}"]); f["tg"].append(d[f"tg{a.n}"])
            d = llama_pp_tg(llm, n_vocab, a.p, a.n, r)
            l["pp"].append(d["pp"]); l["tg"].append(d["tg"])
        for test, size in (("pp", a.p), ("tg", a.n)):
            fm, lm = statistics.median(f[test]), statistics.median(l[test])
            rows.append((th, f"{test}{size}", fm, lm, fm / lm))
        del llm
    print(f"model: {os.path.basename(a.model)}, reps: {a.r} (median)")
    print("| threads | test | ferrolm t/s | llama.cpp t/s | ratio |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for th, test, fm, lm, ratio in rows:
        print(f"| {th} | {test} | {fm:.2f} | {lm:.2f} | {ratio:.2f}x |")

if __name__ == "__main__":
    main()
