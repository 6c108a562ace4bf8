#!/usr/bin/env python3
"""Golden files for ferrolm-quant's bit-exactness tests, made with the `gguf` package (0.19.0).

For every block type: random blocks (random bytes with sane scale fields), dequantized with
gguf.quants -> tests/golden/deq_<TYPE>.bin = raw block bytes followed by the f32 outputs (LE).
For every type gguf can quantize: random f32 rows quantized with gguf.quants ->
tests/golden/q_<TYPE>.bin = the f32 inputs followed by the block bytes.
Q8_1 and Q8_K (activation-only types gguf lacks) use the numpy mirrors of ggml's
quantize_row_q8_1_ref / quantize_row_q8_K_ref written below.

Run from the repository root:  python3 scripts/quant_golden.py
"""
import os

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants

OUT = os.path.join(os.path.dirname(__file__), "..", "crates", "ferrolm-quant", "tests", "golden")
N_BLOCKS = 16
rng = np.random.default_rng(20240601)

# (block elements, block bytes) as in ggml-common.h (Q8_1 is 36 bytes there: f16 d, f16 s).
SIZES = {
    "F32": (1, 4), "F16": (1, 2), "BF16": (1, 2),
    "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
    "Q8_0": (32, 34), "Q8_1": (32, 36),
    "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176),
    "Q6_K": (256, 210), "Q8_K": (256, 292), "IQ4_NL": (32, 18), "MXFP4": (32, 17),
    "IQ2_XXS": (256, 66), "IQ2_XS": (256, 74), "IQ2_S": (256, 82), "IQ3_XXS": (256, 98),
    "IQ3_S": (256, 110), "IQ1_S": (256, 50), "IQ1_M": (256, 56), "IQ4_XS": (256, 136),
    "TQ1_0": (256, 54), "TQ2_0": (256, 66), "NVFP4": (64, 36),
}
# Byte offsets of f16 scale fields inside a block.
F16_FIELDS = {
    "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q8_1": [0, 2],
    "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
    "IQ4_NL": [0], "IQ2_XXS": [0], "IQ2_XS": [0], "IQ2_S": [0], "IQ3_XXS": [0], "IQ3_S": [0],
    "IQ1_S": [0], "IQ4_XS": [0], "TQ1_0": [52], "TQ2_0": [64],
}


def sane_f16(n):
    """Normal-ish f16 values of varied magnitude, never inf/NaN."""
    v = rng.standard_normal(n) * np.exp2(rng.integers(-12, 4, n))
    return v.astype(np.float16)


def random_blocks(name):
    bs, nbytes = SIZES[name]
    if name == "F32":
        return (rng.standard_normal(N_BLOCKS * 32) * 3).astype(np.float32).view(np.uint8)
    if name == "F16":
        return sane_f16(N_BLOCKS * 32).view(np.uint8)
    if name == "BF16":
        f = (rng.standard_normal(N_BLOCKS * 32) * 5).astype(np.float32)
        return (f.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    raw = rng.integers(0, 256, (N_BLOCKS, nbytes), dtype=np.uint8)
    for off in F16_FIELDS.get(name, []):
        raw[:, off:off + 2] = sane_f16(N_BLOCKS).view(np.uint8).reshape(N_BLOCKS, 2)
    if name == "Q8_K":
        raw[:, 0:4] = (rng.standard_normal(N_BLOCKS) * 0.01).astype(np.float32).view(np.uint8).reshape(N_BLOCKS, 4)
    if name == "MXFP4":
        e = rng.integers(90, 160, N_BLOCKS).astype(np.uint8)
        e[:3] = [0, 1, 2]  # subnormal and smallest normal scales
        raw[:, 0] = e
    if name == "IQ1_M":
        # The f16 super-block scale is the top nibble of each of the four u16 scale words.
        d = sane_f16(N_BLOCKS).view(np.uint16)
        sc = raw[:, 48:56].copy().view(np.uint16) & np.uint16(0x0FFF)
        for k in range(4):
            sc[:, k] |= ((d >> np.uint16(4 * k)) & np.uint16(0xF)) << np.uint16(12)
        raw[:, 48:56] = sc.view(np.uint8)
    if name == "NVFP4":
        raw[:3, 0] = [0x00, 0x7F, 0x01]  # zero, the 0x7F "zero" code, the smallest subnormal
    return raw.reshape(-1)


def ref_dequant(name, raw):
    bs, nbytes = SIZES[name]
    if name == "Q8_1":
        b = raw.reshape(-1, nbytes)
        d = b[:, 0:2].copy().view(np.float16).astype(np.float32)
        return (b[:, 4:].copy().view(np.int8).astype(np.float32) * d).reshape(-1)
    if name == "Q8_K":
        b = raw.reshape(-1, nbytes)
        d = b[:, 0:4].copy().view(np.float32)
        return (b[:, 4:260].copy().view(np.int8).astype(np.float32) * d).reshape(-1)
    if name == "BF16":
        return quants.dequantize(raw.reshape(1, -1), T.BF16).reshape(-1).astype(np.float32)
    return quants.dequantize(raw.reshape(1, -1), T[name]).reshape(-1).astype(np.float32)


def q8_1_ref(x):
    """numpy mirror of ggml's quantize_row_q8_1_ref (roundf, s = sum(q) * d as f16)."""
    b = x.reshape(-1, 32)
    d = (np.abs(b).max(axis=1, keepdims=True) / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        idv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    q = quants.np_roundf((b * idv).astype(np.float32)).astype(np.int8)
    s = (q.astype(np.int32).sum(axis=1, keepdims=True).astype(np.float32) * d).astype(np.float32)
    out = np.concatenate([d.astype(np.float16).view(np.uint8), s.astype(np.float16).view(np.uint8),
                          q.view(np.uint8)], axis=1)
    return out.reshape(-1)


def q8_k_ref(x):
    """numpy mirror of ggml's quantize_row_q8_K_ref (signed max, nearest-even, bsums)."""
    out = []
    for b in x.reshape(-1, 256):
        imax = int(np.argmax(np.abs(b)))
        mx = b[imax]
        if np.abs(mx) == 0:
            out.append(np.zeros(292, dtype=np.uint8))
            continue
        iscale = np.float32(-127) / mx
        q = np.minimum(np.rint((iscale * b).astype(np.float32)), 127).astype(np.int8)
        bsums = q.astype(np.int32).reshape(16, 16).sum(axis=1).astype(np.int16)
        d = np.float32(1) / iscale
        out.append(np.concatenate([np.array([d], np.float32).view(np.uint8), q.view(np.uint8),
                                   bsums.view(np.uint8)]))
    return np.concatenate(out)


def quant_inputs(name):
    n = N_BLOCKS * 256 if name == "Q8_K" else N_BLOCKS * 32
    x = (rng.standard_normal(n) * np.exp2(rng.integers(-6, 3, n // 32).repeat(32))).astype(np.float32)
    bs = SIZES[name][0] if SIZES[name][0] > 1 else 32
    x[:bs] = 0.0  # an all-zero block
    # Quarter steps (many exact ties for the rounding rules) with a wide enough range; no -0.0,
    # whose sign numpy's min and ggml's first-smallest scan pick differently.
    x[bs:2 * bs] = np.round(rng.standard_normal(bs) * 16) / 4 + np.float32(0.0)
    x[2 * bs + 3] = -x[2 * bs:3 * bs].__abs__().max() * 1.5  # negative extreme
    return x


def ref_quant(name, x):
    if name == "Q8_1":
        return q8_1_ref(x)
    if name == "Q8_K":
        return q8_k_ref(x)
    if name == "F16":
        return x.astype(np.float16).view(np.uint8).reshape(-1)
    return quants.quantize(x.reshape(1, -1), T[name]).reshape(-1)


# The lattice tables of the i-quants, taken from gguf.quants (llama.cpp's own numpy port):
# (rust name, gguf class, bytes per entry). Each entry is packed little-endian into one integer,
# byte j = element j, as ggml-common.h stores iq2xxs_grid & co.
GRIDS = [("IQ2XXS_GRID", "IQ2_XXS", 8), ("IQ2XS_GRID", "IQ2_XS", 8), ("IQ2S_GRID", "IQ2_S", 8),
         ("IQ3XXS_GRID", "IQ3_XXS", 4), ("IQ3S_GRID", "IQ3_S", 4), ("IQ1S_GRID", "IQ1_S", 8)]
GRIDS_RS = os.path.join(os.path.dirname(__file__), "..", "crates", "ferrolm-quant", "src",
                        "iq_grids.rs")


def grid_words(cls_name):
    cls = getattr(quants, cls_name)
    cls.init_grid()
    g = cls.grid.reshape(cls.grid_shape).astype(np.int64)
    b = (g & 0xFF).astype(np.uint64)  # IQ1_S's -1 becomes 0xff, as int8 in C
    return [int(sum(int(b[i, j]) << (8 * j) for j in range(g.shape[1]))) for i in range(g.shape[0])]


def write_grids():
    lines = ["//! The i-quants' lattice tables (generated by scripts/quant_golden.py from gguf.quants,",
             "//! llama.cpp's numpy port; do not edit). Entry `i` packs element `j` in byte `j`",
             "//! (little-endian), as ggml-common.h stores them; IQ1_S's bytes are i8.", ""]
    for rust, cls_name, nbytes in GRIDS:
        words = grid_words(cls_name)
        ty = "u64" if nbytes == 8 else "u32"
        lines.append(f"/// `{cls_name}`'s grid: {len(words)} entries of {nbytes} bytes.")
        lines.append(f"pub(crate) static {rust}: [{ty}; {len(words)}] = [")
        per_line = 4 if nbytes == 8 else 8
        for i in range(0, len(words), per_line):
            lines.append("    " + " ".join(f"0x{w:0{2 * nbytes}x}," for w in words[i:i + per_line]))
        lines.append("];")
        lines.append("")
    with open(GRIDS_RS, "w") as f:
        f.write("\n".join(lines))
    # The sign table, which the crate computes (an even-parity completion of 7 bits), as gguf has it.
    with open(os.path.join(OUT, "ksigns_iq2xs.bin"), "wb") as f:
        f.write(quants.IQ2_XXS.ksigns)


# Dequantize goldens added after the first set (see main).
LATER = ["IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "IQ4_XS", "TQ1_0",
         "TQ2_0", "NVFP4"]


def write_deq(name):
    raw = random_blocks(name)
    out = ref_dequant(name, raw)
    assert out.dtype == np.float32 and out.size == raw.size // SIZES[name][1] * SIZES[name][0]
    data = raw.tobytes() + out.astype("<f4").tobytes()
    with open(os.path.join(OUT, f"deq_{name}.bin"), "wb") as f:
        f.write(data)
    return len(data)


def main():
    write_grids()
    os.makedirs(OUT, exist_ok=True)
    total = 0
    for name in SIZES:
        if name not in LATER:
            total += write_deq(name)
    for name in ["F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q8_1", "Q8_K", "MXFP4"]:
        x = quant_inputs(name)
        q = ref_quant(name, x)
        data = x.astype("<f4").tobytes() + q.tobytes()
        with open(os.path.join(OUT, f"q_{name}.bin"), "wb") as f:
            f.write(data)
        total += len(data)
    # Types added later draw their random blocks after the others, so that adding them left
    # the older goldens as they were.
    for name in LATER:
        total += write_deq(name)
    print(f"wrote {total} bytes to {os.path.normpath(OUT)}")


if __name__ == "__main__":
    main()
