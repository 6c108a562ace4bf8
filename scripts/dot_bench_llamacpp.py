#!/usr/bin/env python3
"""llama.cpp's side of `cargo run --release -p ferrolm-quant --example dot_bench`: the same
4096 x 4096 matrix-vector product (and 8 columns, as in prompt processing) through ggml's own
mul_mat (its CPU backend, one thread by default), timed best of repeated runs, in weight GB/s and
GMAC/s. The weights are random valid blocks of each type (scripts/ggml_oracle.py's), the
activations f32 (ggml quantizes them inside the product, as in a model). Uses the same installed
llama.cpp build as the oracle script (GGML_LIB_DIR overrides it).

  python3 scripts/dot_bench_llamacpp.py [--threads 1] [--repack] [TYPE ...]

With --repack the weights live in llama.cpp's CPU_REPACK buffer (repacked at load, as its default
configuration places a model's Q4_0/Q4_K/IQ4_NL/MXFP4 matrices on x86), otherwise in a plain one.
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


InitParams = oracle.InitParams
REPACK_BUFT = oracle._graph_api()  # also declares the ggml functions used below
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


def bench(tname, threads, repack):
    t = oracle.T[tname]
    raw = (oracle.random_blocks(tname, ROWS * COLS) if tname in oracle.MORE
           else np.concatenate([oracle.quantize_weights(t, oracle.weights(COLS)) for _ in range(64)]))
    row_bytes = oracle.row_bytes(t, COLS)
    rows = np.resize(raw.reshape(-1, row_bytes), (ROWS, row_bytes))  # repeat distinct rows
    out = []
    for cols in (1, 8):
        ctx = base.ggml_init(InitParams(rows.nbytes + 4 * COLS * cols * 2 + (1 << 30), None, False))
        if repack:
            wctx = base.ggml_init(InitParams(1 << 16, None, True))
            a = base.ggml_new_tensor_2d(wctx, t, COLS, ROWS)
            buf = base.ggml_backend_alloc_ctx_tensors_from_buft(wctx, REPACK_BUFT())
            base.ggml_backend_tensor_set(a, rows.ctypes.data, 0, rows.nbytes)
        else:
            a = base.ggml_new_tensor_2d(ctx, t, COLS, ROWS)
            ctypes.memmove(base.ggml_get_data(a), rows.ctypes.data, rows.nbytes)
        b = base.ggml_new_tensor_2d(ctx, 0, COLS, cols)
        x = oracle.activations(COLS * cols)
        ctypes.memmove(base.ggml_get_data(b), x.ctypes.data, x.nbytes)
        g = base.ggml_new_graph(ctx)
        base.ggml_build_forward_expand(g, base.ggml_mul_mat(ctx, a, b))
        out.append(best_time(lambda: cpu.ggml_graph_compute_with_ctx(ctx, g, threads)))
        base.ggml_free(ctx)
        if repack:
            base.ggml_backend_buffer_free(buf)
            base.ggml_free(wctx)
    gbs = rows.nbytes / out[0] / 1e9
    return gbs, ROWS * COLS / out[0] / 1e9, 8 * ROWS * COLS / out[1] / 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repack", action="store_true")
    ap.add_argument("types", nargs="*", default=["Q4_0", "Q4_K"] + oracle.MORE)
    args = ap.parse_args()
    where = "CPU_REPACK" if args.repack else "plain"
    print(f"llama.cpp mul_mat, {ROWS} x {COLS}, {args.threads} thread(s), {where} buffer, "
          "best of repeated runs\n")
    print("| type | GB/s | 1 col GMAC/s | 8 cols GMAC/s |")
    print("|---|---:|---:|---:|")
    for tname in args.types:
        gbs, g1, g8 = bench(tname, args.threads, args.repack)
        print(f"| {tname} | {gbs:.2f} | {g1:.1f} | {g8:.1f} |", flush=True)


if __name__ == "__main__":
    main()
