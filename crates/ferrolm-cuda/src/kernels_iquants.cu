// The block types added for issue 21 (the i-quants IQ1_S..IQ4_XS, TQ1_0, TQ2_0, Q1_0, Q2_0,
// NVFP4) in the shape kernels.cu's product templates take: a struct per type with `load` (one
// 32-value chunk dequantized, for the prompt batches' tensor-core path), `ACT` (the activation
// format: Q8_K for the 256-value types, Q8_0 for the others, as on the CPU) and `dot` (the
// chunk against its quantized activations with dp4a).
//
// Compiled with the rest (kernels.rs puts this file at kernels.cu's `@IQUANTS` line, after the
// lattice tables `ferrolm_quant::lattice_tables_c()` renders: IQ2XXS_GRID, IQ2XS_GRID,
// IQ2S_GRID, IQ1S_GRID, IQ3XXS_GRID, IQ3S_GRID; CI compiles it with NVRTC), and instantiated
// by kernels.cu's type lists, but NOT YET RUN ON A GPU: `schedule::kernel_type` does not list
// these types, so a file with them declines on CUDA until `cuda-check` has compared each with
// the CPU. The CPU twin of every formula here is ferrolm-quant's dequantize (the same integer
// values and scales).
//
// Every type decodes a chunk into 32 signed byte values, four to a word (word k: values
// 4k..4k+4), and one float scale per 16 values: value i = s[i / 16] * v[i]. The i-quants' IQ1
// deltas fold in as the tiled CPU kernel folds them (v = 8 g + sign, s = d * m / 8); the ternary
// and 2-bit codes store t - 1. `load` and `dot` are then the same for all (iq_load, iq_dot).

struct IqChunk {
    u32 v[8];
    float s[2];
};

// Bit k of the low 4 bits of b -> 0xff in byte k.
__device__ __forceinline__ u32 iq_sign_mask4(u32 b) {
    return (((b & 15u) * 0x00204081u) & 0x01010101u) * 0xffu;
}

// Four unsigned magnitudes (bytes of g) negated where mask bytes are 0xff.
__device__ __forceinline__ u32 iq_apply_signs(u32 g, u32 mask) {
    return __vsub4(g ^ mask, mask);
}

// ggml's ksigns_iq2xs: seven stored sign bits completed to even parity.
__device__ __forceinline__ u32 iq_ksigns(u32 i) {
    i &= 127u;
    return i | ((__popc(i) & 1u) << 7);
}

// Eight magnitudes (a grid entry as two words) with the 8 sign bits of `signs`.
__device__ __forceinline__ void iq_signed8(u64 g, u32 signs, u32* out) {
    out[0] = iq_apply_signs((u32)g, iq_sign_mask4(signs));
    out[1] = iq_apply_signs((u32)(g >> 32), iq_sign_mask4(signs >> 4));
}

__device__ __forceinline__ u32 iq_u32(const u8* p) {
    return (u32)LD(p) | ((u32)LD(p + 1) << 8) | ((u32)LD(p + 2) << 16) | ((u32)LD(p + 3) << 24);
}

__device__ __forceinline__ u32 iq_u16(const u8* p) { return (u32)LD(p) | ((u32)LD(p + 1) << 8); }

template <typename T>
__device__ __forceinline__ void iq_load(const u8* row, int c, float* w) {
    IqChunk q = T::decode(row, c);
#pragma unroll
    for (int k = 0; k < 8; k++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            int v = (int)(signed char)((q.v[k] >> (8 * e)) & 0xffu);
            w[4 * k + e] = q.s[k >> 2] * (float)v;
        }
    }
}

template <typename T>
__device__ __forceinline__ float iq_dot(const u8* row, int c, const Act& a) {
    IqChunk q = T::decode(row, c);
    int lo = 0, hi = 0;
#pragma unroll
    for (int k = 0; k < 4; k++) {
        lo = __dp4a((int)q.v[k], a.q[k], lo);
        hi = __dp4a((int)q.v[k + 4], a.q[k + 4], hi);
    }
    return a.d * (q.s[0] * (float)lo + q.s[1] * (float)hi);
}

#define IQ_TYPE(NAME, ACTIVATION)                                                                 \
    static constexpr int ACT = ACTIVATION;                                                        \
    static __device__ __forceinline__ void load(const u8* row, int c, int nc, float* w) {         \
        iq_load<NAME>(row, c, w);                                                                 \
    }                                                                                             \
    static __device__ __forceinline__ float dot(const u8* row, int c, int nc, const Act& a) {     \
        return iq_dot<NAME>(row, c, a);                                                           \
    }

// IQ2_XXS (66 bytes / 256): f16 d; per 32 values two words: four grid bytes, then four 7-bit
// sign indices and a 4-bit scale. x = d * (0.5 + s) / 4 * signed grid.
struct IQ2_XXS {
    static __device__ __forceinline__ IqChunk decode(const u8* row, int c) {
        const u8* b = row + 66 * (c >> 3);
        int j = c & 7;
        u32 grid = iq_u32(b + 2 + 8 * j), aux = iq_u32(b + 6 + 8 * j);
        IqChunk q;
#pragma unroll
        for (int l = 0; l < 4; l++)
            iq_signed8(IQ2XXS_GRID[(grid >> (8 * l)) & 255u], iq_ksigns(aux >> (7 * l)), q.v + 2 * l);
        float s = h2f(LD((const u16*)b)) * (0.5f + (float)(aux >> 28)) * 0.25f;
        q.s[0] = s;
        q.s[1] = s;
        return q;
    }
    IQ_TYPE(IQ2_XXS, ACT_Q8_K)
};

// IQ2_XS (74 bytes): per 8 values a u16 of a 9-bit grid index and a 7-bit sign index; a scale
// byte per 32 (low nibble the first 16, high the second 16).
struct IQ2_XS {
    static __device__ __forceinline__ IqChunk decode(const u8* row, int c) {
        const u8* b = row + 74 * (c >> 3);
        int j = c & 7;
        IqChunk q;
#pragma unroll
        for (int l = 0; l < 4; l++) {
            u32 w = iq_u16(b + 2 + 8 * j + 2 * l);
            iq_signed8(IQ2XS_GRID[w & 511u], iq_ksigns(w >> 9), q.v + 2 * l);
        }
        float d = h2f(LD((const u16*)b));
        u32 sc = LD(b + 66 + j);
        q.s[0] = d * (0.5f + (float)(sc & 15u)) * 0.25f;
        q.s[1] = d * (0.5f + (float)(sc >> 4)) * 0.25f;
        return q;
    }
    IQ_TYPE(IQ2_XS, ACT_Q8_K)
};

// IQ2_S (82 bytes): 32 index bytes, 32 sign bytes, 8 bytes of index high bits, 8 scale bytes.
struct IQ2_S {
    static __device__ __forceinline__ IqChunk decode(const u8* row, int c) {
        const u8* b = row + 82 * (c >> 3);
        int j = c & 7;
        u32 qh = LD(b + 66 + j);
        IqChunk q;
#pragma unroll
        for (int l = 0; l < 4; l++) {
            u32 idx = (u32)LD(b + 2 + 4 * j + l) | ((qh << (8 - 2 * l)) & 0x300u);
            iq_signed8(IQ2S_GRID[idx], LD(b + 34 + 4 * j + l), q.v + 2 * l);
        }
        float d = h2f(LD((const u16*)b));
        u32 sc = LD(b + 74 + j);
        q.s[0] = d * (0.5f + (float)(sc & 15u)) * 0.25f;
        q.s[1] = d * (0.5f + (float)(sc >> 4)) * 0.25f;
        return q;
    }
    IQ_TYPE(IQ2_S, ACT_Q8_K)
};

// IQ3_XXS (98 bytes): 64 index bytes (4 values each), then per 32 values a word of four 7-bit
// sign indices and a 4-bit scale. x = d * (0.5 + s) / 2 * signed grid.
struct IQ3_XXS {
    static __device__ __forceinline__ IqChunk decode(const u8* row, int c) {
        const u8* b = row + 98 * (c >> 3);
        int j = c & 7;
        u32 aux = iq_u32(b + 66 + 4 * j);
        IqChunk q;
#pragma unroll
        for (int l = 0; l < 4; l++) {
            u64 g = (u64)IQ3XXS_GRID[LD(b + 2 + 8 * j + 2 * l)] |
                    ((u64)IQ3XXS_GRID[LD(b + 3 + 8 * j + 2 * l)] << 32);
            iq_signed8(g, iq_ksigns(aux >> (7 * l)), q.v + 2 * l);
        }
        float s = h2f(LD((const u16*)b)) * (0.5f + (float)(aux >> 28)) * 0.5f;
        q.s[0] = s;
        q.s[1] = s;
        return q;
    }
    IQ_TYPE(IQ3_XXS, ACT_Q8_K)
};

// IQ3_S (110 bytes): 64 index bytes, 8 bytes of ninth bits, 32 sign bytes, 4 scale bytes
// (a nibble per 32 values). x = d * (1 + 2 s) * signed grid.
struct IQ3_S {
    static __device__ __forceinline__ IqChunk decode(const u8* row, int c) {
        const u8* b = row + 110 * (c >> 3);
        int j = c & 7;
        u32 qh = LD(b + 66 + j);
        IqChunk q;
#pragma unroll
        for (int l = 0; l < 4; l++) {
            u32 i1 = (u32)LD(b + 2 + 8 * j + 2 * l) | ((qh << (8 - 2 * l)) & 256u);
            u32 i2 = (u32)LD(b + 3 + 8 * j + 2 * l) | ((qh << (7 - 2 * l)) & 256u);
            u64 g = (u64)IQ3S_GRID[i1] | ((u64)IQ3S_GRID[i2] << 32);
            iq_signed8(g, LD(b + 74 + 4 * j + l), q.v + 2 * l);
        }
        u32 sc = (LD(b + 106 + (j >> 1)) >> (4 * (j & 1))) & 15u;
        float s = h2f(LD((const u16*)b)) * (float)(1 + 2 * sc);
        q.s[0] = s;
        q.s[1] = s;
        return q;
    }
    IQ_TYPE(IQ3_S, ACT_Q8_K)
};

// 8 g + delta of each byte of IQ1's ternary grid (g in -1..1 as int8, delta +-1): in -9..9, so
// the byte-wise adds never carry into the next byte's value.
__device__ __forceinline__ u32 iq1_word(u32 g, u32 d4) {
    g = __vadd4(g, g);
    g = __vadd4(g, g);
    g = __vadd4(g, g);
    return __vadd4(g, d4);
}

__device__ __forceinline__ void iq1_values(u64 g, int delta, u32* out) {
    u32 d4 = (u32)(delta & 0xff) * 0x01010101u;
    out[0] = iq1_word((u32)g, d4);
    out[1] = iq1_word((u32)(g >> 32), d4);
}

// IQ1_S (50 bytes): f16 d, 32 index bytes, per 32 values a u16 of four 3-bit index extensions,
// the 3-bit scale and the delta's sign. x = d (2 s + 1) (g + delta / 8).
struct IQ1_S {
    static __device__ __forceinline__ IqChunk decode(const u8* row, int c) {
        const u8* b = row + 50 * (c >> 3);
        int j = c & 7;
        u32 qh = iq_u16(b + 34 + 2 * j);
        int delta = (qh & 0x8000u) ? -1 : 1;
        IqChunk q;
#pragma unroll
        for (int l = 0; l < 4; l++) {
            u32 idx = (u32)LD(b + 2 + 4 * j + l) | (((qh >> (3 * l)) & 7u) << 8);
            iq1_values(IQ1S_GRID[idx], delta, q.v + 2 * l);
        }
        float s = h2f(LD((const u16*)b)) * (float)(2 * ((qh >> 12) & 7u) + 1) * 0.125f;
        q.s[0] = s;
        q.s[1] = s;
        return q;
    }
    IQ_TYPE(IQ1_S, ACT_Q8_K)
};

// IQ1_M (56 bytes): 32 index bytes, 16 bytes of nibbles (three index bits and the delta's sign
// per 8 values), 8 bytes of 3-bit scales per 16 whose top nibbles hold the f16 d.
struct IQ1_M {
    static __device__ __forceinline__ IqChunk decode(const u8* row, int c) {
        const u8* b = row + 56 * (c >> 3);
        int j = c & 7;
        u32 sc[4];
#pragma unroll
        for (int k = 0; k < 4; k++) sc[k] = iq_u16(b + 48 + 2 * k);
        u32 dbits = (sc[0] >> 12) | ((sc[1] >> 8) & 0x00f0u) | ((sc[2] >> 4) & 0x0f00u) | (sc[3] & 0xf000u);
        float d = h2f((u16)dbits) * 0.125f;
        IqChunk q;
#pragma unroll
        for (int l = 0; l < 4; l++) {
            u32 nib = (LD(b + 32 + 2 * j + (l >> 1)) >> (4 * (l & 1))) & 15u;
            u32 idx = (u32)LD(b + 4 * j + l) | ((nib & 7u) << 8);
            iq1_values(IQ1S_GRID[idx], (nib & 8u) ? -1 : 1, q.v + 2 * l);
        }
        u32 word = sc[j >> 1] >> (6 * (j & 1));
        q.s[0] = d * (float)(2 * (word & 7u) + 1);
        q.s[1] = d * (float)(2 * ((word >> 3) & 7u) + 1);
        return q;
    }
    IQ_TYPE(IQ1_M, ACT_Q8_K)
};

// IQ4_XS (136 bytes): f16 d, u16 of scale high bits, 4 bytes of scale low nibbles, then per 32
// values 16 bytes of codebook nibbles (IQ4_NL's). x = d (s - 32) kvalues[q].
struct IQ4_XS {
    static __device__ __forceinline__ IqChunk decode(const u8* row, int c) {
        const u32 t[4] = {0xbfad9881u, 0xf6eaddcfu, 0x26190d01u, 0x71594535u};
        const u8* b = row + 136 * (c >> 3);
        int j = c & 7;
        IqChunk q;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            u32 w = iq_u32(b + 8 + 16 * j + 4 * k);
            q.v[k] = lookup16(t, w & 0x0f0f0f0fu);
            q.v[k + 4] = lookup16(t, (w >> 4) & 0x0f0f0f0fu);
        }
        u32 sh = iq_u16(b + 2);
        int ls = (int)(((LD(b + 4 + (j >> 1)) >> (4 * (j & 1))) & 15u) | (((sh >> (2 * j)) & 3u) << 4)) - 32;
        float s = h2f(LD((const u16*)b)) * (float)ls;
        q.s[0] = s;
        q.s[1] = s;
        return q;
    }
    IQ_TYPE(IQ4_XS, ACT_Q8_K)
};

// ggml's trit n of a base-3 byte: (q 3^n wrapping to a byte) * 3 >> 8.
__device__ __forceinline__ u32 tq1_trit(u32 byte, int n) {
    const u32 pow3[5] = {1, 3, 9, 27, 81};
    return ((((byte * pow3[n]) & 0xffu) * 3u) >> 8);
}

// TQ1_0 (54 bytes): 48 bytes of five trits (elements 32 n + m of the first 160 from byte m, the
// next 80 as 16 n + m from byte 32 + m), 4 bytes of four trits (240 + 4 n + j), f16 d last.
struct TQ1_0 {
    static __device__ __forceinline__ IqChunk decode(const u8* row, int c) {
        const u8* b = row + 54 * (c >> 3);
        int j = c & 7;
        IqChunk q;
#pragma unroll
        for (int k = 0; k < 8; k++) {
            u32 w = 0;
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int i = 32 * j + 4 * k + e, t;
                if (i < 160) t = tq1_trit(LD(b + (i & 31)), i >> 5);
                else if (i < 240) t = tq1_trit(LD(b + 32 + ((i - 160) & 15)), (i - 160) >> 4);
                else t = tq1_trit(LD(b + 48 + ((i - 240) & 3)), (i - 240) >> 2);
                w |= ((u32)(t - 1) & 0xffu) << (8 * e);
            }
            q.v[k] = w;
        }
        float d = h2f(LD((const u16*)(b + 52)));
        q.s[0] = d;
        q.s[1] = d;
        return q;
    }
    IQ_TYPE(TQ1_0, ACT_Q8_K)
};

// TQ2_0 (66 bytes): element 128 h + 32 l + m in bits 2 l of byte 32 h + m; f16 d last.
struct TQ2_0 {
    static __device__ __forceinline__ IqChunk decode(const u8* row, int c) {
        const u8* b = row + 66 * (c >> 3);
        int j = c & 7, l = j & 3;
        IqChunk q;
#pragma unroll
        for (int k = 0; k < 8; k++) {
            u32 codes = (iq_u32(b + 32 * (j >> 2) + 4 * k) >> (2 * l)) & 0x03030303u;
            q.v[k] = __vsub4(codes, 0x01010101u);
        }
        float d = h2f(LD((const u16*)(b + 64)));
        q.s[0] = d;
        q.s[1] = d;
        return q;
    }
    IQ_TYPE(TQ2_0, ACT_Q8_K)
};

// Q1_0 (18 bytes / 128 values, four Q8_0 chunks): f16 d, then bit i set = +d, clear = -d.
struct Q1_0 {
    static __device__ __forceinline__ IqChunk decode(const u8* row, int c) {
        const u8* b = row + 18 * (c >> 2);
        u32 bits = iq_u32(b + 2 + 4 * (c & 3));
        IqChunk q;
#pragma unroll
        for (int k = 0; k < 8; k++) q.v[k] = 0xffffffffu ^ (iq_sign_mask4(bits >> (4 * k)) & 0xfefefefeu);
        float d = h2f(LD((const u16*)b));
        q.s[0] = d;
        q.s[1] = d;
        return q;
    }
    IQ_TYPE(Q1_0, ACT_Q8_0)
};

// Q2_0 (18 bytes / 64 values, two Q8_0 chunks): f16 d, element i in bits 2 (i % 4) of byte
// i / 4; x = (q - 1) d.
struct Q2_0 {
    static __device__ __forceinline__ IqChunk decode(const u8* row, int c) {
        const u8* b = row + 18 * (c >> 1);
        IqChunk q;
#pragma unroll
        for (int k = 0; k < 8; k++) {
            u32 x = LD(b + 2 + 8 * (c & 1) + k);
            u32 codes = (x & 3u) | (((x >> 2) & 3u) << 8) | (((x >> 4) & 3u) << 16) | ((x >> 6) << 24);
            q.v[k] = __vsub4(codes, 0x01010101u);
        }
        float d = h2f(LD((const u16*)b));
        q.s[0] = d;
        q.s[1] = d;
        return q;
    }
    IQ_TYPE(Q2_0, ACT_Q8_0)
};

// ggml's ggml_ue4m3_to_fp32: unsigned E4M3 (bias 7), halved for the doubled e2m1 values.
__device__ __forceinline__ float ue4m3_half(u32 x) {
    if (x == 0 || x == 0x7f) return 0.0f;
    int e = (x >> 3) & 15, m = x & 7;
    float raw = e == 0 ? ldexpf((float)m, -9) : ldexpf(1.0f + (float)m / 8.0f, e - 7);
    return raw * 0.5f;
}

// NVFP4 (36 bytes / 64 values, two Q8_0 chunks): four E4M3 scales, one per 16 values, then
// per 16 values 8 bytes of e2m1 nibbles (low nibbles the first 8).
struct NVFP4 {
    static __device__ __forceinline__ IqChunk decode(const u8* row, int c) {
        const u32 t[4] = {0x03020100u, 0x0c080604u, 0xfdfeff00u, 0xf4f8fafcu};
        const u8* b = row + 36 * (c >> 1);
        int h = c & 1;
        IqChunk q;
#pragma unroll
        for (int s = 0; s < 2; s++) {
            const u8* qs = b + 4 + 16 * h + 8 * s;
            u32 w0 = iq_u32(qs), w1 = iq_u32(qs + 4);
            q.v[4 * s + 0] = lookup16(t, w0 & 0x0f0f0f0fu);
            q.v[4 * s + 1] = lookup16(t, w1 & 0x0f0f0f0fu);
            q.v[4 * s + 2] = lookup16(t, (w0 >> 4) & 0x0f0f0f0fu);
            q.v[4 * s + 3] = lookup16(t, (w1 >> 4) & 0x0f0f0f0fu);
            q.s[s] = ue4m3_half(LD(b + 2 * h + s));
        }
        return q;
    }
    IQ_TYPE(NVFP4, ACT_Q8_0)
};

#undef IQ_TYPE
