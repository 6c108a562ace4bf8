#!/usr/bin/env python3
"""Layer-by-layer comparison of ferrolm with llama.cpp on one prompt of token ids: llama.cpp's
intermediates from its eval callback (through ctypes), ferrolm's from FERROLM_DUMP, under the
same names; prints, per layer and tensor, how many values differ and by how much.

usage: scripts/dump_compare.py MODEL.gguf 2,106,1234 [LAYERS] [--repack] [--tiled]
(without --repack, llama.cpp runs with use_extra_bufts=False, without --tiled with
GGML_CPU_TILED_MM=0, and ferrolm mirrors the same configuration; both flags: llama.cpp's default)
"""
import ctypes, glob, os, subprocess, sys
import os
if "--tiled" not in sys.argv:
    os.environ["GGML_CPU_TILED_MM"] = "0"  # llama.cpp's tiled K-quant path for >= 8 tokens, off
import numpy as np
import llama_cpp
from llama_cpp import Llama

args = [a for a in sys.argv[1:] if not a.startswith("--")]
path, ids_s = args[0], args[1]
layers = int(args[2]) if len(args) > 2 else 3
if "--repack" not in sys.argv:
    _d = llama_cpp.llama_model_default_params
    def _p():
        p = _d(); p.use_extra_bufts = False; return p
    llama_cpp.llama.llama_cpp.llama_model_default_params = _p

libdir = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
base = ctypes.CDLL(os.path.join(libdir, "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
base.ggml_get_name.restype = ctypes.c_char_p; base.ggml_get_name.argtypes = [ctypes.c_void_p]
base.ggml_get_data.restype = ctypes.c_void_p; base.ggml_get_data.argtypes = [ctypes.c_void_p]
dumps = {}
def cb(t, ask, ud):
    name = base.ggml_get_name(t).decode()
    if ask:
        return True
    ttype = ctypes.c_int32.from_address(t).value
    ne = [ctypes.c_int64.from_address(t + 16 + 8 * i).value for i in range(4)]
    data = base.ggml_get_data(t)
    if ttype == 0 and data:
        n = int(np.prod(ne))
        dumps[name] = np.ctypeslib.as_array((ctypes.c_float * n).from_address(data)).copy()
    return True
cbf = llama_cpp.llama_cpp.ggml_backend_sched_eval_callback(cb)
ids = [int(x) for x in ids_s.split(",")]
llm = Llama(model_path=path, n_ctx=1024, n_threads=1, n_threads_batch=1, logits_all=True,
            flash_attn=False, verbose=False)
params = llm.context_params
params.cb_eval = cbf
ctx = llama_cpp.llama_init_from_model(llm.model, params)
arr = (ctypes.c_int32 * len(ids))(*ids)
llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(arr, len(ids)))

d = "/tmp/fdump"
os.makedirs(d, exist_ok=True)
for f in glob.glob(d + "/*"):
    os.remove(f)
flags = [f for f, on in (("--no-repack", "--repack" not in sys.argv),
                         ("--no-tiled", "--tiled" not in sys.argv)) if on]
subprocess.run(["cargo", "run", "--release", "-q", "-p", "ferrolm-model", "--example", "eval_ids",
                "--", path, ids_s, "/tmp/fdump_logits.f32"] + flags, check=True,
               env=dict(os.environ, FERROLM_DUMP=d))
names = ["attn_norm", "Qcur", "Kcur", "Vcur", "kqv_out", "attn_post_norm", "sa_out", "ffn_inp",
         "ffn_norm", "ffn_gate", "ffn_up", "ffn_geglu", "ffn_out", "l_out"]
for l in range(layers):
    row = []
    for nm in names:
        k = f"{nm}-{l}"
        if k not in dumps:
            row.append(f"{nm}:-"); continue
        r = dumps[k]
        if not os.path.exists(f"{d}/{k}.f32"):
            row.append(f"{nm}:ours-"); continue
        o = np.fromfile(f"{d}/{k}.f32", dtype=np.float32)
        if r.size != o.size:
            row.append(f"{nm}:size{r.size}/{o.size}"); continue
        row.append(f"{nm}:{(r != o).sum()}/{r.size} max{np.abs(r - o).max():.1e}")
    print(l, " ".join(row))
print(sorted(k for k in dumps if k.endswith("-0")))
n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(llm.model))
ref = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(n_vocab,)).copy()
ours = np.fromfile("/tmp/fdump_logits.f32", dtype=np.float32)[-n_vocab:]
print("last logits:", (ref != ours).sum(), "/", ref.size, "differ, max", np.abs(ref - ours).max())
