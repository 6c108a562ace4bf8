#!/usr/bin/env python3
"""Golden files from llama.cpp's OWN compiled CPU kernels, called through ctypes.

ferrolm must reproduce llama.cpp's float results bit for bit (activations are re-quantized to
Q8 before every matmul, so a one-ulp difference anywhere flips roundings downstream). This
script calls the functions of the installed llama.cpp build (llama-cpp-python 0.3.36, ggml
built with GGML_NATIVE=ON by gcc 12 on the AVX512 EPYC these goldens are made on) on random
inputs and writes what they return to crates/ferrolm-quant/tests/ggml_oracle/*.bin.

File format (little-endian): magic b"GGO1", then records until EOF; a record is
  u32 kind length, kind (utf-8), u32 int count, that many i64, u32 array count,
  that many (u32 byte length, bytes).

Files and records:
  from_float.bin  "from_float" [ggml type, n] [x f32, out bytes]: traits(type).from_float,
                  i.e. quantize_row_q8_0/q8_1/q8_K, ggml_cpu_fp32_to_fp16/bf16.
  vec_dot.bin     "vec_dot" [weight type, n] [row bytes, act bytes, f32 result]: the type's
                  vec_dot against an activation made by its vec_dot_type's from_float.
  sgemm.bin       "sgemm" [weight type, m rows, n cols, k elements] [A bytes (m rows), B bytes
                  (n columns of vec_dot_type), C f32 (n x m, column j at j*m)]: llamafile_sgemm,
                  the path ggml_compute_forward_mul_mat takes for batches of >= 2 columns.
  vec.bin         "swiglu" [n] [gate f32, up f32, out f32]: ggml_vec_swiglu_f32(n, out, gate, up)
                  "silu" [n] [x f32, out f32]: ggml_vec_silu_f32
                  "soft_max" [n] [x f32, max f32 (1 value), out f32, sum f64]: ggml_vec_soft_max_f32
                  "dot_f16" [n] [x f16, y f16, f32 result]: ggml_vec_dot_f16
  gelu.bin        "gelu_table" [] [65536 f16]: ggml_table_gelu_f16, the table ggml_cpu_init fills
                  and ggml_vec_gelu_f32 / ggml_vec_geglu_f32 read (GGML_GELU_FP16)
  more_types.bin  (python3 scripts/ggml_oracle.py more) the block types added later (the
                  i-quants IQ1_S..IQ4_XS, TQ1_0, TQ2_0, Q1_0, Q2_0, NVFP4), on random valid
                  blocks (random bytes, sane f16 scales; their quantizers need an importance
                  matrix for some of them):
                  "to_float" [type, n] [block bytes, f32 out]: ggml_get_type_traits(type)->to_float
                  "vec_dot" as in vec_dot.bin
  products.bin    (python3 scripts/ggml_oracle.py products) whole matrix products through
                  ggml_mul_mat and the CPU backend's graph compute, the paths llama.cpp's
                  default configuration takes on this CPU:
                  "mul_mat" [weight type, k elements, m rows, n columns, repacked 0/1]
                  [weights (m rows), the activations (n random f32 columns) quantized by the
                  vec_dot_type's from_float, out f32 (n x m, column j at j*m)]: with repacked
                  the weights live in the CPU_REPACK buffer (Q4_K: ggml_gemv/gemm_q4_K_8x8_q8_K;
                  Q4_0, IQ4_NL, MXFP4: ggml_gemv/gemm_q4_0/iq4_nl/mxfp4_8x8_q8_0; Q2_K, AVX512
                  builds only: ggml_gemv/gemm_q2_K_8x8_q8_K),
                  otherwise in a plain one (K-quants with >= 8 columns: the tiled matmul).
  products_id.bin (python3 scripts/ggml_oracle.py products_id) expert products through
                  ggml_mul_mat_id with the 3-D weights in the CPU_REPACK buffer (llama.cpp's MoE
                  layers, whose expert tensors it repacks like 2-D ones: its gemv for every
                  routed row):
                  "mul_mat_id" [weight type, k elements, m rows per expert, experts, used
                  experts, tokens, repacked 0/1] [weights (experts x m rows), the activations
                  (one f32 column per token, shared by its used experts) quantized by the
                  vec_dot_type's from_float, ids i32 (tokens x used), out f32 (tokens x used x
                  m: token t's slot u at (t * used + u) * m)].

Run from the repository root:  python3 scripts/ggml_oracle.py
"""
import ctypes
import os
import struct

import numpy as np

# GGML_LIB_DIR overrides where the compiled libggml-base/libggml-cpu are taken from (e.g. the
# build folder of an unfinished llama-cpp-python install, or a build of b11312's ggml/ folder
# alone: cmake -S ggml -B build -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=ON, then build/src).
LIB = os.environ.get("GGML_LIB_DIR",
                     "/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/llama_cpp/lib")
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "crates", "ferrolm-quant",
                   "tests", "ggml_oracle")

base = ctypes.CDLL(os.path.join(LIB, "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
cpu = ctypes.CDLL(os.path.join(LIB, "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
cpu.ggml_cpu_init()

rng = np.random.default_rng(20261130)

T = dict(F32=0, F16=1, Q4_0=2, Q4_1=3, Q5_0=6, Q5_1=7, Q8_0=8, Q8_1=9, Q2_K=10, Q3_K=11,
         Q4_K=12, Q5_K=13, Q6_K=14, Q8_K=15, IQ4_NL=20, BF16=30, MXFP4=39,
         IQ2_XXS=16, IQ2_XS=17, IQ3_XXS=18, IQ1_S=19, IQ3_S=21, IQ2_S=22, IQ4_XS=23, IQ1_M=29,
         TQ1_0=34, TQ2_0=35, NVFP4=40, Q1_0=41, Q2_0=42)
# (block elements, block bytes)
SIZES = {0: (1, 4), 1: (1, 2), 30: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24),
         8: (32, 34), 9: (32, 36), 10: (256, 84), 11: (256, 110), 12: (256, 144),
         13: (256, 176), 14: (256, 210), 15: (256, 292), 20: (32, 18), 39: (32, 17),
         16: (256, 66), 17: (256, 74), 18: (256, 98), 19: (256, 50), 21: (256, 110),
         22: (256, 82), 23: (256, 136), 29: (256, 56), 34: (256, 54), 35: (256, 66),
         40: (64, 36), 41: (128, 18), 42: (64, 18)}


class Traits(ctypes.Structure):
    _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p),
                ("vec_dot_type", ctypes.c_int), ("nrows", ctypes.c_int64)]


cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(Traits)
FROM_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
VEC_DOT = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                           ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def traits(t):
    return cpu.ggml_get_type_traits_cpu(t).contents


def ptr(a):
    return a.ctypes.data_as(ctypes.c_void_p)


def row_bytes(t, n):
    bs, nb = SIZES[t]
    assert n % bs == 0
    return n // bs * nb


def from_float(t, x):
    """The CPU backend's from_float of type t (what mul_mat uses for activations)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.zeros(row_bytes(t, len(x)), dtype=np.uint8)
    f = traits(t).from_float
    assert f, t
    FROM_FLOAT(f)(ptr(x), ptr(out), len(x))
    return out


base.ggml_quantize_chunk.restype = ctypes.c_size_t
base.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                     ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                     ctypes.c_void_p]


def quantize_weights(t, x):
    """Reference quantization (as llama-quantize without imatrix) of one row."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if t == T["F32"]:
        return x.view(np.uint8).copy()
    if t == T["F16"]:
        return x.astype(np.float16).view(np.uint8).copy()
    out = np.zeros(row_bytes(t, len(x)), dtype=np.uint8)
    base.ggml_quantize_chunk(t, ptr(x), ptr(out), 0, 1, len(x), None)
    return out


def activations(n, scale=1.0):
    """N(0,1) with a few outliers, like a transformer's hidden state."""
    x = rng.standard_normal(n).astype(np.float32) * scale
    k = max(1, n // 100)
    idx = rng.integers(0, n, k)
    x[idx] *= rng.uniform(5, 30, k).astype(np.float32)
    return x.astype(np.float32)


def weights(n):
    """Weight-like floats: small gaussian with per-row scale and a few larger values."""
    s = np.float32(rng.uniform(0.01, 0.1))
    x = rng.standard_normal(n).astype(np.float32) * s
    idx = rng.integers(0, n, max(1, n // 200))
    x[idx] *= 4
    return x.astype(np.float32)


class Writer:
    def __init__(self, name):
        os.makedirs(OUT, exist_ok=True)
        self.f = open(os.path.join(OUT, name), "wb")
        self.f.write(b"GGO1")

    def rec(self, kind, ints, arrays):
        k = kind.encode()
        self.f.write(struct.pack("<I", len(k)) + k)
        self.f.write(struct.pack("<I", len(ints)))
        for i in ints:
            self.f.write(struct.pack("<q", int(i)))
        self.f.write(struct.pack("<I", len(arrays)))
        for a in arrays:
            b = np.ascontiguousarray(a).tobytes()
            self.f.write(struct.pack("<I", len(b)) + b)

    def close(self):
        self.f.close()


def special_rows(n):
    """Rows that stress the Q8 rounding: exact halves, zeros, tiny and huge values."""
    rows = []
    # values k + 0.5 after scaling by 127 / amax with amax = 127: exact ties
    x = (rng.integers(-126, 126, n) + 0.5).astype(np.float32)
    x[::32] = 127.0
    rows.append(x)
    z = activations(n)
    z[:32] = 0.0  # an all-zero block
    rows.append(z)
    rows.append(activations(n, 1e-3))
    rows.append(activations(n, 300.0))
    return rows


def gen_from_float():
    w = Writer("from_float.bin")
    for tname, lengths in [("Q8_0", [32, 576, 640, 1536, 2048]),
                           ("Q8_1", [32, 576, 640, 1536, 2048]),
                           ("Q8_K", [256, 768, 1536, 2048]),
                           ("F16", [1, 7, 100, 513, 576, 2048]),
                           ("BF16", [1, 7, 100, 513, 576])]:
        t = T[tname]
        for n in lengths:
            rows = [activations(n), activations(n, 0.05)]
            if n % 32 == 0:
                rows += special_rows(n)
            for x in rows:
                w.rec("from_float", [t, n], [x, from_float(t, x)])
    w.close()


def vec_dot(t, n, row, act):
    s = np.zeros(1, dtype=np.float32)
    VEC_DOT(traits(t).vec_dot)(n, ptr(s), 0, ptr(row), 0, ptr(act), 0, 1)
    return s


def gen_vec_dot():
    w = Writer("vec_dot.bin")
    plan = {
        "F32": [1, 7, 16, 100, 513, 576, 1024],
        "F16": [1, 7, 64, 100, 513, 576, 2048],
        "BF16": [1, 7, 64, 100, 513, 576, 2048],
        "Q4_0": [32, 64, 96, 576, 1536, 4096],
        "Q4_1": [32, 64, 96, 576, 1536, 4096],
        "Q5_0": [32, 64, 96, 576, 1536],
        "Q5_1": [32, 64, 96, 576, 1536],
        "Q8_0": [32, 64, 96, 576, 1536, 4096],
        "IQ4_NL": [32, 64, 96, 576, 1536],
        "MXFP4": [32, 64, 96, 576, 1536],
        "Q2_K": [256, 512, 1536, 2048],
        "Q3_K": [256, 512, 1536, 2048],
        "Q4_K": [256, 512, 1536, 2048],
        "Q5_K": [256, 512, 1536, 2048],
        "Q6_K": [256, 512, 1536, 2048],
    }
    for tname, lengths in plan.items():
        t = T[tname]
        vt = traits(t).vec_dot_type
        for n in lengths:
            for r in range(3):
                row = quantize_weights(t, weights(n) * (10 if tname in ("F32", "F16", "BF16") else 1))
                act = from_float(vt, activations(n))
                w.rec("vec_dot", [t, n], [row, act, vec_dot(t, n, row, act)])
    w.close()


class Params(ctypes.Structure):
    _fields_ = [("ith", ctypes.c_int), ("nth", ctypes.c_int), ("wsize", ctypes.c_size_t),
                ("wdata", ctypes.c_void_p), ("threadpool", ctypes.c_void_p),
                ("use_ref", ctypes.c_bool)]


class TPParams(ctypes.Structure):
    _fields_ = [("cpumask", ctypes.c_bool * 512), ("n_threads", ctypes.c_int),
                ("prio", ctypes.c_int), ("poll", ctypes.c_uint32), ("strict_cpu", ctypes.c_bool),
                ("paused", ctypes.c_bool)]


base.ggml_threadpool_params_default.restype = TPParams
base.ggml_threadpool_params_default.argtypes = [ctypes.c_int]
cpu.ggml_threadpool_new.restype = ctypes.c_void_p
cpu.ggml_threadpool_new.argtypes = [ctypes.POINTER(TPParams)]
cpu.llamafile_sgemm.restype = ctypes.c_bool
cpu.llamafile_sgemm.argtypes = [ctypes.POINTER(Params), ctypes.c_int64, ctypes.c_int64,
                                ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,
                                ctypes.c_int, ctypes.c_int]
_tpp = base.ggml_threadpool_params_default(1)
_tp = cpu.ggml_threadpool_new(ctypes.byref(_tpp))
_params = Params(0, 1, 0, None, _tp, False)


def sgemm(t, m, n, k_elems, a, b):
    """llamafile_sgemm(m rows of A, n columns of B) as ggml_compute_forward_mul_mat calls it
    (one thread). Returns None when it declines (mul_mat then uses vec_dot)."""
    vt = traits(t).vec_dot_type
    bs = SIZES[t][0]
    c = np.zeros(m * n, dtype=np.float32)
    lda = row_bytes(t, k_elems) // SIZES[t][1]
    ldb = row_bytes(vt, k_elems) // SIZES[vt][1]
    ok = cpu.llamafile_sgemm(ctypes.byref(_params), m, n, k_elems // bs, ptr(a), lda, ptr(b),
                             ldb, ptr(c), m, t, vt, 0)
    return c if ok else None


def gen_sgemm():
    w = Writer("sgemm.bin")
    plan = [("Q8_0", 8, 5, 576), ("Q8_0", 12, 7, 1536), ("Q8_0", 4, 2, 64), ("Q8_0", 6, 3, 96),
            ("Q4_0", 8, 5, 576), ("Q4_0", 5, 3, 96),
            ("Q5_0", 8, 5, 576), ("IQ4_NL", 8, 5, 576),
            ("F16", 8, 5, 64), ("F16", 16, 9, 576), ("F16", 4, 3, 128),
            ("F32", 8, 5, 64), ("F32", 4, 3, 576),
            ("BF16", 8, 5, 64), ("BF16", 4, 3, 576)]
    for tname, m, n, k in plan:
        t = T[tname]
        vt = traits(t).vec_dot_type
        a = np.concatenate([quantize_weights(t, weights(k) * (10 if t in (0, 1, 30) else 1))
                            for _ in range(m)])
        b = np.concatenate([from_float(vt, activations(k)) for _ in range(n)])
        c = sgemm(t, m, n, k, a, b)
        if c is None:
            print(f"sgemm declined {tname} m={m} n={n} k={k}")
            continue
        w.rec("sgemm", [t, m, n, k], [a, b, c])
    w.close()


def gen_vec():
    w = Writer("vec.bin")
    f32p = ctypes.POINTER(ctypes.c_float)
    cpu.ggml_vec_swiglu_f32.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                        ctypes.c_void_p]
    cpu.ggml_vec_silu_f32.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    cpu.ggml_vec_soft_max_f32.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                          ctypes.c_float]
    cpu.ggml_vec_soft_max_f32.restype = ctypes.c_double
    cpu.ggml_vec_dot_f16.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t,
                                     ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                                     ctypes.c_size_t, ctypes.c_int]
    del f32p
    for n in [1, 5, 15, 16, 17, 31, 64, 100, 576, 1536, 1000]:
        g = activations(n) * np.float32(2)
        u = activations(n)
        if n >= 16:
            g[:4] = [90.0, -90.0, -110.0, 0.0]  # overflow / underflow branches of ggml_v_expf
        y = np.zeros(n, dtype=np.float32)
        cpu.ggml_vec_swiglu_f32(n, ptr(y), ptr(g), ptr(u))
        w.rec("swiglu", [n], [g, u, y.copy()])
        y = np.zeros(n, dtype=np.float32)
        cpu.ggml_vec_silu_f32(n, ptr(y), ptr(g))
        w.rec("silu", [n], [g, y.copy()])
    for n in [1, 5, 15, 16, 17, 33, 100, 256, 1000, 4097]:
        for scale in [1.0, 8.0, 40.0]:
            x = (rng.standard_normal(n) * scale).astype(np.float32)
            if n > 20 and scale == 40.0:
                x[3] = -200.0  # far below the max: flushes to zero
            mx = np.float32(x.max())
            y = np.zeros(n, dtype=np.float32)
            s = cpu.ggml_vec_soft_max_f32(n, ptr(y), ptr(x), ctypes.c_float(mx))
            w.rec("soft_max", [n], [x, np.array([mx], np.float32), y,
                                    np.array([s], np.float64)])
    for n in [1, 7, 63, 64, 65, 100, 127, 128, 129, 513, 576, 1000, 2048]:
        for scale in [0.1, 1.0, 10.0]:
            x = (rng.standard_normal(n) * scale).astype(np.float16)
            y = (rng.standard_normal(n)).astype(np.float16)
            s = np.zeros(1, dtype=np.float32)
            cpu.ggml_vec_dot_f16(n, ptr(s), 0, ptr(x), 0, ptr(y), 0, 1)
            w.rec("dot_f16", [n], [x, y, s])
    w.close()


def gen_gelu():
    w = Writer("gelu.bin")
    table = (ctypes.c_uint16 * 65536).in_dll(cpu, "ggml_table_gelu_f16")
    w.rec("gelu_table", [], [np.frombuffer(bytes(table), dtype=np.uint16).copy()])
    w.close()


class TypeTraits(ctypes.Structure):
    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64),
                ("blck_size_interleave", ctypes.c_int64), ("type_size", ctypes.c_size_t),
                ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p),
                ("from_float_ref", ctypes.c_void_p)]


base.ggml_get_type_traits.restype = ctypes.POINTER(TypeTraits)
TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)

# Byte offsets of the f16 scales in the later types' blocks (IQ1_M's is spread, see below).
MORE_F16 = {"IQ2_XXS": [0], "IQ2_XS": [0], "IQ2_S": [0], "IQ3_XXS": [0], "IQ3_S": [0],
            "IQ1_S": [0], "IQ4_XS": [0], "TQ1_0": [52], "TQ2_0": [64], "Q1_0": [0], "Q2_0": [0]}


def random_blocks(tname, n):
    t = T[tname]
    bs, nbytes = SIZES[t]
    nb = n // bs
    raw = rng.integers(0, 256, (nb, nbytes), dtype=np.uint8)
    for off in MORE_F16.get(tname, []):
        d = (rng.standard_normal(nb) * np.float32(0.02) + np.float32(0.001)).astype(np.float16)
        raw[:, off:off + 2] = d.view(np.uint8).reshape(nb, 2)
    if tname == "IQ1_M":
        d = (rng.standard_normal(nb) * np.float32(0.02)).astype(np.float16).view(np.uint16)
        sc = raw[:, 48:56].copy().view(np.uint16) & np.uint16(0x0FFF)
        for k in range(4):
            sc[:, k] |= ((d >> np.uint16(4 * k)) & np.uint16(0xF)) << np.uint16(12)
        raw[:, 48:56] = sc.view(np.uint8)
    if tname == "NVFP4":
        raw[:, :4] = rng.integers(0x20, 0x48, (nb, 4), dtype=np.uint8)  # scales near 1/4..2
    return raw.reshape(-1)


def to_float(t, raw, n):
    out = np.zeros(n, dtype=np.float32)
    TO_FLOAT(base.ggml_get_type_traits(t).contents.to_float)(ptr(raw), ptr(out), n)
    return out


MORE = ["IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "IQ4_XS", "TQ1_0",
        "TQ2_0", "Q1_0", "Q2_0", "NVFP4"]


def gen_more():
    w = Writer("more_types.bin")
    for tname in MORE:
        t = T[tname]
        bs = SIZES[t][0]
        n = 16 * bs
        raw = random_blocks(tname, n)
        w.rec("to_float", [t, n], [raw, to_float(t, raw, n)])
    for tname in MORE:
        t = T[tname]
        vt = traits(t).vec_dot_type
        bs = max(SIZES[t][0], 256)
        for n in [bs, 2 * bs, 3 * bs, 6 * bs, 16 * bs]:
            for r in range(3):
                row = random_blocks(tname, n)
                act = from_float(vt, activations(n))
                w.rec("vec_dot", [t, n], [row, act, vec_dot(t, n, row, act)])
    w.close()


class InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p),
                ("no_alloc", ctypes.c_bool)]


def _graph_api():
    vp = ctypes.c_void_p
    for f, res, args in [("ggml_init", vp, [InitParams]), ("ggml_free", None, [vp]),
                         ("ggml_new_tensor_2d", vp, [vp, ctypes.c_int, ctypes.c_int64,
                                                     ctypes.c_int64]),
                         ("ggml_mul_mat", vp, [vp, vp, vp]), ("ggml_new_graph", vp, [vp]),
                         ("ggml_build_forward_expand", None, [vp, vp]),
                         ("ggml_get_data", vp, [vp]),
                         ("ggml_backend_alloc_ctx_tensors_from_buft", vp, [vp, vp]),
                         ("ggml_backend_tensor_set", None, [vp, vp, ctypes.c_size_t,
                                                            ctypes.c_size_t]),
                         ("ggml_backend_buffer_free", None, [vp])]:
        getattr(base, f).restype, getattr(base, f).argtypes = res, args
    cpu.ggml_graph_compute_with_ctx.argtypes = [vp, vp, ctypes.c_int]
    cpu.ggml_backend_cpu_buffer_type.restype = vp
    # a C++ symbol: ggml_backend_cpu_repack_buffer_type()
    repack = getattr(cpu, "_Z35ggml_backend_cpu_repack_buffer_typev")
    repack.restype = vp
    return repack


def mul_mat(t, k, m, w, x, repacked):
    """ggml_mul_mat of m rows of k elements of type t (bytes w) by the columns of x (f32, k
    each), one thread, weights in the CPU_REPACK buffer or a plain one: out[j * m + i]."""
    repack_buft = _graph_api()
    n = len(x) // k
    wctx = base.ggml_init(InitParams(1 << 16, None, True))
    a = base.ggml_new_tensor_2d(wctx, t, k, m)
    buft = repack_buft() if repacked else cpu.ggml_backend_cpu_buffer_type()
    buf = base.ggml_backend_alloc_ctx_tensors_from_buft(wctx, buft)
    base.ggml_backend_tensor_set(a, ptr(w), 0, len(w))  # the repack happens here
    ctx = base.ggml_init(InitParams(64 << 20, None, False))
    b = base.ggml_new_tensor_2d(ctx, T["F32"], k, n)
    ctypes.memmove(base.ggml_get_data(b), ptr(x), x.nbytes)
    c = base.ggml_mul_mat(ctx, a, b)
    graph = base.ggml_new_graph(ctx)
    base.ggml_build_forward_expand(graph, c)
    cpu.ggml_graph_compute_with_ctx(ctx, graph, 1)
    out = np.ctypeslib.as_array((ctypes.c_float * (n * m)).from_address(base.ggml_get_data(c)))
    out = out.copy()
    base.ggml_free(ctx)
    base.ggml_backend_buffer_free(buf)
    base.ggml_free(wctx)
    return out


def mul_mat_id(t, k, m, n_expert, w, x, ids, repacked):
    """ggml_mul_mat_id of n_expert stacked m x k matrices of type t (bytes w) by the tokens'
    columns of x (f32, k each, one per token, broadcast over its used experts), the experts of
    token j at ids[j * n_used:]: out[(j * n_used + u) * m + i]. One thread; the weights in the
    CPU_REPACK buffer or a plain one."""
    repack_buft = _graph_api()
    vp = ctypes.c_void_p
    for f, res, args in [("ggml_new_tensor_3d", vp, [vp, ctypes.c_int, ctypes.c_int64,
                                                     ctypes.c_int64, ctypes.c_int64]),
                         ("ggml_mul_mat_id", vp, [vp, vp, vp, vp])]:
        getattr(base, f).restype, getattr(base, f).argtypes = res, args
    n_tok = len(x) // k
    n_used = len(ids) // n_tok
    wctx = base.ggml_init(InitParams(1 << 16, None, True))
    a = base.ggml_new_tensor_3d(wctx, t, k, m, n_expert)
    buft = repack_buft() if repacked else cpu.ggml_backend_cpu_buffer_type()
    buf = base.ggml_backend_alloc_ctx_tensors_from_buft(wctx, buft)
    base.ggml_backend_tensor_set(a, ptr(w), 0, len(w))  # the repack happens here
    ctx = base.ggml_init(InitParams(64 << 20, None, False))
    b = base.ggml_new_tensor_3d(ctx, T["F32"], k, 1, n_tok)
    ctypes.memmove(base.ggml_get_data(b), ptr(x), x.nbytes)
    i = base.ggml_new_tensor_2d(ctx, 26, n_used, n_tok)  # GGML_TYPE_I32
    ids = np.ascontiguousarray(ids, dtype=np.int32)
    ctypes.memmove(base.ggml_get_data(i), ptr(ids), ids.nbytes)
    c = base.ggml_mul_mat_id(ctx, a, b, i)
    graph = base.ggml_new_graph(ctx)
    base.ggml_build_forward_expand(graph, c)
    cpu.ggml_graph_compute_with_ctx(ctx, graph, 1)
    count = m * n_used * n_tok
    out = np.ctypeslib.as_array((ctypes.c_float * count).from_address(base.ggml_get_data(c)))
    out = out.copy()
    base.ggml_free(ctx)
    base.ggml_backend_buffer_free(buf)
    base.ggml_free(wctx)
    return out


def gen_products_id():
    w = Writer("products_id.bin")
    # 4 experts, 2 used per token; 16 and 24 rows per expert (the gemv's 8-row groups); 1, 3
    # and 9 tokens (so some experts meet several tokens, a batch llama.cpp still runs row by
    # row through its gemv); Q2_K is repacked only by an AVX512 build
    cases = [(t, m, n) for t in ("MXFP4", "Q4_0", "IQ4_NL", "Q4_K", "Q2_K") for m in (16, 24)
             for n in (1, 3, 9)]
    for tname, m, n in cases:
        t = T[tname]
        k = 7 * 32 if SIZES[t][0] == 32 else 2 * 256
        n_expert, n_used = 4, 2
        rows = np.concatenate([quantize_weights(t, weights(k)) for _ in range(n_expert * m)])
        cols = [activations(k) for _ in range(n)]
        x = np.concatenate(cols).astype(np.float32)
        q = np.concatenate([from_float(traits(t).vec_dot_type, c) for c in cols])
        ids = np.concatenate([rng.choice(n_expert, n_used, replace=False) for _ in range(n)])
        out = mul_mat_id(t, k, m, n_expert, rows, x, ids, 1)
        w.rec("mul_mat_id", [t, k, m, n_expert, n_used, n, 1],
              [rows, q, ids.astype(np.int32), out])
    w.close()


def gen_products():
    w = Writer("products.bin")
    # Q4_K: 24 rows take the AVX512 gemm for 16 and its AVX2 loop for the last 8
    cases = [("Q4_K", 1, m, n) for m in (16, 24) for n in (1, 4, 5, 9)]
    cases += [(t, 0, 8, n) for t in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K") for n in (7, 13)]
    # Q4_0, IQ4_NL (q4_0/iq4_nl_8x8_q8_0): the AVX512 gemm takes 16 rows by 16 columns, its
    # AVX2 loops the rest of the rows (8) and of the columns' multiple of 4, the gemv the last
    # n % 4; an odd number of blocks per row
    cases += [(t, 1, m, n) for t in ("Q4_0", "IQ4_NL") for m in (8, 24, 40)
              for n in (1, 3, 4, 5, 16, 21)]
    # MXFP4 (mxfp4_8x8_q8_0): the same kernels, an e8m0 scale per block
    cases += [("MXFP4", 1, m, n) for m in (8, 24, 40) for n in (1, 3, 4, 5, 16, 21)]
    # Q2_K (q2_K_8x8_q8_K, repacked only by an AVX512 build): the AVX512 gemm takes 16 rows
    # by 16 columns, its AVX2 loops the rest of the rows (8) and columns (multiples of 4), the
    # gemv the last n % 4; kept last so that the cases above keep their random draws
    cases += [("Q2_K", 1, m, n) for m in (8, 24, 40) for n in (1, 3, 4, 5, 16, 21)]
    for tname, repacked, m, n in cases:
        t = T[tname]
        k = 7 * 32 if SIZES[t][0] == 32 else 2 * 256
        rows = np.concatenate([quantize_weights(t, weights(k)) for _ in range(m)])
        cols = [activations(k) for _ in range(n)]
        x = np.concatenate(cols).astype(np.float32)
        q = np.concatenate([from_float(traits(t).vec_dot_type, c) for c in cols])
        out = mul_mat(t, k, m, rows, x, repacked)
        w.rec("mul_mat", [t, k, m, n, repacked], [rows, q, out])
    w.close()


if __name__ == "__main__":
    import sys
    if sys.argv[1:] == ["gelu"]:
        gen_gelu()
        sys.exit(0)
    if sys.argv[1:] == ["more"]:
        gen_more()
        sys.exit(0)
    if sys.argv[1:] == ["products"]:
        gen_products()
        sys.exit(0)
    if sys.argv[1:] == ["products_id"]:
        gen_products_id()
        sys.exit(0)
    gen_from_float()
    gen_vec_dot()
    gen_sgemm()
    gen_vec()
    gen_gelu()
    total = sum(os.path.getsize(os.path.join(OUT, f)) for f in os.listdir(OUT))
    print(f"wrote {OUT}: {total} bytes")
