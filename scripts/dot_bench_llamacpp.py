#!/usr/bin/env python3
"""llama.cpp's side of `cargo run --release -p ferrolm-quant --example dot_bench`: the same
4096 x 4096 matrix-vector product (and 8 columns, as in prompt processing) through ggml's own
mul_mat (its CPU backend, one thread by default), timed best of repeated runs, in weight GB/s and
GMAC/s. The weights are random valid blocks of each type (scripts/ggml_oracle.py's), the
activations f32 (ggml quantizes them inside the product, as in a model). Uses the same installed
llama.cpp build as the oracle script (GGML_LIB_DIR overrides it).

  python3 scripts/dot_bench_llamacpp.py [--threads 1] [TYPE ...]
"""
import argparse
import ctypes
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ggml_oracle as oracle  # noqa: E402  (loads libggml-base/-cpu and initializes the CPU backend)

ROWS = COLS = 4096


class InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p),
                ("no_alloc", ctypes.c_bool)]


base, cpu = oracle.base, oracle.cpu
base.ggml_init.restype = ctypes.c_void_p
base.ggml_init.argtypes = [InitParams]
base.ggml_free.argtypes = [ctypes.c_void_p]
base.ggml_new_tensor_2d.restype = ctypes.c_void_p
base.ggml_new_tensor_2d.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
base.ggml_mul_mat.restype = ctypes.c_void_p
base.ggml_mul_mat.argtypes = [ctypes.c_void_p] * 3
base.ggml_new_graph.restype = ctypes.c_void_p
base.ggml_new_graph.argtypes = [ctypes.c_void_p]
base.ggml_build_forward_expand.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
base.ggml_get_data.restype = ctypes.c_void_p
base.ggml_get_data.argtypes = [ctypes.c_void_p]
cpu.ggml_graph_compute_with_ctx.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]


def best_time(f, budget=0.4):
    f()
    start, best = time.perf_counter(), float("inf")
    while time.perf_counter() - start < budget:
        t = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t)
    return best


def bench(tname, threads):
    t = oracle.T[tname]
    raw = (oracle.random_blocks(tname, ROWS * COLS) if tname in oracle.MORE
           else np.concatenate([oracle.quantize_weights(t, oracle.weights(COLS)) for _ in range(64)]))
    row_bytes = oracle.row_bytes(t, COLS)
    rows = np.resize(raw.reshape(-1, row_bytes), (ROWS, row_bytes))  # repeat distinct rows
    out = []
    for cols in (1, 8):
        ctx = base.ggml_init(InitParams(rows.nbytes + 4 * COLS * cols * 2 + (1 << 30), None, False))
        a = base.ggml_new_tensor_2d(ctx, t, COLS, ROWS)
        b = base.ggml_new_tensor_2d(ctx, 0, COLS, cols)
        ctypes.memmove(base.ggml_get_data(a), rows.ctypes.data, rows.nbytes)
        x = oracle.activations(COLS * cols)
        ctypes.memmove(base.ggml_get_data(b), x.ctypes.data, x.nbytes)
        g = base.ggml_new_graph(ctx)
        base.ggml_build_forward_expand(g, base.ggml_mul_mat(ctx, a, b))
        out.append(best_time(lambda: cpu.ggml_graph_compute_with_ctx(ctx, g, threads)))
        base.ggml_free(ctx)
    gbs = rows.nbytes / out[0] / 1e9
    return gbs, ROWS * COLS / out[0] / 1e9, 8 * ROWS * COLS / out[1] / 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("types", nargs="*", default=["Q4_0", "Q4_K"] + oracle.MORE)
    args = ap.parse_args()
    print(f"llama.cpp mul_mat, {ROWS} x {COLS}, {args.threads} thread(s), best of repeated runs\n")
    print("| type | GB/s | 1 col GMAC/s | 8 cols GMAC/s |")
    print("|---|---:|---:|---:|")
    for tname in args.types:
        gbs, g1, g8 = bench(tname, args.threads)
        print(f"| {tname} | {gbs:.2f} | {g1:.1f} | {g8:.1f} |", flush=True)


if __name__ == "__main__":
    main()
