#!/usr/bin/env python3
"""Checks `ferrolm synth --shape`'s per-tensor type mix against llama.cpp's own quantizer
(llama-cpp-python==0.3.36, `llama_model_quantize`): the shape is written in F16, llama.cpp
quantizes that file to the file type, and every tensor's type must equal the one ferrolm writes
directly for that shape and type. Prints the tensor bytes of both.

usage: scripts/shape_mix_check.py [--ferrolm target/release/ferrolm] SHAPE:TYPE ...
       (TYPE one of q4_0 q4_1 q5_0 q5_1 q8_0 q4_k_m q6_k)
"""
import argparse, ctypes, os, subprocess, sys, tempfile
import gguf
import llama_cpp

FTYPES = {"q4_0": 2, "q4_1": 3, "q8_0": 7, "q5_0": 8, "q5_1": 9, "q4_k_m": 15, "q6_k": 18}


def table(path):
    r = gguf.GGUFReader(path)
    return {t.name: (t.tensor_type.name, int(t.n_bytes)) for t in r.tensors}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ferrolm", default="target/release/ferrolm")
    ap.add_argument("cases", nargs="+")
    a = ap.parse_args()
    bad = 0
    for case in a.cases:
        shape, ty = case.split(":")
        with tempfile.TemporaryDirectory(dir="/tmp") as d:
            f16, ref, ours = (os.path.join(d, n) for n in ["f16.gguf", "ref.gguf", "ours.gguf"])
            subprocess.run([a.ferrolm, "synth", "--shape", shape, "--type", "f16", "-o", f16], check=True)
            subprocess.run([a.ferrolm, "synth", "--shape", shape, "--type", ty, "-o", ours], check=True)
            p = llama_cpp.llama_model_quantize_default_params()
            p.nthread = 1
            p.ftype = FTYPES[ty]
            rc = llama_cpp.llama_model_quantize(f16.encode(), ref.encode(), ctypes.byref(p))
            if rc != 0:
                print(f"{case}: llama_model_quantize failed ({rc})")
                bad += 1
                continue
            t_ref, t_ours = table(ref), table(ours)
            diff = [(n, t_ref.get(n), t_ours.get(n)) for n in sorted(set(t_ref) | set(t_ours))
                    if (t_ref.get(n) or ("?",))[0] != (t_ours.get(n) or ("?",))[0]]
            b_ref = sum(b for _, b in t_ref.values())
            b_ours = sum(b for _, b in t_ours.values())
            mix = {}
            for tname, _ in t_ours.values():
                mix[tname] = mix.get(tname, 0) + 1
            print(f"{case}: {len(t_ours)} tensors {mix}; tensor bytes llama.cpp {b_ref}, ferrolm {b_ours}; "
                  f"{'same types' if not diff else f'{len(diff)} differ, e.g. {diff[:3]}'}", flush=True)
            bad += bool(diff) or b_ref != b_ours
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
