// ferrolm's decode kernels, compiled by NVRTC at first use for the device's own architecture.
// No headers: half <-> float conversions are single PTX instructions.
//
// Every matrix is read in its GGUF block layout (Q8_0 and Q6_K rows regrouped into 16-byte
// words). The unit of work is a chunk of 32 consecutive values of a row: one block of
// Q8_0/Q4_0/Q4_1, one eighth of a Q4_K/Q6_K super-block, 32 halfs/floats. A decode product's
// block owns 4 rows; its threads take chunks blockDim apart and multiply each with the
// activations quantized as the CPU quantizes them (integer dot products), or with f32 ones for
// float rows; partial sums meet in shared memory (rows_dot). Rows of some types are copied into
// shared memory by the copy engine before the kernel waits for its input (STAGE); f16/bf16
// rows are read as 16-byte pieces, consecutive threads on consecutive pieces, each thread's
// copied into its own shared-memory slots by cp.async (piece_rows).

typedef unsigned char u8;
typedef signed char i8;
typedef signed char int8_t_;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define INFINITY __int_as_float(0x7f800000)
// Weights are read once per token: through the read-only path.
#define LD(p) __ldg(p)

__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// ---- programmatic dependent launch (sm_90 and later) ----
//
// The decode step's kernels are launched so that the next one may be scheduled while this one
// still runs (the host sets the launch attribute). Each kernel waits at step_begin for its
// predecessor to finish and its writes to be visible, then lets its successor start: the
// successor's launch, and its prefetch of the weights it will read (which no kernel writes),
// overlap this kernel's work. Without the attribute, the wait returns at once.
__device__ __forceinline__ void step_begin() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Asks for [p, p + bytes) in L2 (the whole 16-byte words inside it), one instruction.
__device__ __forceinline__ void prefetch_l2(const void* p, size_t bytes) {
#if __CUDA_ARCH__ >= 900
    size_t a = (size_t)p, s = (a + 15) & ~(size_t)15, e = (a + bytes) & ~(size_t)15;
    if (e > s)
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(s), "r"((u32)(e - s))
                     : "memory");
#endif
}

// ---- rows staged in shared memory by the copy engine (sm_90: cp.async.bulk) ----

__device__ __forceinline__ u32 smem_addr(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}

// 16 bytes of shared memory (volatile: kept after the barrier wait that guards them).
__device__ __forceinline__ uint4 lds16(const void* p) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(smem_addr(p)));
    return v;
}

__device__ __forceinline__ u16 lds_u16(const void* p) {
    u16 v;
    asm volatile("ld.shared.u16 %0, [%1];" : "=h"(v) : "r"(smem_addr(p)));
    return v;
}

// 16 bytes / 2 bytes / 4 bytes from a 2-byte-aligned address, from shared memory (S) or
// through the read-only path.
template <bool S>
__device__ __forceinline__ uint4 ld16(const void* p) {
    if constexpr (S) return lds16(p);
    return LD((const uint4*)p);
}
template <bool S>
__device__ __forceinline__ u16 ld2(const void* p) {
    if constexpr (S) return lds_u16(p);
    return LD((const u16*)p);
}
template <bool S>
__device__ __forceinline__ u32 ld2x2(const u8* p) {
    return (u32)ld2<S>(p) | ((u32)ld2<S>(p + 2) << 16);
}

// One thread: a barrier in shared memory that completes once `bytes` have arrived, and the
// copies of `n` rows of `row_bytes` (16-byte multiples, 16-byte aligned) into dst, row after
// row; rows[r] null: not copied. Before the copies every thread must see the initialised
// barrier (the caller's __syncthreads).
__device__ __forceinline__ void stage_init(u64* bar) {
#if __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bar)) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void stage_rows(u8* dst, const u8* const* rows, int row_bytes,
                                           u64* bar) {
#if __CUDA_ARCH__ >= 900
    u32 bytes = 0;
#pragma unroll
    for (int r = 0; r < N; r++)
        if (rows[r]) bytes += row_bytes;
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)),
                 "r"(bytes)
                 : "memory");
#pragma unroll
    for (int r = 0; r < N; r++)
        if (rows[r])
            asm volatile(
                "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], "
                "%2, [%3];" ::"r"(smem_addr(dst + r * row_bytes)),
                "l"(rows[r]), "r"(row_bytes), "r"(smem_addr(bar))
                : "memory");
#endif
}
// Every thread: waits until the staged rows are in.
__device__ __forceinline__ void stage_wait(u64* bar) {
#if __CUDA_ARCH__ >= 900
    u32 done = 0;
    while (!done)
        asm volatile(
            "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0; "
            "selp.u32 %0, 1, 0, p; }"
            : "=r"(done)
            : "r"(smem_addr(bar))
            : "memory");
#endif
}

// ---- activations quantized as the CPU quantizes them ----
//
// The CPU dots each weight row with the activations rounded to its row type's partner format
// (llama.cpp's `vec_dot_type`): Q8_0 (or Q8_1) per 32 values, Q8_K per 256, f16, bf16 or f32.
// The decode products do the same, with integer dot products, so that both backends round the
// same numbers the same way.
#define ACT_F32 0
#define ACT_F16 1
#define ACT_BF16 2
#define ACT_Q8_0 3
#define ACT_Q8_1 4
#define ACT_Q8_K 5

// One chunk of 32 activations, quantized: q (four int8 to a word), the scale d, Q8_1's stored
// d * sum(q) (as f16), and the sums of q over each half (Q8_K's bsums).
struct Act {
    int q[8];
    float d;
    float s;
    int sum[2];
};

// Four bytes from a 2-byte-aligned address.
__device__ __forceinline__ u32 ld_u16x2(const u8* p) {
    const u16* h = (const u16*)p;
    return (u32)LD(h) | ((u32)LD(h + 1) << 16);
}

// Bits 0..4 of b moved to bit 4 of bytes 0..4 (Q5's fifth bits).
__device__ __forceinline__ u32 bit4_of_bytes(u32 b) {
    return ((b & 1u) << 4) | ((b & 2u) << 11) | ((b & 4u) << 18) | ((b & 8u) << 25);
}

// Each byte of idx (0..15) replaced by entry idx of the 16-byte table t.
__device__ __forceinline__ u32 lookup16(const u32* t, u32 idx) {
    u32 sel = (idx & 0x7u) | ((idx >> 4) & 0x70u) | ((idx >> 8) & 0x700u) | ((idx >> 12) & 0x7000u);
    u32 lo = __byte_perm(t[0], t[1], sel), hi = __byte_perm(t[2], t[3], sel);
    u32 upper = ((idx >> 3) & 0x01010101u) * 0xffu;
    return (lo & ~upper) | (hi & upper);
}

// The integer dot of a chunk's 16 bytes of nibbles (word k: the low nibbles are values 4k..4k+4,
// the high ones 16+4k..) with its activations: Q4's as they are, Q5's with the fifth bits of qh
// (bit j for value j) at bit 4.
__device__ __forceinline__ int nibble_dot(const u32* q, u32 qh, const Act& a) {
    int s = 0;
#pragma unroll
    for (int k = 0; k < 4; k++) {
        s = __dp4a((int)((q[k] & 0x0f0f0f0fu) | bit4_of_bytes(qh >> (4 * k))), a.q[k], s);
        s = __dp4a((int)(((q[k] >> 4) & 0x0f0f0f0fu) | bit4_of_bytes(qh >> (16 + 4 * k))),
                   a.q[k + 4], s);
    }
    return s;
}

// The same with each nibble an index into the 16 int8 values of t (IQ4_NL, MXFP4).
__device__ __forceinline__ int codebook_dot(const u32* q, const u32* t, const Act& a) {
    int s = 0;
#pragma unroll
    for (int k = 0; k < 4; k++) {
        s = __dp4a((int)lookup16(t, q[k] & 0x0f0f0f0fu), a.q[k], s);
        s = __dp4a((int)lookup16(t, (q[k] >> 4) & 0x0f0f0f0fu), a.q[k + 4], s);
    }
    return s;
}

__device__ __forceinline__ float round_bf16(float x) {
    u32 u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return __uint_as_float((u | 0x00400000u) & 0xffff0000u);
    return __uint_as_float((u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u);
}

__device__ __forceinline__ void act_sums(Act& a) {
    a.sum[0] = 0;
    a.sum[1] = 0;
#pragma unroll
    for (int k = 0; k < 8; k++) a.sum[k >> 2] = __dp4a(a.q[k], 0x01010101, a.sum[k >> 2]);
}

// Quantized activations in device memory ("XQ", for n values): the n int8 values, then n / 32
// float scales, then n / 32 floats of Q8_1's d * sum(q) (0 for the other formats; Q8_K's scale
// is repeated for each of its 8 chunks).
__device__ __forceinline__ void load_act(const u8* xq, int n_chunks, int c, Act& a) {
    const uint4* p = (const uint4*)(xq + 32 * (size_t)c);
    uint4 v0 = p[0], v1 = p[1];
    a.q[0] = v0.x; a.q[1] = v0.y; a.q[2] = v0.z; a.q[3] = v0.w;
    a.q[4] = v1.x; a.q[5] = v1.y; a.q[6] = v1.z; a.q[7] = v1.w;
    const float* ds = (const float*)(xq + 32 * (size_t)n_chunks);
    a.d = ds[c];
    a.s = ds[n_chunks + c];
    act_sums(a);
}

// Q8_K's scale comes from the first value of the largest magnitude of its 256: amax and that
// value (max) over the N values v of this thread (numbered base + i) and those of the lanes
// lane ^ o, o < SPAN (a power of two; `mask` their lanes). The winner is the same in any order
// of merging: largest magnitude, then lowest number.
template <int N, int SPAN>
__device__ __forceinline__ void first_largest(const float* v, int base, u32 mask, float& amax,
                                              float& max) {
    amax = 0.f;
    max = 0.f;
    int first = 0x7fffffff;
#pragma unroll
    for (int i = 0; i < N; i++) {
        if (fabsf(v[i]) > amax) {
            amax = fabsf(v[i]);
            max = v[i];
            first = base + i;
        }
    }
#pragma unroll
    for (int o = SPAN / 2; o > 0; o >>= 1) {
        float am2 = __shfl_xor_sync(mask, amax, o);
        float mx2 = __shfl_xor_sync(mask, max, o);
        int f2 = __shfl_xor_sync(mask, first, o);
        if (am2 > amax || (am2 == amax && f2 < first)) {
            amax = am2;
            max = mx2;
            first = f2;
        }
    }
}

// Chunk c of the f32 activations x quantized in registers as quantize_group quantizes it, for
// a product that reads x as it is (no quantize_act launch). Q8_K's scale spans 8 chunks: the 8
// lanes 8m..8m+7 holding them (all present: rows of whole 256-value groups) share it.
template <int MODE>
__device__ __forceinline__ void quantize_chunk(const float* x, int c, Act& a) {
    float v[32];
    const float4* xv = (const float4*)(x + 32 * (size_t)c);
#pragma unroll
    for (int i = 0; i < 8; i++) {
        float4 f = xv[i];
        v[4 * i] = f.x; v[4 * i + 1] = f.y; v[4 * i + 2] = f.z; v[4 * i + 3] = f.w;
    }
    int q[32];
    if (MODE == ACT_Q8_K) {
        float amax, max;
        first_largest<32, 8>(v, 32 * c, 0xffu << (threadIdx.x & 24), amax, max);
        float iscale = amax != 0.f ? -127.f / max : 0.f;
#pragma unroll
        for (int i = 0; i < 32; i++) q[i] = min(127, __float2int_rn(iscale * v[i]));
        a.d = amax != 0.f ? 1.f / iscale : 0.f;
        a.s = 0.f;
    } else {
        float amax = 0.f;
#pragma unroll
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(v[i]));
        float dd = amax / 127.f;
        float id = amax != 0.f ? 127.f / amax : 0.f;
        int sum = 0;
#pragma unroll
        for (int i = 0; i < 32; i++) {
            q[i] = __float2int_rn(v[i] * id);
            sum += q[i];
        }
        a.d = h2f(f2h(dd));
        a.s = MODE == ACT_Q8_1 ? h2f(f2h((float)sum * dd)) : 0.f;
    }
#pragma unroll
    for (int k = 0; k < 8; k++)
        a.q[k] = (q[4 * k] & 0xff) | ((q[4 * k + 1] & 0xff) << 8) | ((q[4 * k + 2] & 0xff) << 16) |
                 ((u32)q[4 * k + 3] << 24);
    act_sums(a);
}

// One warp quantizes group g (values 256g..256g+256 of n) into xq as the CPU would for `mode`;
// lane l holds values 8l..8l+8 of the group in v (zeros past n). Q8_0 / Q8_1 as x86-64
// llama.cpp rounds them (scale amax / 127 stored as f16, values x * (127 / amax) rounded half
// to even; Q8_1's d * sum as f16); Q8_K: the first value of the largest magnitude sets the
// scale -127 / max, values rounded half to even and capped at 127.
__device__ void quantize_group(const float* v, u8* xq, int n, int g, int mode) {
    int lane = threadIdx.x & 31, n_chunks = n / 32;
    int chunk = 8 * g + (lane >> 2);
    int q[8];
    float d, s = 0.f;
    if (mode == ACT_Q8_K) {
        float amax, max;
        first_largest<8, 32>(v, 8 * lane, 0xffffffffu, amax, max);
        float iscale = amax != 0.f ? -127.f / max : 0.f;
#pragma unroll
        for (int i = 0; i < 8; i++) q[i] = min(127, __float2int_rn(iscale * v[i]));
        d = amax != 0.f ? 1.f / iscale : 0.f;
    } else {
        float amax = 0.f;
#pragma unroll
        for (int i = 0; i < 8; i++) amax = fmaxf(amax, fabsf(v[i]));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
        float dd = amax / 127.f;
        float id = amax != 0.f ? 127.f / amax : 0.f;
        int sum = 0;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            q[i] = __float2int_rn(v[i] * id);
            sum += q[i];
        }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        d = h2f(f2h(dd));
        if (mode == ACT_Q8_1) s = h2f(f2h((float)sum * dd));
    }
    if (chunk >= n_chunks) return;
    uint2 packed;
    packed.x = (q[0] & 0xff) | ((q[1] & 0xff) << 8) | ((q[2] & 0xff) << 16) | ((u32)q[3] << 24);
    packed.y = (q[4] & 0xff) | ((q[5] & 0xff) << 8) | ((q[6] & 0xff) << 16) | ((u32)q[7] << 24);
    *(uint2*)(xq + 256 * (size_t)g + 8 * lane) = packed;
    if ((lane & 3) == 0) {
        float* ds = (float*)(xq + n);
        ds[chunk] = d;
        ds[n_chunks + chunk] = s;
    }
}

// Value v of element e of a row of n values into xq as quantize_group writes its 32-value
// chunk (ACT_Q8_0 or ACT_Q8_1), by a warp whose lanes hold the chunk's 32 elements in order:
// the kernels that write a row a warp per 32 consecutive values quantize it for the next
// product themselves (no quantize_act launch).
__device__ __forceinline__ void quantize_lane(float v, int e, u8* xq, int n, int mode) {
    float amax = warp_max(fabsf(v));
    float dd = amax / 127.f;
    float id = amax != 0.f ? 127.f / amax : 0.f;
    int q = __float2int_rn(v * id);
    int sum = q;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    xq[e] = (u8)(q & 0xff);
    if ((e & 31) == 0) {
        float* ds = (float*)(xq + n);
        ds[e / 32] = h2f(f2h(dd));
        ds[n / 32 + e / 32] = mode == ACT_Q8_1 ? h2f(f2h((float)sum * dd)) : 0.f;
    }
}

// xq = x (n values) quantized for `mode`: a warp per group of 256.
extern "C" __global__ void quantize_act(const float* x, u8* xq, int n, int mode) {
    step_begin();
    int g = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (256 * g >= n) return;
    float v[8];
#pragma unroll
    for (int i = 0; i < 8; i++) {
        int j = 256 * g + 8 * lane + i;
        v[i] = j < n ? x[j] : 0.f;
    }
    quantize_group(v, xq, n, g, mode);
}

// Each row of x (f16 or f32, n values; a batched step's norms or activations) quantized as
// quantize_act quantizes it, row t into xq + t * (n + 8 * (n / 32)): grid (groups / 8, rows).
template <typename T>
__device__ __forceinline__ float row_value(const T* row, int j) {
    if constexpr (sizeof(T) == 2)
        return h2f(row[j]);
    else
        return row[j];
}
template <typename T>
__device__ __forceinline__ void quantize_row_groups(const T* x, u8* xq, int n, int mode) {
    int g = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (256 * g >= n) return;
    const T* xr = x + (size_t)blockIdx.y * n;
    float v[8];
#pragma unroll
    for (int i = 0; i < 8; i++) {
        int j = 256 * g + 8 * lane + i;
        v[i] = j < n ? row_value(xr, j) : 0.f;
    }
    quantize_group(v, xq + (size_t)blockIdx.y * (n + 8 * (n / 32)), n, g, mode);
}

extern "C" __global__ void quantize_rows_f16(const u16* x, u8* xq, int n, int mode) {
    step_begin();
    quantize_row_groups(x, xq, n, mode);
}

extern "C" __global__ void quantize_rows_f32(const float* x, u8* xq, int n, int mode) {
    step_begin();
    quantize_row_groups(x, xq, n, mode);
}

// ---- chunk dequantizers: w[0..32) = the values of chunk c of a row ----

struct F32 {
    static __device__ __forceinline__ void load(const u8* row, int c, int nc, float* w) {
        const float4* p = (const float4*)(row + 128 * c);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            float4 v = LD(p + i);
            w[4 * i] = v.x; w[4 * i + 1] = v.y; w[4 * i + 2] = v.z; w[4 * i + 3] = v.w;
        }
    }
    static constexpr int ACT = ACT_F32;
};

// 16-bit float rows are also read as 16-byte pieces of 8 values (`unpack8`), consecutive
// threads on consecutive pieces (rows_dot).
struct F16 {
    static __device__ __forceinline__ void unpack8(uint4 v, float* w) {
        u32 a[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 4; j++) {
            w[2 * j] = h2f((u16)(a[j] & 0xffff));
            w[2 * j + 1] = h2f((u16)(a[j] >> 16));
        }
    }
    static __device__ __forceinline__ void load(const u8* row, int c, int nc, float* w) {
        const uint4* p = (const uint4*)(row + 64 * c);
#pragma unroll
        for (int i = 0; i < 4; i++) unpack8(LD(p + i), w + 8 * i);
    }
    // The CPU rounds activations to f16 for F16 rows.
    static constexpr int ACT = ACT_F16;
};

// Q8_0: f16 scale, 32 int8 (34 bytes, 2-byte aligned).
struct Q8_0 {
    static __device__ __forceinline__ void load(const u8* row, int c, int nc, float* w) {
        const u16* p = (const u16*)(row + 34 * c);
        float d = h2f(LD(p));
#pragma unroll
        for (int i = 0; i < 16; i++) {
            u16 q = LD(p + 1 + i);
            w[2 * i] = d * (float)(i8)(q & 0xff);
            w[2 * i + 1] = d * (float)(i8)(q >> 8);
        }
    }
    static constexpr int ACT = ACT_Q8_0;
    static __device__ __forceinline__ float dot(const u8* row, int c, int nc, const Act& a) {
        const u8* b = row + 34 * c;
        float d = h2f(LD((const u16*)b));
        int s = 0;
#pragma unroll
        for (int k = 0; k < 8; k++) s = __dp4a((int)ld_u16x2(b + 2 + 4 * k), a.q[k], s);
        return d * a.d * (float)s;
    }
};

// Q4_0: f16 scale, 16 bytes of nibbles (low: values 0..16, high: 16..32), offset 8.
struct Q4_0 {
    static __device__ __forceinline__ void load(const u8* row, int c, int nc, float* w) {
        const u16* p = (const u16*)(row + 18 * c);
        float d = h2f(LD(p));
#pragma unroll
        for (int i = 0; i < 8; i++) {
            u16 q = LD(p + 1 + i);
            u32 b0 = q & 0xff, b1 = q >> 8;
            w[2 * i] = d * (float)((int)(b0 & 15) - 8);
            w[2 * i + 1] = d * (float)((int)(b1 & 15) - 8);
            w[2 * i + 16] = d * (float)((int)(b0 >> 4) - 8);
            w[2 * i + 17] = d * (float)((int)(b1 >> 4) - 8);
        }
    }
    static constexpr int ACT = ACT_Q8_0;
    static __device__ __forceinline__ float dot(const u8* row, int c, int nc, const Act& a) {
        return dot_raw(fetch(row, c, nc), c, a);
    }
    // The split; from global memory the products call `dot` row by row (fetching every row's
    // words first was slower), staged ones fetch first.
    static constexpr bool FETCH_GLOBAL = false;
    struct Raw {
        u16 d;
        u32 q[4];
    };
    template <bool SHARED = false>
    static __device__ __forceinline__ Raw fetch(const u8* row, int c, int nc) {
        const u8* b = row + 18 * c;
        Raw w;
        w.d = ld2<SHARED>(b);
#pragma unroll
        for (int k = 0; k < 4; k++) w.q[k] = ld2x2<SHARED>(b + 2 + 4 * k);
        return w;
    }
    static __device__ __forceinline__ float dot_raw(const Raw& w, int c, const Act& a) {
        return h2f(w.d) * a.d * (float)(nibble_dot(w.q, 0, a) - 8 * (a.sum[0] + a.sum[1]));
    }
};

// Q4_1: f16 scale, f16 minimum, 16 bytes of nibbles (20 bytes, 4-byte aligned).
struct Q4_1 {
    static __device__ __forceinline__ void load(const u8* row, int c, int nc, float* w) {
        const u8* b = row + 20 * c;
        u32 dm = LD((const u32*)b);
        float d = h2f((u16)(dm & 0xffff)), m = h2f((u16)(dm >> 16));
        const u32* p = (const u32*)(b + 4);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            u32 q = LD(p + i);
#pragma unroll
            for (int j = 0; j < 4; j++) {
                u32 byte = (q >> (8 * j)) & 0xff;
                w[4 * i + j] = d * (float)(byte & 15) + m;
                w[4 * i + j + 16] = d * (float)(byte >> 4) + m;
            }
        }
    }
    static constexpr int ACT = ACT_Q8_1;
    static __device__ __forceinline__ float dot(const u8* row, int c, int nc, const Act& a) {
        const u8* b = row + 20 * c;
        u32 dm = LD((const u32*)b);
        float d = h2f((u16)(dm & 0xffff)), m = h2f((u16)(dm >> 16));
        u32 q[4];
#pragma unroll
        for (int k = 0; k < 4; k++) q[k] = LD((const u32*)(b + 4) + k);
        return d * a.d * (float)nibble_dot(q, 0, a) + m * a.s;
    }
};

// Q5_0: f16 scale, 32 high bits, 16 bytes of low nibbles (values 0..16 low, 16..32 high),
// offset 16 (22 bytes, 2-byte aligned).
struct Q5_0 {
    static __device__ __forceinline__ void load(const u8* row, int c, int nc, float* w) {
        const u16* p = (const u16*)(row + 22 * c);
        float d = h2f(LD(p));
        u32 qh = (u32)LD(p + 1) | ((u32)LD(p + 2) << 16);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            u16 q = LD(p + 3 + i);
#pragma unroll
            for (int e = 0; e < 2; e++) {
                int j = 2 * i + e;
                u32 b = (q >> (8 * e)) & 0xff;
                w[j] = d * (float)((int)((b & 15) | (((qh >> j) & 1) << 4)) - 16);
                w[j + 16] = d * (float)((int)((b >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16);
            }
        }
    }
    static constexpr int ACT = ACT_Q8_0;
    static __device__ __forceinline__ float dot(const u8* row, int c, int nc, const Act& a) {
        const u8* b = row + 22 * c;
        float d = h2f(LD((const u16*)b));
        u32 qh = ld_u16x2(b + 2), q[4];
#pragma unroll
        for (int k = 0; k < 4; k++) q[k] = ld_u16x2(b + 6 + 4 * k);
        return d * a.d * (float)(nibble_dot(q, qh, a) - 16 * (a.sum[0] + a.sum[1]));
    }
};

// Q5_1: f16 scale, f16 minimum, 32 high bits, 16 bytes of low nibbles (24 bytes, 4-byte
// aligned).
struct Q5_1 {
    static __device__ __forceinline__ void load(const u8* row, int c, int nc, float* w) {
        const u8* b = row + 24 * c;
        u32 dm = LD((const u32*)b);
        float d = h2f((u16)(dm & 0xffff)), m = h2f((u16)(dm >> 16));
        u32 qh = LD((const u32*)(b + 4));
        const u32* p = (const u32*)(b + 8);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            u32 q = LD(p + i);
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int j = 4 * i + e;
                u32 byte = (q >> (8 * e)) & 0xff;
                w[j] = d * (float)((byte & 15) | (((qh >> j) & 1) << 4)) + m;
                w[j + 16] = d * (float)((byte >> 4) | (((qh >> (j + 16)) & 1) << 4)) + m;
            }
        }
    }
    static constexpr int ACT = ACT_Q8_1;
    static __device__ __forceinline__ float dot(const u8* row, int c, int nc, const Act& a) {
        const u8* b = row + 24 * c;
        u32 dm = LD((const u32*)b);
        float d = h2f((u16)(dm & 0xffff)), m = h2f((u16)(dm >> 16));
        u32 qh = LD((const u32*)(b + 4)), q[4];
#pragma unroll
        for (int k = 0; k < 4; k++) q[k] = LD((const u32*)(b + 8) + k);
        return d * a.d * (float)nibble_dot(q, qh, a) + m * a.s;
    }
};

// p ? a : b as one instruction: the compiler may make a branch of `?:`, and a branch splits the
// code the scheduler can move loads across.
__device__ __forceinline__ int select(bool p, int a, int b) {
    int r;
    asm("{ .reg .pred q; setp.ne.u32 q, %3, 0; selp.b32 %0, %1, %2, q; }"
        : "=r"(r)
        : "r"(a), "r"(b), "r"((u32)p));
    return r;
}

// Scale and minimum of sub-block j of Q4_K/Q5_K's 12 bytes of packed 6-bit fields at s.
__device__ __forceinline__ void scale_min_k4(const u8* s, int j, int* sc, int* mn) {
    if (j < 4) {
        *sc = LD(s + j) & 63;
        *mn = LD(s + j + 4) & 63;
    } else {
        *sc = (LD(s + j + 4) & 15) | ((LD(s + j - 4) >> 6) << 4);
        *mn = (LD(s + j + 4) >> 4) | ((LD(s + j) >> 6) << 4);
    }
}

// Scale and minimum of sub-block j of a Q4_K/Q5_K super-block from its first 16 bytes, read as
// one word h (d, dmin, then the 12 bytes of 6-bit fields in h.y, h.z, h.w): no byte loads, and
// selects rather than branches (a branch here kept the compiler from issuing the next rows'
// loads before this row's arithmetic).
__device__ __forceinline__ void scale_min_k4_words(uint4 h, int j, int* sc, int* mn) {
    // bytes j % 4, 4 + j % 4 and 8 + j % 4 of the 12
    int sh = 8 * (j & 3);
    int a = (int)((h.y >> sh) & 0xff), b = (int)((h.z >> sh) & 0xff),
        c = (int)((h.w >> sh) & 0xff);
    bool hi = j >= 4;
    *sc = select(hi, (c & 15) | ((a >> 6) << 4), a & 63);
    *mn = select(hi, (c >> 4) | ((b >> 6) << 4), b & 63);
}

// What a Q4_K / Q5_K product needs of chunk j's super-block b besides its quants: d, dmin and
// the chunk's scale and minimum, from the first 16 bytes read as one word.
struct KHead {
    float d, dmin;
    int sc, mn;
    __device__ __forceinline__ KHead(const u8* b, int j) : KHead(LD((const uint4*)b), j) {}
    __device__ __forceinline__ KHead(uint4 head, int j) {
        d = h2f((u16)(head.x & 0xffff));
        dmin = h2f((u16)(head.x >> 16));
        scale_min_k4_words(head, j, &sc, &mn);
    }
    // The chunk's product from the integer sum s of its quants times the activations'.
    __device__ __forceinline__ float product(const Act& a, int s) const {
        return a.d * (d * (float)(sc * s) - dmin * (float)(mn * (a.sum[0] + a.sum[1])));
    }
};

// BF16: the high half of an f32.
struct BF16 {
    static __device__ __forceinline__ void unpack8(uint4 v, float* w) {
        u32 a[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 4; j++) {
            w[2 * j] = __uint_as_float(a[j] << 16);
            w[2 * j + 1] = __uint_as_float(a[j] & 0xffff0000u);
        }
    }
    static __device__ __forceinline__ void load(const u8* row, int c, int nc, float* w) {
        const uint4* p = (const uint4*)(row + 64 * c);
#pragma unroll
        for (int i = 0; i < 4; i++) unpack8(LD(p + i), w + 8 * i);
    }
    // The CPU rounds activations to bf16 for BF16 rows.
    static constexpr int ACT = ACT_BF16;
};

// IQ4_NL: f16 scale, 16 bytes of nibbles indexing a fixed codebook (18 bytes).
struct IQ4_NL {
    static __device__ __forceinline__ void load(const u8* row, int c, int nc, float* w) {
        const int8_t_ kv[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                1,    13,   25,  38,  53,  69,  89,  113};
        const u16* p = (const u16*)(row + 18 * c);
        float d = h2f(LD(p));
#pragma unroll
        for (int i = 0; i < 8; i++) {
            u16 q = LD(p + 1 + i);
#pragma unroll
            for (int e = 0; e < 2; e++) {
                u32 b = (q >> (8 * e)) & 0xff;
                w[2 * i + e] = d * (float)kv[b & 15];
                w[2 * i + e + 16] = d * (float)kv[b >> 4];
            }
        }
    }
    static constexpr int ACT = ACT_Q8_0;
    static __device__ __forceinline__ float dot(const u8* row, int c, int nc, const Act& a) {
        // The codebook's 16 int8 values, four to a word.
        const u32 t[4] = {0xbfad9881u, 0xf6eaddcfu, 0x26190d01u, 0x71594535u};
        const u8* b = row + 18 * c;
        float d = h2f(LD((const u16*)b));
        u32 q[4];
#pragma unroll
        for (int k = 0; k < 4; k++) q[k] = ld_u16x2(b + 2 + 4 * k);
        return d * a.d * (float)codebook_dot(q, t, a);
    }
};

// MXFP4: an e8m0 scale byte, 16 bytes of e2m1 nibbles (17 bytes, unaligned). The values are
// doubled integers and the scale halved, as the CPU does.
struct MXFP4 {
    static __device__ __forceinline__ void load(const u8* row, int c, int nc, float* w) {
        const int8_t_ kv[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
        const u8* b = row + 17 * c;
        u32 e = LD(b);
        float d = __uint_as_float(e < 2 ? (0x00200000u << e) : ((e - 1) << 23));
#pragma unroll
        for (int i = 0; i < 16; i++) {
            u32 q = LD(b + 1 + i);
            w[i] = d * (float)kv[q & 15];
            w[i + 16] = d * (float)kv[q >> 4];
        }
    }
    static constexpr int ACT = ACT_Q8_0;
    static __device__ __forceinline__ float dot(const u8* row, int c, int nc, const Act& a) {
        // The doubled e2m1 values, four to a word.
        const u32 t[4] = {0x03020100u, 0x0c080604u, 0xfdfeff00u, 0xf4f8fafcu};
        const u8* b = row + 17 * c;
        u32 e = LD(b);
        float d = __uint_as_float(e < 2 ? (0x00200000u << e) : ((e - 1) << 23));
        u32 q[4];
#pragma unroll
        for (int k = 0; k < 4; k++)
            q[k] = (u32)LD(b + 1 + 4 * k) | ((u32)LD(b + 2 + 4 * k) << 8) |
                   ((u32)LD(b + 3 + 4 * k) << 16) | ((u32)LD(b + 4 + 4 * k) << 24);
        return d * a.d * (float)codebook_dot(q, t, a);
    }
};

// Q2_K: 256 values: 16 scale bytes (low nibble scale, high nibble minimum), 64 bytes of 2-bit
// quants, f16 d, f16 dmin (84 bytes). Chunk j: quant l is bits 2(j%4).. of qs[32(j/4) + l];
// sub-blocks of 16 take scale byte 2j + l/16.
struct Q2_K {
    static __device__ __forceinline__ void load(const u8* row, int c, int nc, float* w) {
        const u8* b = row + 84 * (c >> 3);
        int j = c & 7;
        u32 dd = (u32)LD((const u16*)(b + 80)) | ((u32)LD((const u16*)(b + 82)) << 16);
        float d = h2f((u16)(dd & 0xffff)), dmin = h2f((u16)(dd >> 16));
        int shift = 2 * (j & 3);
        const u8* q = b + 16 + 32 * (j >> 2);
#pragma unroll
        for (int h = 0; h < 2; h++) {
            u32 sc = LD(b + 2 * j + h);
            float dl = d * (float)(sc & 15), ml = dmin * (float)(sc >> 4);
#pragma unroll
            for (int l = 0; l < 16; l++) w[16 * h + l] = dl * (float)((LD(q + 16 * h + l) >> shift) & 3) - ml;
        }
    }
    static constexpr int ACT = ACT_Q8_K;
    static __device__ __forceinline__ float dot(const u8* row, int c, int nc, const Act& a) {
        const u8* b = row + 84 * (c >> 3);
        int j = c & 7, shift = 2 * (j & 3);
        u32 dd = LD((const u32*)(b + 80));
        float d = h2f((u16)(dd & 0xffff)), dmin = h2f((u16)(dd >> 16));
        const u32* q = (const u32*)(b + 16 + 32 * (j >> 2));
        int s[2] = {0, 0};
#pragma unroll
        for (int k = 0; k < 8; k++)
            s[k >> 2] = __dp4a((int)((LD(q + k) >> shift) & 0x03030303u), a.q[k], s[k >> 2]);
        u32 sc01 = LD((const u16*)(b + 2 * j)), sc0 = sc01 & 0xff, sc1 = sc01 >> 8;
        int sum = (int)(sc0 & 15) * s[0] + (int)(sc1 & 15) * s[1];
        int mins = (int)(sc0 >> 4) * a.sum[0] + (int)(sc1 >> 4) * a.sum[1];
        return a.d * (d * (float)sum - dmin * (float)mins);
    }
};

// Q3_K: 256 values: 32 bytes of high-bit masks, 64 bytes of 2-bit quants, 12 bytes of 6-bit
// scales, f16 d (110 bytes). Chunk j: quant l is bits 2(j%4).. of qs[32(j/4) + l], less 4
// when bit 4(j/4) + j%4 of hmask[l] is clear; sub-block g = 2j + l/16 has the signed scale
// (low 4 bits of s[g%8] >> 4(g/8), high 2 bits of s[8 + g%4] >> 2(g/4)) - 32.
struct Q3_K {
    static __device__ __forceinline__ void load(const u8* row, int c, int nc, float* w) {
        const u8* b = row + 110 * (c >> 3);
        int j = c & 7;
        float d = h2f(LD((const u16*)(b + 108)));
        int shift = 2 * (j & 3);
        u32 m = 1u << (4 * (j >> 2) + (j & 3));
        const u8* q = b + 32 + 32 * (j >> 2);
        const u8* s = b + 96;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int g = 2 * j + h;
            int sc = (int)(((LD(s + (g & 7)) >> (4 * (g >> 3))) & 15) |
                           (((LD(s + 8 + (g & 3)) >> (2 * (g >> 2))) & 3) << 4)) - 32;
            float dl = d * (float)sc;
#pragma unroll
            for (int l = 0; l < 16; l++) {
                int low = (LD(q + 16 * h + l) >> shift) & 3;
                int sub = (LD(b + 16 * h + l) & m) ? 0 : 4;
                w[16 * h + l] = dl * (float)(low - sub);
            }
        }
    }
    static constexpr int ACT = ACT_Q8_K;
    static __device__ __forceinline__ float dot(const u8* row, int c, int nc, const Act& a) {
        const u8* b = row + 110 * (c >> 3);
        int j = c & 7, shift = 2 * (j & 3), bit = 4 * (j >> 2) + (j & 3);
        float d = h2f(LD((const u16*)(b + 108)));
        const u8* q = b + 32 + 32 * (j >> 2);
        const u8* s = b + 96;
        int sum = 0;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int part = 0;
#pragma unroll
            for (int k = 4 * h; k < 4 * h + 4; k++) {
                u32 low = (ld_u16x2(q + 4 * k) >> shift) & 0x03030303u;
                u32 high = ((ld_u16x2(b + 4 * k) >> bit) & 0x01010101u) << 2;
                part = __dp4a((int)(low | high), a.q[k], part);
            }
            int g = 2 * j + h;
            int sc = (int)(((LD(s + (g & 7)) >> (4 * (g >> 3))) & 15) |
                           (((LD(s + 8 + (g & 3)) >> (2 * (g >> 2))) & 3) << 4)) - 32;
            sum += sc * (part - 4 * a.sum[h]);
        }
        return a.d * d * (float)sum;
    }
};

// Q5_K: Q4_K's layout with 32 bytes of fifth bits after the scales (176 bytes): chunk j's
// quant l is its nibble of qs[32(j/2) + l] with bit j of qh[l] as the fifth.
struct Q5_K {
    static __device__ __forceinline__ void load(const u8* row, int c, int nc, float* w) {
        const u8* b = row + 176 * (c >> 3);
        int j = c & 7;
        u32 dd = LD((const u32*)b);
        float d = h2f((u16)(dd & 0xffff)), dmin = h2f((u16)(dd >> 16));
        int sc, mn;
        scale_min_k4(b + 4, j, &sc, &mn);
        float ds = d * (float)sc, dm = dmin * (float)mn;
        const u8* qh = b + 16;
        const u8* q = b + 48 + 32 * (j >> 1);
        int shift = (j & 1) * 4;
#pragma unroll
        for (int l = 0; l < 32; l++) {
            int v = ((LD(q + l) >> shift) & 15) | (((LD(qh + l) >> j) & 1) << 4);
            w[l] = ds * (float)v - dm;
        }
    }
    static constexpr int ACT = ACT_Q8_K;
    static __device__ __forceinline__ float dot(const u8* row, int c, int nc, const Act& a) {
        const u8* b = row + 176 * (c >> 3);
        int j = c & 7, shift = (j & 1) * 4;
        KHead head(b, j);
        const uint4* qh = (const uint4*)(b + 16);
        const uint4* q = (const uint4*)(b + 48 + 32 * (j >> 1));
        int s = 0;
#pragma unroll
        for (int i = 0; i < 2; i++) {
            uint4 v = LD(q + i), h = LD(qh + i);
            u32 lo[4] = {v.x, v.y, v.z, v.w}, hi[4] = {h.x, h.y, h.z, h.w};
#pragma unroll
            for (int k = 0; k < 4; k++) {
                u32 w = ((lo[k] >> shift) & 0x0f0f0f0fu) | (((hi[k] >> j) & 0x01010101u) << 4);
                s = __dp4a((int)w, a.q[4 * i + k], s);
            }
        }
        return head.product(a, s);
    }
};

// Q4_K: 256 values: f16 d, f16 dmin, 12 bytes of 6-bit scales and minimums, 128 bytes of
// nibbles; chunk j of a super-block takes bytes 32*(j/2).. of the nibbles, low nibbles for even
// j, high for odd (144 bytes, 16-byte aligned).
struct Q4_K {
    static __device__ __forceinline__ void load(const u8* row, int c, int nc, float* w) {
        const u8* b = row + 144 * (c >> 3);
        int j = c & 7;
        u32 dd = LD((const u32*)b);
        float d = h2f((u16)(dd & 0xffff)), dmin = h2f((u16)(dd >> 16));
        int sc, mn;
        scale_min_k4(b + 4, j, &sc, &mn);
        float ds = d * (float)sc, dm = dmin * (float)mn;
        const uint4* q = (const uint4*)(b + 16 + 32 * (j >> 1));
        int shift = (j & 1) * 4;
#pragma unroll
        for (int i = 0; i < 2; i++) {
            uint4 v = LD(q + i);
            u32 a[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int k = 0; k < 4; k++) {
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    u32 byte = (a[k] >> (8 * e)) & 0xff;
                    w[16 * i + 4 * k + e] = ds * (float)((byte >> shift) & 15) - dm;
                }
            }
        }
    }
    static constexpr int ACT = ACT_Q8_K;
    // What a chunk's product reads: its super-block's first 16 bytes and its 32 bytes of nibbles.
    struct Raw {
        uint4 head, q[2];
    };
    // Fetched before the arithmetic from global memory too (not only when staged).
    static constexpr bool FETCH_GLOBAL = true;
    template <bool SHARED = false>
    static __device__ __forceinline__ Raw fetch(const u8* row, int c, int nc) {
        const u8* b = row + 144 * (c >> 3);
        const uint4* q = (const uint4*)(b + 16 + 32 * ((c & 7) >> 1));
        return Raw{ld16<SHARED>(b), {ld16<SHARED>(q), ld16<SHARED>(q + 1)}};
    }
    static __device__ __forceinline__ float dot_raw(const Raw& w, int c, const Act& a) {
        int j = c & 7, shift = (j & 1) * 4;
        KHead head(w.head, j);
        int s = 0;
#pragma unroll
        for (int i = 0; i < 2; i++) {
            u32 v[4] = {w.q[i].x, w.q[i].y, w.q[i].z, w.q[i].w};
#pragma unroll
            for (int k = 0; k < 4; k++)
                s = __dp4a((int)((v[k] >> shift) & 0x0f0f0f0fu), a.q[4 * i + k], s);
        }
        return head.product(a, s);
    }
    static __device__ __forceinline__ float dot(const u8* row, int c, int nc, const Act& a) {
        return dot_raw(fetch(row, c, nc), c, a);
    }
};

// Q6_K: 256 values: 128 bytes of low nibbles, 64 bytes of high 2-bit pairs, 16 int8 scales,
// f16 d (210 bytes, 2-byte aligned). Chunk j: half n = j/4, quarter k = j%4; value l of the
// chunk: low nibble of ql[64n + 32(k&1) + l] (shifted by 4 when k >= 2), bits 2k..2k+2 of
// qh[32n + l], scale sc[8n + l/16 + 2k].
// Q6_K's integer sum for one chunk: word i of its 32 ql bytes is ql(i), of its 32 qh bytes
// qh(i) (the chunk's nibbles at lshift, its 2-bit highs at hshift), its two int8 scales (one
// per 16 values) side by side in `scales`.
template <typename L, typename H>
__device__ __forceinline__ int six_bit_dot(L ql, H qh, u32 scales, int lshift, int hshift,
                                           const Act& a) {
    int sum = 0;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        int part = 0;
#pragma unroll
        for (int i = 4 * h; i < 4 * h + 4; i++) {
            u32 w = ((ql(i) >> lshift) & 0x0f0f0f0fu) | (((qh(i) >> hshift) & 0x03030303u) << 4);
            part = __dp4a((int)w, a.q[i], part);
        }
        int sc = (int)(i8)((scales >> (8 * h)) & 0xff);
        sum += sc * (part - 32 * a.sum[h]);
    }
    return sum;
}

struct Q6_K {
    static __device__ __forceinline__ void load(const u8* row, int c, int nc, float* w) {
        const u8* b = row + 210 * (c >> 3);
        int j = c & 7, n = j >> 2, k = j & 3;
        float d = h2f(LD((const u16*)(b + 208)));
        float s0 = d * (float)(i8)LD(b + 192 + 8 * n + 2 * k);
        float s1 = d * (float)(i8)LD(b + 192 + 8 * n + 2 * k + 1);
        const u16* ql = (const u16*)(b + 64 * n + 32 * (k & 1));
        const u16* qh = (const u16*)(b + 128 + 32 * n);
        int lshift = (k >> 1) * 4, hshift = 2 * k;
#pragma unroll
        for (int i = 0; i < 16; i++) {
            u16 lo = LD(ql + i), hi = LD(qh + i);
#pragma unroll
            for (int e = 0; e < 2; e++) {
                int l = 2 * i + e;
                int q = (((lo >> (8 * e)) & 0xff) >> lshift & 15) |
                        ((((hi >> (8 * e)) & 0xff) >> hshift & 3) << 4);
                w[l] = (l < 16 ? s0 : s1) * (float)(q - 32);
            }
        }
    }
    static constexpr int ACT = ACT_Q8_K;
    static __device__ __forceinline__ float dot(const u8* row, int c, int nc, const Act& a) {
        const u8* b = row + 210 * (c >> 3);
        int j = c & 7, n = j >> 2, k = j & 3;
        float d = h2f(LD((const u16*)(b + 208)));
        const u8* ql = b + 64 * n + 32 * (k & 1);
        const u8* qh = b + 128 + 32 * n;
        // the chunk's two int8 scales, side by side
        u32 scales = LD((const u16*)(b + 192 + 8 * n + 2 * k));
        int sum = six_bit_dot([&](int i) { return ld_u16x2(ql + 4 * i); },
                              [&](int i) { return ld_u16x2(qh + 4 * i); }, scales,
                              (k >> 1) * 4, 2 * k, a);
        return a.d * d * (float)sum;
    }
};

// @IQUANTS: kernels.rs puts the i-quant block types here (kernels_iquants.cu, with ferrolm-quant's
// lattice tables before them).

// ---- repacked rows (ferrolm_cuda::repack): a row's blocks with each field gathered into its
// own array, the same bytes in another order, so that the quants load 16 bytes at a time
// (GGUF's 34- and 210-byte blocks are only 2-byte aligned). nc: the row's chunks. ----

// Q8_0R: [32 quant bytes of each block][f16 scale of each block].
struct Q8_0R {
    static __device__ __forceinline__ void load(const u8* row, int c, int nc, float* w) {
        const uint4* p = (const uint4*)(row + 32 * c);
        uint4 v0 = LD(p), v1 = LD(p + 1);
        float d = h2f(LD((const u16*)(row + 32 * nc) + c));
        u32 q[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
#pragma unroll
        for (int i = 0; i < 32; i++) w[i] = d * (float)(i8)((q[i >> 2] >> (8 * (i & 3))) & 0xff);
    }
    static constexpr int ACT = ACT_Q8_0;
    static __device__ __forceinline__ float dot(const u8* row, int c, int nc, const Act& a) {
        return dot_raw(fetch(row, c, nc), c, a);
    }
    // The split; from global memory the products call `dot` row by row, staged ones fetch
    // first.
    static constexpr bool FETCH_GLOBAL = false;
    struct Raw {
        uint4 v[2];
        u16 d;
    };
    template <bool SHARED = false>
    static __device__ __forceinline__ Raw fetch(const u8* row, int c, int nc) {
        const u8* p = row + 32 * c;
        return Raw{{ld16<SHARED>(p), ld16<SHARED>(p + 16)}, ld2<SHARED>(row + 32 * nc + 2 * c)};
    }
    static __device__ __forceinline__ float dot_raw(const Raw& w, int c, const Act& a) {
        float d = h2f(w.d);
        u32 q[8] = {w.v[0].x, w.v[0].y, w.v[0].z, w.v[0].w, w.v[1].x, w.v[1].y, w.v[1].z, w.v[1].w};
        int s = 0;
#pragma unroll
        for (int k = 0; k < 8; k++) s = __dp4a((int)q[k], a.q[k], s);
        return d * a.d * (float)s;
    }
};

// Q6_KR: [128 ql bytes of each super-block][64 qh bytes of each][16 scales of each][f16 d of
// each].
struct Q6_KR {
    static __device__ __forceinline__ void load(const u8* row, int c, int nc, float* w) {
        Raw r = fetch(row, c, nc);
        int k = c & 3, lshift = (k >> 1) * 4, hshift = 2 * k;
        float d = h2f(r.d);
        u32 scales = r.scales;
        float s0 = d * (float)(i8)(scales & 0xff), s1 = d * (float)(i8)(scales >> 8);
#pragma unroll
        for (int l = 0; l < 32; l++) {
            int lo = (word(r.l, l >> 2) >> (8 * (l & 3))) & 0xff,
                hi = (word(r.h, l >> 2) >> (8 * (l & 3))) & 0xff;
            int q = (lo >> lshift & 15) | ((hi >> hshift & 3) << 4);
            w[l] = (l < 16 ? s0 : s1) * (float)(q - 32);
        }
    }
    static constexpr int ACT = ACT_Q8_K;
    static __device__ __forceinline__ float dot(const u8* row, int c, int nc, const Act& a) {
        return dot_raw(fetch(row, c, nc), c, a);
    }
    // The chunk's 32 ql and 32 qh bytes (16-byte words), its two int8 scales side by side and
    // its super-block's d. From global memory the products call `dot` row by row (fetching
    // every row's words first was slower), staged ones fetch first.
    static constexpr bool FETCH_GLOBAL = false;
    struct Raw {
        uint4 l[2], h[2];
        u16 scales, d;
    };
    template <bool SHARED = false>
    static __device__ __forceinline__ Raw fetch(const u8* row, int c, int nc) {
        int nsb = nc >> 3, sb = c >> 3, j = c & 7, n = j >> 2, k = j & 3;
        const u8* l = row + 128 * sb + 64 * n + 32 * (k & 1);
        const u8* h = row + 128 * nsb + 64 * sb + 32 * n;
        return Raw{{ld16<SHARED>(l), ld16<SHARED>(l + 16)},
                   {ld16<SHARED>(h), ld16<SHARED>(h + 16)},
                   ld2<SHARED>(row + 192 * nsb + 16 * sb + 8 * n + 2 * k),
                   ld2<SHARED>(row + 208 * nsb + 2 * sb)};
    }
    // Word i of 8 held in two 16-byte words.
    static __device__ __forceinline__ u32 word(const uint4* v, int i) {
        uint4 x = v[i >> 2];
        int e = i & 3;
        return e == 0 ? x.x : e == 1 ? x.y : e == 2 ? x.z : x.w;
    }
    static __device__ __forceinline__ float dot_raw(const Raw& r, int c, const Act& a) {
        int k = c & 3;
        float d = h2f(r.d);
        int sum = six_bit_dot([&](int i) { return word(r.l, i); },
                              [&](int i) { return word(r.h, i); }, (u32)r.scales,
                              (k >> 1) * 4, 2 * k, a);
        return a.d * d * (float)sum;
    }
};

// ---- y[r] = W[r] . x (+ bias[r]) (+ res[r]): a block per ROWS rows ----
//
// The block's threads (32 to 128, as many as the row has chunks; 256 for rows of 256 chunks
// or more) take chunks blockDim apart;
// for each chunk a thread loads the 32 activations once and uses them for every row of the
// block (the activations, f32, would otherwise cost the L1 more than the weights do: ncu showed
// L1 at 96% and DRAM at 9% with one row per warp). Partial sums meet in shared memory.

#define ROWS 4

// Whether block type T splits its product into fetch (the chunk's words) and dot_raw.
template <typename T, typename = void>
struct HasRaw {
    static constexpr bool value = false;
};
template <typename T>
struct HasRaw<T, decltype(void(sizeof(typename T::Raw)))> {
    static constexpr bool value = true;
};
// Whether T's split is used from global memory too (T::FETCH_GLOBAL), not only when staged.
template <typename T, bool = HasRaw<T>::value>
struct FetchGlobal {
    static constexpr bool value = false;
};
template <typename T>
struct FetchGlobal<T, true> {
    static constexpr bool value = T::FETCH_GLOBAL;
};
// Chunks a thread of a product takes at a time (their loads issued together) where the block
// type splits fetch from arithmetic; 1 to compare (FERROLM_CUDA_DEFINES=MATVEC_UNROLL=1).
#ifndef MATVEC_UNROLL
#define MATVEC_UNROLL 2
#endif

// acc[r] += rows[r] . x over chunk c, and (TWO) over chunk c + step too: every row's words and
// the activations loaded before any arithmetic, so that they are one round trip to memory.
// Rows past the end are rows[0] again (the caller does not write them): a branch around a
// row's loads had the compiler take the rows one after another, a round trip each.
template <typename T, int R, bool ON_LOAD, bool TWO, bool SHARED = false>
__device__ __forceinline__ void chunk_dots(const u8* const* rows, int c, int n_chunks,
                                           const void* __restrict__ x, int step, float* acc) {
    typename T::Raw w0[R], w1[R];
#pragma unroll
    for (int r = 0; r < R; r++) {
        w0[r] = T::template fetch<SHARED>(rows[r], c, n_chunks);
        if (TWO) w1[r] = T::template fetch<SHARED>(rows[r], c + step, n_chunks);
    }
    Act a0, a1;
    if constexpr (ON_LOAD) {
        quantize_chunk<T::ACT>((const float*)x, c, a0);
    } else {
        load_act((const u8*)x, n_chunks, c, a0);
        if (TWO) load_act((const u8*)x, n_chunks, c + step, a1);
    }
#pragma unroll
    for (int r = 0; r < R; r++) acc[r] += T::dot_raw(w0[r], c, a0);
    if (TWO) {
#pragma unroll
        for (int r = 0; r < R; r++) acc[r] += T::dot_raw(w1[r], c + step, a1);
    }
}

// Whether float type T reads 16-byte pieces (f16, bf16).
template <typename T, typename = void>
struct HasPieces {
    static constexpr bool value = false;
};
template <typename T>
struct HasPieces<T, decltype(void(&T::unpack8))> {
    static constexpr bool value = true;
};
// Products over f16/bf16 rows: PIECES pieces of each row a thread at a time (piece_rows; 0:
// chunks of 32 values a row at a time, the f32 rows' way, to compare).
#ifndef PIECES
#define PIECES 1
#endif

// The f32 activations x[i0, i0 + N), rounded as the CPU rounds them for rows of type T.
template <typename T, int N>
__device__ __forceinline__ void float_acts(const float* x, int i0, float* xr) {
    const float4* xv = (const float4*)(x + i0);
#pragma unroll
    for (int i = 0; i < N / 4; i++) {
        float4 v = LD(xv + i);
        xr[4 * i] = v.x; xr[4 * i + 1] = v.y; xr[4 * i + 2] = v.z; xr[4 * i + 3] = v.w;
    }
#pragma unroll
    for (int i = 0; i < N; i++) {
        if (T::ACT == ACT_F16) xr[i] = h2f(f2h(xr[i]));
        if (T::ACT == ACT_BF16) xr[i] = round_bf16(xr[i]);
    }
}

// 16 bytes copied from global to shared memory without passing through registers: a thread's
// copies are all in flight at once whatever order the compiler gives the rest.
__device__ __forceinline__ void copy16_async(void* dst, const void* src) {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(dst)), "l"(src)
                 : "memory");
#else
    *(uint4*)dst = LD((const uint4*)src);
#endif
}
__device__ __forceinline__ void copies_issued() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
// This thread's copies have landed (and are visible to it).
__device__ __forceinline__ void copies_wait() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}
// All but this thread's last N groups of copies (`copies_issued`) have landed.
template <int N>
__device__ __forceinline__ void copies_wait_but() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}

// The most threads a product over 16-bit float rows reads pieces with (the slots' size).
#define PIECE_THREADS 256

// acc[r] += rows[r] . x for rows of 16-bit floats (rows past the end: rows[0] again, not
// written), read as 16-byte pieces of 8 values: thread t takes pieces t, t + nt, ..., so that
// a warp's copies are 512 consecutive bytes. PIECES pieces of every row at a time are copied
// into the thread's own slots of shared memory (the first round before the wait for the
// previous kernel: no kernel writes weights), their dots taken, then the next round issued.
// A thread's pieces are summed in order.
template <typename T, int R>
__device__ __forceinline__ void piece_rows(const u8* const* rows, int n_chunks, const float* x,
                                           float* acc) {
    __shared__ __align__(16) uint4 slots[PIECES][R][PIECE_THREADS];
    int tid = threadIdx.x, nt = blockDim.x, n = 4 * n_chunks;
    auto issue = [&](int p) {
#pragma unroll
        for (int k = 0; k < PIECES; k++)
#pragma unroll
            for (int r = 0; r < R; r++)
                if (p + k * nt < n)
                    copy16_async(&slots[k][r][tid], (const uint4*)rows[r] + p + k * nt);
        copies_issued();
    };
    issue(tid);
    step_begin();
    for (int p = tid; p < n; p += PIECES * nt) {
        float xr[PIECES][8];
#pragma unroll
        for (int k = 0; k < PIECES; k++)
            if (p + k * nt < n) float_acts<T, 8>(x, 8 * (p + k * nt), xr[k]);
        copies_wait();
#pragma unroll
        for (int k = 0; k < PIECES; k++) {
            if (p + k * nt >= n) break;
#pragma unroll
            for (int r = 0; r < R; r++) {
                float v[8];
                T::unpack8(lds16(&slots[k][r][tid]), v);
                float a = 0.f;
#pragma unroll
                for (int i = 0; i < 8; i++) a += v[i] * xr[k][i];
                acc[r] += a;
            }
        }
        if (p + PIECES * nt < n) issue(p + PIECES * nt);
    }
}

// After the call, tot[r] holds row r's product in every thread of the block. With Q, x is the
// activations quantized as the CPU quantizes them for the row type (XQ), multiplied with
// integer dot products; otherwise f32 (rounded as the CPU rounds them for F16 / BF16 rows).
// Q: integer dots with the activations quantized, read from XQ, or (ON_LOAD) from f32 x
// quantized chunk by chunk as they are loaded. A thread's chunks are summed in order
// (tid, tid + nt, ...) whichever way they are loaded.
// STAGE (quantized rows with a fetch/dot_raw split): the block's rows are copied into dynamic
// shared memory (R x row_bytes) by bulk copies issued before the wait for the previous kernel,
// all of a block's bytes in flight at once whatever the compiler's order of loads.
template <typename T, int R, bool Q, bool ON_LOAD = false, bool STAGE = false>
__device__ __forceinline__ void rows_dot(const u8* const* rows, int row_bytes, int n_chunks,
                                         const void* __restrict__ x, float* tot) {
    __shared__ float part[8][R];
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, nt = blockDim.x;
    const u8* rp[R];
    float acc[R];
    constexpr bool PIECEWISE = !Q && HasPieces<T>::value && PIECES > 0;
    bool piecewise = PIECEWISE && nt <= PIECE_THREADS;
    if (piecewise) {
#pragma unroll
        for (int r = 0; r < R; r++) {
            rp[r] = rows[r] ? rows[r] : rows[0];
            acc[r] = 0.f;
        }
        if constexpr (PIECEWISE) piece_rows<T, R>(rp, n_chunks, (const float*)x, acc);
    } else if constexpr (STAGE) {
        extern __shared__ __align__(128) u8 staged[];
        __shared__ u64 bar;
        if (tid == 0) stage_init(&bar);
        __syncthreads();
        if (tid == 0) stage_rows<R>(staged, rows, row_bytes, &bar);
        step_begin();
#pragma unroll
        for (int r = 0; r < R; r++) rp[r] = staged + (rows[r] ? r : 0) * row_bytes;
        stage_wait(&bar);
    } else {
        // The weights do not wait for the previous kernel: quantized rows are asked for early.
        // Float rows are not: on an H200 that decoded an 8B F16 file 158 -> 170 tok/s, where
        // the prefetch took an 8B Q4_K_M 346 -> 368 and a 1B Q4_K_M 1256 -> 1423.
        if constexpr (T::ACT != ACT_F32 && T::ACT != ACT_F16 && T::ACT != ACT_BF16) {
#pragma unroll
            for (int r = 0; r < R; r++)
                if (tid == r && rows[r]) prefetch_l2(rows[r], row_bytes);
        }
        step_begin();
#pragma unroll
        for (int r = 0; r < R; r++) rp[r] = rows[r] ? rows[r] : rows[0];
    }
    if (!piecewise) {
#pragma unroll
        for (int r = 0; r < R; r++) acc[r] = 0.f;
    }
    if (piecewise) {
        // done above
    } else if constexpr (Q && HasRaw<T>::value && (STAGE || FetchGlobal<T>::value)) {
        // Two chunks at a time, but not on load (quantize_chunk's lanes share Q8_K scales).
        int c = tid;
        if constexpr (!ON_LOAD && MATVEC_UNROLL > 1) {
            for (; c + nt < n_chunks; c += 2 * nt)
                chunk_dots<T, R, ON_LOAD, true, STAGE>(rp, c, n_chunks, x, nt, acc);
            // At most one chunk is left: an `if`, not a loop (a loop here cost an 8B 4%).
            if (c < n_chunks)
                chunk_dots<T, R, ON_LOAD, false, STAGE>(rp, c, n_chunks, x, nt, acc);
        } else {
            for (; c < n_chunks; c += nt)
                chunk_dots<T, R, ON_LOAD, false>(rp, c, n_chunks, x, nt, acc);
        }
    } else {
        for (int c = tid; c < n_chunks; c += nt) {
            if constexpr (Q) {
                Act a;
                if constexpr (ON_LOAD)
                    quantize_chunk<T::ACT>((const float*)x, c, a);
                else
                    load_act((const u8*)x, n_chunks, c, a);
#pragma unroll
                for (int r = 0; r < R; r++) acc[r] += T::dot(rp[r], c, n_chunks, a);
            } else {
                float xr[32];
                float_acts<T, 32>((const float*)x, 32 * c, xr);
                // A row at a time (f32 rows; f16/bf16 with PIECES=0). Float rows keep the
                // branch: without it an 8B F16 file decoded 3% slower.
#pragma unroll
                for (int r = 0; r < R; r++) {
                    if (rows[r]) {
                        float w[32];
                        T::load(rows[r], c, n_chunks, w);
                        float a = 0.f;
#pragma unroll
                        for (int i = 0; i < 32; i++) a += w[i] * xr[i];
                        acc[r] += a;
                    }
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; r++) {
        float v = warp_sum(acc[r]);
        if (lane == 0) part[warp][r] = v;
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < R; r++) {
        float v = 0.f;
        for (int w = 0; w < (nt >> 5); w++) v += part[w][r];
        tot[r] = v;
    }
}

template <typename T, bool Q, bool ON_LOAD = false, bool STAGE = false>
__device__ __forceinline__ void matvec(const u8* __restrict__ W, int row_bytes, int n_chunks,
                                       int n_rows, const void* __restrict__ x,
                                       const float* bias, const float* res, float* y) {
    int r0 = blockIdx.x * ROWS, tid = threadIdx.x;
    const u8* rows[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; r++) rows[r] = r0 + r < n_rows ? W + (size_t)(r0 + r) * row_bytes : 0;
    float tot[ROWS];
    rows_dot<T, ROWS, Q, ON_LOAD, STAGE>(rows, row_bytes, n_chunks, x, tot);
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        if (tid == r && rows[r]) {
            float v = tot[r];
            if (bias) v += bias[r0 + r];
            if (res) v += res[r0 + r];
            y[r0 + r] = v;
        }
    }
}

// x[c*32..] = dequantized row `*token` of the embedding table: a thread per chunk.
template <typename T>
__device__ __forceinline__ void embed(const u8* __restrict__ table, int row_bytes, int n_chunks,
                                      const u32* token, float* x) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= n_chunks) return;
    const u8* row = table + (size_t)(*token) * row_bytes;
    float w[32];
    T::load(row, c, n_chunks, w);
#pragma unroll
    for (int i = 0; i < 32; i++) x[32 * c + i] = w[i];
}

// Up to three matrices of one type and width in one launch (Q, K and V): rows [0, r0) of the
// grid are W0's, [r0, r0 + r1) W1's, the rest W2's. rows[r] = row g0 + r of the grid (0 past
// the end).
__device__ __forceinline__ void segment_rows(int g0, const u8* W0, const u8* W1, const u8* W2,
                                             int r0, int r1, int r2, int row_bytes,
                                             const u8** rows) {
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        int g = g0 + r;
        rows[r] = g < r0 ? W0 + (size_t)g * row_bytes
                : g < r0 + r1 ? W1 + (size_t)(g - r0) * row_bytes
                : g < r0 + r1 + r2 ? W2 + (size_t)(g - r0 - r1) * row_bytes : 0;
    }
}

template <typename T, bool Q, bool STAGE = false>
__device__ __forceinline__ void matvec3(const u8* W0, const u8* W1, const u8* W2, int r0, int r1,
                                        int r2, int row_bytes, int n_chunks, const void* x,
                                        const float* b0, const float* b1, const float* b2,
                                        float* y0, float* y1, float* y2) {
    int g0 = blockIdx.x * ROWS, tid = threadIdx.x;
    const u8* rows[ROWS];
    segment_rows(g0, W0, W1, W2, r0, r1, r2, row_bytes, rows);
    float tot[ROWS];
    rows_dot<T, ROWS, Q, false, STAGE>(rows, row_bytes, n_chunks, x, tot);
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        if (tid == r && rows[r]) {
            int g = g0 + r;
            float v = tot[r];
            if (g < r0) y0[g] = v + (b0 ? b0[g] : 0.f);
            else if (g < r0 + r1) y1[g - r0] = v + (b1 ? b1[g - r0] : 0.f);
            else y2[g - r0 - r1] = v + (b2 ? b2[g - r0 - r1] : 0.f);
        }
    }
}

// The angle of rotation pair i at position p, as the CPU computes it: the position times
// theta_scale once per pair before this one, divided by the pair's frequency factor, times
// freq_scale.
__device__ __forceinline__ float rope_angle(int p, int i, float theta_scale, float freq_scale,
                                            const float* freq_factors) {
    float theta = (float)p;
    for (int j = 0; j < i; j++) theta *= theta_scale;
    if (freq_factors) theta /= freq_factors[i];
    return freq_scale * theta;
}

// (x0, x1) rotated by angle a, with the CPU's fused multiply-adds; the cosine and sine
// multiplied by mscale (the attention factor, YaRN's magnitude; 1: none).
__device__ __forceinline__ void rotate_pair(float& x0, float& x1, float a, float mscale = 1.f) {
    float cs = cosf(a) * mscale, sn = sinf(a) * mscale;
    float r0 = fmaf(x0, cs, -(x1 * sn)), r1 = fmaf(x0, sn, x1 * cs);
    x0 = r0;
    x1 = r1;
}

// matvec3 for the query, key and value rows of a token with the rotation and the cache store
// in its epilogue (no rope_store launch): rows [0, r0) are queries, rotated and written to y0
// (f32); [r0, r0 + r1) keys, rotated and stored as f16 at position *pos of kc; the rest
// values, stored as f16 in vc (rows of kv_dim). A rotation pair is two adjacent rows (RoPE's
// normal layout; r0, r1 and the head width even), so a block's 4 rows hold two whole pairs:
// thread 0 takes rows 0-1, thread 2 rows 2-3. Dimensions past n_dims of a head stay as they
// are. Same arithmetic as rope_head.
template <typename T, bool Q, bool STAGE = false>
__device__ __forceinline__ void matvec3_rope(int bx, const u8* W0, const u8* W1, const u8* W2,
                                             int r0, int r1, int r2, int row_bytes,
                                             int n_chunks, const void* x, const float* b0,
                                             const float* b1, const float* b2, float* y0,
                                             u16* kc, u16* vc, const u32* pos, int kv_dim,
                                             int hd, int n_dims, float theta_scale,
                                             float freq_scale, const float* freq_factors) {
    int g0 = bx * ROWS, tid = threadIdx.x;
    const u8* rows[ROWS];
    segment_rows(g0, W0, W1, W2, r0, r1, r2, row_bytes, rows);
    float tot[ROWS];
    rows_dot<T, ROWS, Q, false, STAGE>(rows, row_bytes, n_chunks, x, tot);
    if ((tid != 0 && tid != 2) || !rows[tid]) return;
    int g = g0 + tid;
    float x0 = tid == 0 ? tot[0] : tot[2], x1 = tid == 0 ? tot[1] : tot[3];
    int p = (int)*pos;
    if (g >= r0 + r1) {
        int e = g - r0 - r1;
        if (b2) { x0 += b2[e]; x1 += b2[e + 1]; }
        size_t at = (size_t)p * kv_dim + e;
        vc[at] = f2h(x0);
        vc[at + 1] = f2h(x1);
        return;
    }
    bool is_q = g < r0;
    int e = is_q ? g : g - r0;
    const float* b = is_q ? b0 : b1;
    if (b) { x0 += b[e]; x1 += b[e + 1]; }
    int d = e % hd;
    if (d < n_dims)
        rotate_pair(x0, x1, rope_angle(p, d / 2, theta_scale, freq_scale, freq_factors));
    if (is_q) {
        y0[e] = x0;
        y0[e + 1] = x1;
    } else {
        size_t at = (size_t)p * kv_dim + e;
        kc[at] = f2h(x0);
        kc[at + 1] = f2h(x1);
    }
}

// The gated products' activations (matvec_glu's `act`).
#define GLU_SILU 0
#define GLU_GELU 1
#define GLU_OAI 2

// gpt-oss's clamped SwiGLU as ggml's swiglu_oai computes it (alpha 1.702, limit 7).
__device__ __forceinline__ float swiglu_oai_f(float g, float u) {
    float x = fminf(g, 7.f), y = fminf(fmaxf(u, -7.f), 7.f);
    return x / (1.f + expf(1.702f * -x)) * (y + 1.f);
}

// GELU as the CPU computes it (ggml's f16 table, GGML_GELU_FP16): 0 at or below -10, x at or
// above 10, otherwise the tanh approximation of x rounded to f16, rounded to f16.
__device__ __forceinline__ float gelu_table(float g) {
    if (g <= -10.f) return 0.f;
    if (g >= 10.f) return g;
    float x = h2f(f2h(g));
    float inner = fmaf(0.044715f * x, x, 1.f);
    float t = (float)tanh((double)(0.7978846f * x * inner));
    return h2f(f2h(0.5f * x * (1.f + t)));
}

// A batched step's gated activations act(g) * u (act as the decode step's: GLU_*) over rows of
// n values: f16 into out, and each row quantized from f32 into xq's row (quantize_rows_f16's
// layout) for the down product's mmq_*. Grid: (groups of 2048, rows), a warp per 256 values.
extern "C" __global__ void glu_rows_q(const float* g, const float* u, u16* out, u8* xq, int n,
                                      int act, int mode) {
    step_begin();
    int grp = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (256 * grp >= n) return;
    size_t r = blockIdx.y;
    float v[8];
#pragma unroll
    for (int i = 0; i < 8; i++) {
        int j = 256 * grp + 8 * lane + i;
        float gv = j < n ? g[r * n + j] : 0.f, uv = j < n ? u[r * n + j] : 0.f;
        v[i] = act == GLU_OAI    ? swiglu_oai_f(gv, uv)
               : act == GLU_GELU ? gelu_table(gv) * uv
                                 : gv / (1.f + expf(-gv)) * uv;
        if (j < n) out[r * n + j] = f2h(v[i]);
    }
    quantize_group(v, xq + r * (n + 8 * (n / 32)), n, grp, mode);
}

// out[r] = act(G[r] . x) * (U[r] . x), act silu or GELU: the gate and up products and the
// gated activation in one launch (a warp per row of both matrices).
template <typename T, bool Q, bool STAGE = false>
__device__ __forceinline__ void matvec_glu(const u8* G, const u8* U, int row_bytes, int n_chunks,
                                           int n_rows, const void* x, float* out, int act) {
    int r0 = blockIdx.x * (ROWS / 2), tid = threadIdx.x;
    // Rows r0, r0+1 of the gate, then the same of up.
    const u8* rows[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS / 2; r++) {
        bool ok = r0 + r < n_rows;
        rows[r] = ok ? G + (size_t)(r0 + r) * row_bytes : 0;
        rows[ROWS / 2 + r] = ok ? U + (size_t)(r0 + r) * row_bytes : 0;
    }
    float tot[ROWS];
    rows_dot<T, ROWS, Q, false, STAGE>(rows, row_bytes, n_chunks, x, tot);
#pragma unroll
    for (int r = 0; r < ROWS / 2; r++) {
        if (tid == r && rows[r]) {
            float g = tot[r], u = tot[ROWS / 2 + r];
            out[r0 + r] = act == GLU_OAI    ? swiglu_oai_f(g, u)
                          : act == GLU_GELU ? gelu_table(g) * u
                                            : g / (1.f + expf(-g)) * u;
        }
    }
}

// The decode products of rows of type T: NAME_T with f32 activations (x: floats), NAMEq_T with
// the activations quantized in device memory (x: XQ; block types with integer dot products),
// NAMEs_T as NAMEq_T with the block's rows staged in shared memory (ST; launched with
// ROWS x row_bytes of dynamic shared memory).
#define FOR_PRODUCTS(T, Q, S, ST)                                                                \
    extern "C" __global__ void matvec3##S(const u8* W0, const u8* W1, const u8* W2, int r0,     \
                                          int r1, int r2, int row_bytes, int n_chunks,           \
                                          const void* x, const float* b0, const float* b1,       \
                                          const float* b2, float* y0, float* y1, float* y2) {    \
        matvec3<T, Q, ST>(W0, W1, W2, r0, r1, r2, row_bytes, n_chunks, x, b0, b1, b2, y0, y1, y2);  \
    }                                                                                            \
    extern "C" __global__ void matvec3r##S(                                                      \
        const u8* W0, const u8* W1, const u8* W2, int r0, int r1, int r2, int row_bytes,         \
        int n_chunks, const void* x, const float* b0, const float* b1, const float* b2,          \
        float* y0, u16* kc, u16* vc, const u32* pos, int kv_dim, int hd, int n_dims,             \
        float theta_scale, float freq_scale, const float* freq_factors) {                        \
        matvec3_rope<T, Q, ST>(blockIdx.x, W0, W1, W2, r0, r1, r2, row_bytes, n_chunks, x, b0, b1,  \
                           b2, y0, kc, vc, pos, kv_dim, hd, n_dims, theta_scale, freq_scale,     \
                           freq_factors);                                                        \
    }                                                                                            \
    extern "C" __global__ void matvec_glu##S(const u8* G, const u8* U, int row_bytes,           \
                                             int n_chunks, int n_rows, const void* x,            \
                                             float* out, int act) {                              \
        matvec_glu<T, Q, ST>(G, U, row_bytes, n_chunks, n_rows, x, out, act);                    \
    }                                                                                            \
    extern "C" __global__ void matvec##S(const u8* W, int row_bytes, int n_chunks, int n_rows,  \
                                         const void* x, const float* bias, const float* res,     \
                                         float* y) {                                             \
        matvec<T, Q, false, ST>(W, row_bytes, n_chunks, n_rows, x, bias, res, y);                           \
    }                                                                                            \
    extern "C" __global__ void moe_glu##S(const u8* G, const u8* U, long long expert_bytes,      \
                                          int row_bytes, int n_chunks, int n_rows, const void* x, \
                                          const u32* ids, float* out, int act, const u8* SG,     \
                                          const u8* SU, float* sout, int s_rows) {               \
        step_begin();                                                                            \
        /* (the grid covers the wider of the two: a block past its own rows has none) */         \
        const bool shared = SG && blockIdx.y == gridDim.y - 1;                                   \
        if ((int)blockIdx.x * (ROWS / 2) >= (shared ? s_rows : n_rows)) return;                  \
        if (shared) {                                                                            \
            matvec_glu<T, Q, ST>(SG, SU, row_bytes, n_chunks, s_rows, x, sout, act);             \
            return;                                                                              \
        }                                                                                        \
        size_t e = (size_t)ids[blockIdx.y] * (size_t)expert_bytes;                               \
        matvec_glu<T, Q, ST>(G + e, U + e, row_bytes, n_chunks, n_rows, x,                       \
                             out + (size_t)blockIdx.y * n_rows, act);                            \
    }

#define FOR_TYPE(T)                                                                              \
    FOR_PRODUCTS(T, false, _##T, false)                                                          \
    extern "C" __global__ void embed_##T(const u8* table, int row_bytes, int n_chunks,          \
                                         const u32* token, float* x) {                           \
        step_begin();                                                                            \
        embed<T>(table, row_bytes, n_chunks, token, x);                                          \
    }                                                                                            \
    extern "C" __global__ void moe_matvec_##T(const u8* W, long long expert_bytes,               \
                                              int row_bytes, int n_chunks, int n_rows,           \
                                              const float* x, int x_stride, int x_per,           \
                                              const u32* ids, float* y, const u8* SW,            \
                                              const float* sx, float* sy, int s_row_bytes,       \
                                              int s_chunks) {                                    \
        step_begin();                                                                            \
        if (SW && blockIdx.y == gridDim.y - 1) {                                                 \
            matvec<T, false>(SW, s_row_bytes, s_chunks, n_rows, sx, nullptr, nullptr, sy);       \
            return;                                                                              \
        }                                                                                        \
        size_t e = (size_t)ids[blockIdx.y] * (size_t)expert_bytes;                               \
        matvec<T, false>(W + e, row_bytes, n_chunks, n_rows,                                     \
                         x + (size_t)(blockIdx.y / x_per) * x_stride, nullptr, nullptr,          \
                         y + (size_t)blockIdx.y * n_rows);                                       \
    }

// matvecf_T: matvec with f32 activations x quantized chunk by chunk as the blocks load them.
#define FOR_QTYPE(T)                                                                             \
    FOR_PRODUCTS(T, true, q_##T, false)                                                          \
    extern "C" __global__ void matvecf_##T(const u8* W, int row_bytes, int n_chunks,            \
                                           int n_rows, const void* x, const float* bias,         \
                                           const float* res, float* y) {                         \
        matvec<T, true, true>(W, row_bytes, n_chunks, n_rows, x, bias, res, y);                  \
    }                                                                                            \
    extern "C" __global__ void moe_matvecf_##T(const u8* W, long long expert_bytes,              \
                                               int row_bytes, int n_chunks, int n_rows,          \
                                               const float* x, int x_stride, int x_per,          \
                                               const u32* ids, float* y, const u8* SW,           \
                                               const float* sx, float* sy, int s_row_bytes,      \
                                               int s_chunks) {                                   \
        step_begin();                                                                            \
        if (SW && blockIdx.y == gridDim.y - 1) {                                                 \
            matvec<T, true, true>(SW, s_row_bytes, s_chunks, n_rows, sx, nullptr, nullptr, sy);  \
            return;                                                                              \
        }                                                                                        \
        size_t e = (size_t)ids[blockIdx.y] * (size_t)expert_bytes;                               \
        matvec<T, true, true>(W + e, row_bytes, n_chunks, n_rows,                                \
                              x + (size_t)(blockIdx.y / x_per) * x_stride, nullptr, nullptr,     \
                              y + (size_t)blockIdx.y * n_rows);                                  \
    }

// ---- y[t][r] (+)= W[r] . x_t for the rows t of a small batched decode step, on the int8
// tensor cores (Q4_K and Q6_K rows against Q8_K activations) ----
//
// A block takes MMQ_ROWS weight rows and MMQ_COLS columns (rows of activations, quantized by
// quantize_rows_f16), its MMQ_WARPS warps every MMQ_WARPS-th super-block of the rows; the warps'
// partial sums are added in warp order. Per super-block and output, the chunks' integer sums
// are weighted by their scales in integers and the super-block's float scales applied once,
// as the CPU's Q4_K / Q6_K dot kernels do. m16n8k16 products: lane (g, c) holds word c of
// each 16-value half of a chunk (values 4c..4c+3) of rows g and g + 8 and of column g; the
// activations' sums per half come from the same product with weights of ones. Grid: (column
// groups, row groups), the column groups of the same rows side by side (the weights from L2).
#define MMQ_ROWS 16
#define MMQ_COLS 16
#define MMQ_WARPS 4

__device__ __forceinline__ void mma_s8_16816(int* d, u32 a0, u32 a1, u32 b) {
    // (not volatile: no side effects, so the compiler may interleave the chunk's products)
    asm(
        "mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
        "{%0,%1,%2,%3};"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a0), "r"(a1), "r"(b));
}

// What a lane reads of one row's super-block.
// (super-block sb of a row of nb; Q6_K's rows as GGUF has them or regrouped, repack.rs)
struct MmqQ4K {
    static constexpr bool Q6 = false;
    uint4 head;
    u32 q[8];  // chunk pair i: words c and 4 + c of its 32 bytes at 2i, 2i + 1
    __device__ __forceinline__ void load(const u8* row, int sb, int nb, int c) {
        const u8* b = row + 144 * (size_t)sb;
        head = LD((const uint4*)b);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            q[2 * i] = LD((const u32*)(b + 16 + 32 * i + 4 * c));
            q[2 * i + 1] = LD((const u32*)(b + 16 + 32 * i + 16 + 4 * c));
        }
    }
    // Chunk j's half h as int8 values.
    __device__ __forceinline__ u32 word(int j, int h) const {
        return (q[2 * (j >> 1) + h] >> (4 * (j & 1))) & 0x0f0f0f0fu;
    }
};

template <bool REGROUPED>
struct MmqQ6K {
    static constexpr bool Q6 = true;
    u32 ql[8], qh[4], sc[4];
    u16 d;
    __device__ __forceinline__ void load(const u8* row, int sb, int nb, int c) {
        if constexpr (REGROUPED) {
            const u8* l = row + 128 * (size_t)sb;
            const u8* h = row + 128 * (size_t)nb + 64 * (size_t)sb;
            const u8* s = row + 192 * (size_t)nb + 16 * (size_t)sb;
#pragma unroll
            for (int i = 0; i < 8; i++) ql[i] = LD((const u32*)(l + 16 * i + 4 * c));
#pragma unroll
            for (int i = 0; i < 4; i++) qh[i] = LD((const u32*)(h + 16 * i + 4 * c));
            uint4 v = LD((const uint4*)s);
            sc[0] = v.x; sc[1] = v.y; sc[2] = v.z; sc[3] = v.w;
            d = LD((const u16*)(row + 208 * (size_t)nb + 2 * (size_t)sb));
        } else {
            const u8* b = row + 210 * (size_t)sb;
#pragma unroll
            for (int i = 0; i < 8; i++) ql[i] = ld_u16x2(b + 16 * i + 4 * c);
#pragma unroll
            for (int i = 0; i < 4; i++) qh[i] = ld_u16x2(b + 128 + 16 * i + 4 * c);
#pragma unroll
            for (int i = 0; i < 4; i++) sc[i] = ld_u16x2(b + 192 + 4 * i);
            d = LD((const u16*)(b + 208));
        }
    }
    // Chunk j (half n = j / 4, quarter k = j % 4) half h: the 6-bit values, 0..63.
    __device__ __forceinline__ u32 word(int j, int h) const {
        int n = j >> 2, k = j & 3;
        u32 lo = (ql[4 * n + 2 * (k & 1) + h] >> (4 * (k >> 1))) & 0x0f0f0f0fu;
        u32 hi = (qh[2 * n + h] >> (2 * k)) & 0x03030303u;
        return lo | (hi << 4);
    }
    __device__ __forceinline__ int scale(int j, int h) const {
        int i = 8 * (j >> 2) + 2 * (j & 3) + h;
        return (int)(i8)((sc[i >> 2] >> (8 * (i & 3))) & 0xff);
    }
};

// A lane's activation words of one super-block (chunk j, n-tile nt, half h) and the Q8_K
// scales of its output columns (n-tile nt, 2c + e).
template <int NT>
struct MmqActs {
    u32 b[8][NT][2];
    float d[NT][2];
    __device__ __forceinline__ void load(const u8* const* xcol, const bool* has, const u8* xq,
                                         int sb, int c, int t0, int n_cols, size_t stride,
                                         int n_chunks) {
#pragma unroll
        for (int j = 0; j < 8; j++)
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int h = 0; h < 2; h++)
                    b[j][nt][h] = has[nt] ? LD((const u32*)(xcol[nt] + 32 * (size_t)(8 * sb + j) +
                                                            16 * h + 4 * c))
                                          : 0u;
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                int t = min(t0 + 8 * nt + 2 * c + e, n_cols - 1);
                d[nt][e] = LD((const float*)(xq + (size_t)t * stride + 32 * (size_t)n_chunks) +
                              8 * sb);
            }
    }
};

template <typename T>
__device__ __forceinline__ void mmq(const u8* __restrict__ W, int row_bytes, int n_chunks,
                                    int n_rows, const u8* __restrict__ xq, int n_cols, float* y,
                                    float beta) {
    constexpr int NT = MMQ_COLS / 8;
    constexpr bool Q6 = T::Q6;
    __shared__ float part[MMQ_WARPS][NT * 4][32];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    int r0 = blockIdx.y * MMQ_ROWS, t0 = blockIdx.x * MMQ_COLS;
    const u8* rows[2] = {W + (size_t)min(r0 + g, n_rows - 1) * row_bytes,
                         W + (size_t)min(r0 + g + 8, n_rows - 1) * row_bytes};
    size_t stride = (size_t)n_chunks * 40;
    // This lane's activation column of each n-tile (zeros past n_cols).
    const u8* xcol[NT];
    bool has[NT];
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        has[nt] = t0 + 8 * nt + g < n_cols;
        xcol[nt] = xq + (size_t)min(t0 + 8 * nt + g, n_cols - 1) * stride;
    }
    float acc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc[nt][e] = 0.f;
    const u32 ones = 0x01010101u;
    int n_super = n_chunks / 8;
    // The next super-block's weights and activations are loaded while this one's are used.
    T cur[2], next[2];
    MmqActs<NT> x, x_next;
    int sb = warp;
    if (sb < n_super) {
        cur[0].load(rows[0], sb, n_super, c);
        cur[1].load(rows[1], sb, n_super, c);
        x.load(xcol, has, xq, sb, c, t0, n_cols, stride, n_chunks);
    }
    for (; sb < n_super; sb += MMQ_WARPS) {
        if (sb + MMQ_WARPS < n_super) {
            next[0].load(rows[0], sb + MMQ_WARPS, n_super, c);
            next[1].load(rows[1], sb + MMQ_WARPS, n_super, c);
            x_next.load(xcol, has, xq, sb + MMQ_WARPS, c, t0, n_cols, stride, n_chunks);
        }
        int isum[NT][4], msum[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) isum[nt][e] = msum[nt][e] = 0;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            int sc[2], mn[2];
            if constexpr (!Q6) {
#pragma unroll
                for (int r = 0; r < 2; r++) scale_min_k4_words(cur[r].head, j, &sc[r], &mn[r]);
            }
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                int s[2][4] = {{0, 0, 0, 0}, {0, 0, 0, 0}}, as[2][4] = {{0, 0, 0, 0}, {0, 0, 0, 0}};
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    mma_s8_16816(s[h], cur[0].word(j, h), cur[1].word(j, h), x.b[j][nt][h]);
                    mma_s8_16816(as[h], ones, ones, x.b[j][nt][h]);
                }
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    int r = e >> 1;
                    if constexpr (Q6) {
                        isum[nt][e] += cur[r].scale(j, 0) * (s[0][e] - 32 * as[0][e]) +
                                       cur[r].scale(j, 1) * (s[1][e] - 32 * as[1][e]);
                    } else {
                        isum[nt][e] += sc[r] * (s[0][e] + s[1][e]);
                        msum[nt][e] += mn[r] * (as[0][e] + as[1][e]);
                    }
                }
            }
        }
        // The super-block's float scales: the activations' (Q8_K: one per 256) of columns
        // 2c, 2c + 1, the rows'.
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int r = e >> 1;
                if constexpr (Q6) {
                    acc[nt][e] += x.d[nt][e & 1] * h2f(cur[r].d) * (float)isum[nt][e];
                } else {
                    float d = h2f((u16)(cur[r].head.x & 0xffff)),
                          dmin = h2f((u16)(cur[r].head.x >> 16));
                    acc[nt][e] +=
                        x.d[nt][e & 1] * (d * (float)isum[nt][e] - dmin * (float)msum[nt][e]);
                }
            }
        cur[0] = next[0];
        cur[1] = next[1];
        x = x_next;
    }
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) part[warp][nt * 4 + e][lane] = acc[nt][e];
    __syncthreads();
    if (warp != 0) return;
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            float v = 0.f;
#pragma unroll
            for (int w = 0; w < MMQ_WARPS; w++) v += part[w][nt * 4 + e][lane];
            int row = r0 + g + 8 * (e >> 1), t = t0 + 8 * nt + 2 * c + (e & 1);
            if (row < n_rows && t < n_cols) {
                float* o = y + (size_t)t * n_rows + row;
                *o = beta != 0.f ? v + beta * *o : v;
            }
        }
}

#define MMQ(NAME, T)                                                                             \
    extern "C" __global__ void __launch_bounds__(32 * MMQ_WARPS)                                \
        mmq_##NAME(const u8* W, int row_bytes, int n_chunks, int n_rows, const u8* xq,          \
                   int n_cols, float* y, float beta) { step_begin();                            \
        mmq<T>(W, row_bytes, n_chunks, n_rows, xq, n_cols, y, beta);                             \
    }
MMQ(Q4_K, MmqQ4K)
MMQ(Q6_K, MmqQ6K<false>)
MMQ(Q6_KR, MmqQ6K<true>)

// ---- block-wide sum (blockDim a multiple of 32, at most 1024) ----
__device__ float block_sum(float v) {
    __shared__ float part[32];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) part[warp] = v;
    __syncthreads();
    float t = lane < nw ? part[lane] : 0.f;
    return warp_sum(t);
}

// The scale of an RMS norm of n values whose squares sum (in each thread) to s, as the CPU
// computes it: the squares summed in f64, the mean rounded to f32, 1 / sqrt(mean + eps). Equal
// inputs then give equal outputs, which the 8-bit rounding of the products' inputs needs.
__device__ float rms_scale(double s, int n, float eps) {
    __shared__ double part[32];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    __syncthreads();
    if (lane == 0) part[warp] = s;
    __syncthreads();
    double t = lane < nw ? part[lane] : 0.0;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
    float mean = (float)(t / (double)n);
    return 1.f / sqrtf(mean + eps);
}

// Eight consecutive values p[0..8) (32-byte aligned), zeros where ok is false.
__device__ __forceinline__ void load8(const float* p, bool ok, float* v) {
    float4 a = ok ? *(const float4*)p : make_float4(0.f, 0.f, 0.f, 0.f);
    float4 b = ok ? *(const float4*)(p + 4) : make_float4(0.f, 0.f, 0.f, 0.f);
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
    v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}

// p[0..8) = v[0..8) (32-byte aligned), as two float4s.
__device__ __forceinline__ void store8(float* p, const float* v) {
    float4* o = (float4*)p;
    o[0] = make_float4(v[0], v[1], v[2], v[3]);
    o[1] = make_float4(v[4], v[5], v[6], v[7]);
}

// x / rms(x) * w over n values (a multiple of 32), written as f32 to out (QUANT false) or
// quantized for `mode` to xq; one block, a warp per group of 256 (the host launches
// ceil(n / 256) warps, at most 32; more groups go round again). A lane's 8 values of x and w
// are loaded together before the sum, so the weights' latency hides behind it and the values
// are not read twice.
template <bool QUANT>
__device__ __forceinline__ void rms_norm_groups(const float* x, const float* w, float* out,
                                                u8* xq, int n, float eps, int mode,
                                                u16* out16 = nullptr) {
    step_begin();
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int j0 = 256 * warp + 8 * lane;
    float xv[8], wv[8];
    load8(x + j0, j0 < n, xv);
    load8(w + j0, j0 < n, wv);
    double s = 0.0;
#pragma unroll
    for (int i = 0; i < 8; i++) s += (double)(xv[i] * xv[i]);
    for (int g = warp + nw; 256 * g < n; g += nw) {
        float v[8];
        int j = 256 * g + 8 * lane;
        load8(x + j, j < n, v);
#pragma unroll
        for (int i = 0; i < 8; i++) s += (double)(v[i] * v[i]);
    }
    float scale = rms_scale(s, n, eps);
    for (int g = warp; 256 * g < n; g += nw) {
        int j = 256 * g + 8 * lane;
        if (g != warp) {
            load8(x + j, j < n, xv);
            load8(w + j, j < n, wv);
        }
        float v[8];
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = (xv[i] * scale) * wv[i];
        if constexpr (QUANT) {
            quantize_group(v, xq, n, g, mode);
            if (out && j < n) store8(out + j, v);
            if (out16 && j < n) {
                uint4 hv;
                hv.x = (u32)f2h(v[0]) | ((u32)f2h(v[1]) << 16);
                hv.y = (u32)f2h(v[2]) | ((u32)f2h(v[3]) << 16);
                hv.z = (u32)f2h(v[4]) | ((u32)f2h(v[5]) << 16);
                hv.w = (u32)f2h(v[6]) | ((u32)f2h(v[7]) << 16);
                *(uint4*)(out16 + j) = hv;
            }
        } else if (j < n) {
            store8(out + j, v);
        }
    }
}

extern "C" __global__ void rms_norm(const float* x, const float* w, float* out, int n, float eps) {
    rms_norm_groups<false>(x, w, out, nullptr, n, eps, 0);
}

extern "C" __global__ void rms_norm_q(const float* x, const float* w, u8* xq, int n, float eps,
                                      int mode) {
    rms_norm_groups<true>(x, w, nullptr, xq, n, eps, mode);
}

// rms_norm and rms_norm_q in one launch: the normed values in f32 (out) and quantized (xq), for
// a mixture of experts whose router reads the one and other products the other.
extern "C" __global__ void rms_norm_fq(const float* x, const float* w, float* out, u8* xq, int n,
                                       float eps, int mode) {
    rms_norm_groups<true>(x, w, out, xq, n, eps, mode);
}

// Row blockIdx.x of a batched step's residual stream normed as rms_norm_q norms one token's,
// quantized from f32 into xq's row (quantize_rows_f16's layout: the mmq_* products' input, as
// the CPU quantizes it) and written as f16 for the other products.
extern "C" __global__ void rms_norm_rows_q(const float* x, const float* w, u16* out, u8* xq,
                                           int n, float eps, int mode) {
    size_t r = blockIdx.x;
    rms_norm_groups<true>(x + r * n, w, nullptr, xq + r * (n + 8 * (n / 32)), n, eps, mode,
                          out + r * n);
}

// YaRN's angle of pair i (plan.rs, YarnRamp): the unscaled angle `extrap` mixed with the
// scaled one by the ramp between the correction dimensions low and high, times ext.
__device__ __forceinline__ float yarn_angle(float extrap, float freq_scale, int i, float ext,
                                            float low, float high) {
    float interp = freq_scale * extrap;
    if (ext == 0.f) return interp;
    float y = ((float)i - low) / fmaxf(high - low, 0.001f);
    float mix = (1.f - fminf(fmaxf(y, 0.f), 1.f)) * ext;
    return fmaf(interp, 1.f - mix, extrap * mix);
}

// A layer's rotation as rope_store takes it.
struct RopeArgs {
    int n_dims, neox;
    float theta_scale, freq_scale;
    const float* freq_factors;
    float eps, mscale, ext, low, high;
};

// head[0..hd) = a head's hd values src (+ bias), through the optional per-head RMS norm
// (weights nw: the Q/K norm), then rotated at position p; by the whole block.
__device__ __forceinline__ void rope_values(const float* src, const float* bias,
                                            const float* nw, float* head, int p, int hd,
                                            const RopeArgs& r) {
    for (int i = threadIdx.x; i < hd; i += blockDim.x) head[i] = src[i] + (bias ? bias[i] : 0.f);
    __syncthreads();
    if (nw) {
        double s = 0.0;
        for (int i = threadIdx.x; i < hd; i += blockDim.x) s += (double)(head[i] * head[i]);
        float scale = rms_scale(s, hd, r.eps);
        __syncthreads();
        for (int i = threadIdx.x; i < hd; i += blockDim.x) head[i] = (head[i] * scale) * nw[i];
    }
    __syncthreads();
    int half = r.n_dims / 2;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float a = yarn_angle(rope_angle(p, i, r.theta_scale, 1.f, r.freq_factors), r.freq_scale,
                             i, r.ext, r.low, r.high);
        int i0 = r.neox ? i : 2 * i, i1 = r.neox ? i + half : 2 * i + 1;
        float x0 = head[i0], x1 = head[i1];
        rotate_pair(x0, x1, a, r.mscale);
        head[i0] = x0;
        head[i1] = x1;
    }
    __syncthreads();
}

// Block b of a token's heads: b < n_head rotates query head b in place; otherwise it rotates
// key head h = b - n_head and stores it, and value head h, as f16 at position p of the caches
// ([pos][n_head_kv * hd]). Biases (optional) are added first, then the optional per-head RMS
// norm (Q/K norm), then the rotation.
__device__ __forceinline__ void rope_head(float* q, const float* k, const float* v,
                                          const float* q_bias, const float* k_bias,
                                          const float* v_bias, const float* q_norm,
                                          const float* k_norm, u16* kc, u16* vc, int p, int b,
                                          int n_head, int n_head_kv, int hd, int n_dims, int neox,
                                          float theta_scale, float freq_scale,
                                          const float* freq_factors, float eps, float mscale,
                                          float ext, float low, float high) {
    __shared__ float head[512];
    bool is_q = b < n_head;
    int h = is_q ? b : b - n_head;
    const float* src = is_q ? q + h * hd : k + h * hd;
    const float* bias = is_q ? q_bias : k_bias;
    RopeArgs r{n_dims, neox, theta_scale, freq_scale, freq_factors, eps, mscale, ext, low, high};
    rope_values(src, bias ? bias + h * hd : nullptr, is_q ? q_norm : k_norm, head, p, hd, r);
    if (is_q) {
        for (int i = threadIdx.x; i < hd; i += blockDim.x) q[h * hd + i] = head[i];
    } else {
        size_t row = (size_t)p * n_head_kv * hd + (size_t)h * hd;
        for (int i = threadIdx.x; i < hd; i += blockDim.x) {
            kc[row + i] = f2h(head[i]);
            vc[row + i] = f2h(v[h * hd + i] + (v_bias ? v_bias[h * hd + i] : 0.f));
        }
    }
}

// The decode step's token at position *pos: one block per head (queries, then keys).
extern "C" __global__ void rope_store(float* q, const float* k, const float* v,
                                      const float* q_norm, const float* k_norm, u16* kc, u16* vc,
                                      const u32* pos, int n_head, int n_head_kv, int hd,
                                      int n_dims, int neox, float theta_scale, float freq_scale,
                                      const float* freq_factors, float eps, float mscale,
                                      float ext, float low, float high) {
    step_begin();
    rope_head(q, k, v, 0, 0, 0, q_norm, k_norm, kc, vc, (int)*pos, blockIdx.x, n_head, n_head_kv,
              hd, n_dims, neox, theta_scale, freq_scale, freq_factors, eps, mscale, ext, low,
              high);
}

#define MAX_EPL 8

// An attention score `s` (already scaled) under Gemma 2's soft cap: tanh(s / cap) * cap, the
// division a multiplication by 1 / cap as the CPU does it; cap 0: no cap.
__device__ __forceinline__ float soft_cap(float s, float cap) {
    return cap > 0.f ? tanhf(s * (1.f / cap)) * cap : s;
}

// The positions a decode attention block takes at a time, one a thread (128 threads).
#define ATTN_TILE 128

// The 8 values of a 16-byte word of halfs, dotted with f[0..8].
__device__ __forceinline__ float dot8_half(const float* f, uint4 w) {
    u32 ws[4] = {w.x, w.y, w.z, w.w};
    float d = 0.f;
#pragma unroll
    for (int k = 0; k < 4; k++) {
        d += f[2 * k] * h2f((u16)(ws[k] & 0xffff));
        d += f[2 * k + 1] * h2f((u16)(ws[k] >> 16));
    }
    return d;
}

// Word g (16 bytes) of the cache rows t0 + pg + P * (i0 + b), b < 8, of a head at kv_off:
// zeros for lanes past the row's words, for i0 + b past G and for rows past the tile's n.
__device__ __forceinline__ void cache_words8(const u16* cache, int stride, int kv_off, int t0,
                                             int i0, int pg, int P, int G, int g, bool word,
                                             int n, uint4* w) {
#pragma unroll
    for (int b = 0; b < 8; b++) {
        int j = pg + P * (i0 + b);
        w[b] = word && i0 + b < G && j < n
                   ? *(const uint4*)(cache + (size_t)(t0 + j) * stride + kv_off + 8 * g)
                   : make_uint4(0, 0, 0, 0);
    }
}

// A block of 128 threads attends the query head qh (hd floats, rounded to f16 as the CPU
// rounds them) over cache positions [start, end), ATTN_TILE positions at a time. A cache row
// of hd halfs is ng = hd / 8 words of 16 bytes; G lanes (ng rounded up to a power of two) take
// one row, word g each, so a block reads P = 128 / G rows at once and each thread's G rows of a
// tile are independent loads, issued 8 at a time. Scores are the G lanes' partial dots summed
// across the group; the block takes the tile's max and the exponentials' sum; values are
// weighted and summed the same way. Returns the block's max (-INFINITY: no position) and sum;
// the unnormalized output lands in so[0..hd].
__device__ __forceinline__ void attend_tiles(const float* qh, const u16* kc, const u16* vc,
                                             int stride, int kv_off, int hd, int start, int end,
                                             float scale, float cap, float& m_out,
                                             float& l_out, float* so) {
    __shared__ float sp[ATTN_TILE], red[4];
    __shared__ float parts[ATTN_TILE * 8];
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    int ng = hd / 8;
    int G = ng <= 4 ? 4 : ng <= 8 ? 8 : ng <= 16 ? 16 : 32;
    int P = ATTN_TILE / G, g = tid % G, pg = tid / G;
    bool word = g < ng;
    float qv[8], acc[8];
#pragma unroll
    for (int k = 0; k < 8; k++) {
        qv[k] = word ? h2f(f2h(qh[8 * g + k])) : 0.f;
        acc[k] = 0.f;
    }
    float m = -INFINITY, l = 0.f;
    for (int t0 = start; t0 < end; t0 += ATTN_TILE) {
        int n = min(ATTN_TILE, end - t0);
        // Scores of the tile's positions pg + P * i.
        for (int i0 = 0; i0 < G; i0 += 8) {
            uint4 w[8];
            cache_words8(kc, stride, kv_off, t0, i0, pg, P, G, g, word, n, w);
#pragma unroll
            for (int b = 0; b < 8; b++) {
                float d = dot8_half(qv, w[b]);
                for (int o = G / 2; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
                int j = pg + P * (i0 + b);
                if (g == 0 && i0 + b < G && j < n) sp[j] = soft_cap(d * scale, cap);
            }
        }
        __syncthreads();
        // The tile's max, then the running max; the exponentials and their sum.
        float sc = tid < n ? sp[tid] : -INFINITY;
        float tm = warp_max(sc);
        if (lane == 0) red[warp] = tm;
        __syncthreads();
        float mn = fmaxf(m, fmaxf(fmaxf(red[0], red[1]), fmaxf(red[2], red[3])));
        float p = tid < n ? expf(sc - mn) : 0.f;
        float corr = m == -INFINITY ? 0.f : expf(m - mn);
        __syncthreads();
        sp[tid] = p;
        float ps = warp_sum(p);
        if (lane == 0) red[warp] = ps;
        __syncthreads();
        l = l * corr + (red[0] + red[1] + red[2] + red[3]);
        m = mn;
#pragma unroll
        for (int k = 0; k < 8; k++) acc[k] *= corr;
        // The values of the same positions, weighted.
        for (int i0 = 0; i0 < G; i0 += 8) {
            uint4 w[8];
            cache_words8(vc, stride, kv_off, t0, i0, pg, P, G, g, word, n, w);
#pragma unroll
            for (int b = 0; b < 8; b++) {
                int j = pg + P * (i0 + b);
                float pj = i0 + b < G && j < n ? sp[j] : 0.f;
                u32 ws[4] = {w[b].x, w[b].y, w[b].z, w[b].w};
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    acc[2 * k] += pj * h2f((u16)(ws[k] & 0xffff));
                    acc[2 * k + 1] += pj * h2f((u16)(ws[k] >> 16));
                }
            }
        }
        __syncthreads();
    }
    // Sum the P row groups' outputs.
    if (word) {
#pragma unroll
        for (int k = 0; k < 8; k++) parts[pg * hd + 8 * g + k] = acc[k];
    }
    __syncthreads();
    for (int i = tid; i < hd; i += blockDim.x) {
        float o = 0.f;
        for (int r = 0; r < P; r++) o += parts[r * hd + i];
        so[i] = o;
    }
    __syncthreads();
    m_out = m;
    l_out = l;
}

// The warps of a block at most in attn_split_warps, and the widest head it takes.
#define ATTN_WARPS 16
#define ATTN_WARPS_HD 256

// E halfs of a cache row (E = 4 or 8: one 8- or 16-byte load), as loaded.
template <int E>
struct Halfs {
    u32 w[E / 2];
};
template <int E>
__device__ __forceinline__ Halfs<E> load_halfs(const u16* p) {
    Halfs<E> h;
    if constexpr (E == 8) {
        uint4 v = *(const uint4*)p;
        h.w[0] = v.x, h.w[1] = v.y, h.w[2] = v.z, h.w[3] = v.w;
    } else {
        uint2 v = *(const uint2*)p;
        h.w[0] = v.x, h.w[1] = v.y;
    }
    return h;
}
// Value k of h.
template <int E>
__device__ __forceinline__ float half_at(const Halfs<E>& h, int k) {
    return h2f((u16)(k % 2 ? h.w[k / 2] >> 16 : h.w[k / 2] & 0xffff));
}

// attend_tiles' result by the block's warps instead of its tiles, for heads of 32 * E values:
// warp w takes positions start + w, start + w + W, ... (W warps), a group of ATTN_GROUP at a
// time, each lane holding E values of the query, the keys and the values; a score is a warp
// sum. Each warp keeps its own running max, sum and output, and the block merges them through
// `parts` (W x 32E floats). A short context's chain of dependent steps is then W times
// shorter than the tiles' (few query heads: few blocks).
#define ATTN_GROUP 4
// Position t_new (-1: none) reads its key and value from k_new and v_new (hd halfs) instead of
// the caches.
template <int E>
__device__ __forceinline__ void attend_warps(const float* qh, const u16* kc, const u16* vc,
                                             int stride, int kv_off, int start, int end,
                                             float scale, float cap, float* parts,
                                             const u16* k_new, const u16* v_new, int t_new,
                                             float& m_out, float& l_out, float* so) {
    __shared__ float wm[ATTN_WARPS], wl[ATTN_WARPS];
    constexpr int HD = 32 * E;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, W = blockDim.x >> 5;
    float qv[E], acc[E];
#pragma unroll
    for (int k = 0; k < E; k++) {
        qv[k] = h2f(f2h(qh[E * lane + k]));
        acc[k] = 0.f;
    }
    float m = -INFINITY, l = 0.f;
    for (int t0 = start + warp; t0 < end; t0 += ATTN_GROUP * W) {
        Halfs<E> kh[ATTN_GROUP], vh[ATTN_GROUP];
        float sc[ATTN_GROUP];
#pragma unroll
        for (int u = 0; u < ATTN_GROUP; u++) {
            // (a position past the end reads the last one, and counts for nothing)
            int t = min(t0 + u * W, end - 1);
            size_t at = (size_t)t * stride + kv_off + E * lane;
            kh[u] = load_halfs<E>(t == t_new ? k_new + E * lane : kc + at);
            vh[u] = load_halfs<E>(t == t_new ? v_new + E * lane : vc + at);
        }
        float mx = m;
#pragma unroll
        for (int u = 0; u < ATTN_GROUP; u++) {
            float d = 0.f;
#pragma unroll
            for (int k = 0; k < E; k++) d += qv[k] * half_at(kh[u], k);
            d = warp_sum(d);
            sc[u] = soft_cap(d * scale, cap);
            if (t0 + u * W < end) mx = fmaxf(mx, sc[u]);
        }
        float corr = m == -INFINITY ? 0.f : expf(m - mx);
        l *= corr;
#pragma unroll
        for (int k = 0; k < E; k++) acc[k] *= corr;
#pragma unroll
        for (int u = 0; u < ATTN_GROUP; u++) {
            float p = t0 + u * W < end ? expf(sc[u] - mx) : 0.f;
            l += p;
#pragma unroll
            for (int k = 0; k < E; k++) acc[k] += p * half_at(vh[u], k);
        }
        m = mx;
    }
    if (lane == 0) {
        wm[warp] = m;
        wl[warp] = l;
    }
    __syncthreads();
    float M = -INFINITY;
    for (int w = 0; w < W; w++) M = fmaxf(M, wm[w]);
    float f = m == -INFINITY ? 0.f : expf(m - M);
#pragma unroll
    for (int k = 0; k < E; k++) parts[warp * HD + E * lane + k] = acc[k] * f;
    __syncthreads();
    for (int i = threadIdx.x; i < HD; i += blockDim.x) {
        float o = 0.f;
        for (int w = 0; w < W; w++) o += parts[w * HD + i];
        so[i] = o;
    }
    float L = 0.f;
    for (int w = 0; w < W; w++)
        if (wm[w] != -INFINITY) L += wl[w] * expf(wm[w] - M);
    __syncthreads();
    m_out = M;
    l_out = L;
}

// Split-K flash decoding: block (h, s) attends query head h over its share of the positions
// 0..=*pos (the last `window` of them when window > 0). The number of splits used is chosen
// each step from the visible length, a split per `tile` positions and at most n_splits (the
// grid's width; the blocks past it return at once). With one split, the block writes
// out[h*hd..] itself; with more, each writes its unnormalized output with its max and sum, and
// the last of head h to finish (a counter per head, reset for the next step) merges them.
// WARPS: attend_warps (E = hd / 32), else attend_tiles. rope (attend_warps only): the query
// is q's raw head, rotated (and Q-normed) here, and the token's key and value are k's and v's
// raw heads, rotated and rounded here by the blocks whose split holds the new position, which
// read them from shared memory; the first query head of each KV head stores them in the
// caches (the rope_store launch this replaces).
template <bool WARPS>
__device__ __forceinline__ void attn_split_body(const float* q, u16* kc, u16* vc,
                                                const u32* pos, float* part_o, float* part_ml,
                                                u32* done, float* out, int n_head,
                                                int n_head_kv, int hd, int n_splits,
                                                float scale, float cap, int window,
                                                const float* sinks, int tile, u8* xq, int mode,
                                                const float* k = nullptr,
                                                const float* v = nullptr,
                                                const float* q_norm = nullptr,
                                                const float* k_norm = nullptr,
                                                const RopeArgs* rope = nullptr) {
    step_begin();
    __shared__ float so[256];
    __shared__ bool last;
    int h = blockIdx.x, s = blockIdx.y;
    int group = n_head / n_head_kv, kvh = h / group;
    int len = (int)*pos + 1;
    int lo = window > 0 ? max(0, len - window) : 0;
    int ns = min(n_splits, (len - lo + tile - 1) / tile);
    if (s >= ns) return;
    int chunk = (len - lo + ns - 1) / ns;
    int start = lo + s * chunk, end = min(start + chunk, len);
    float M, L;
    if constexpr (WARPS) {
        __shared__ float parts[ATTN_WARPS * ATTN_WARPS_HD];
        __shared__ float qr[ATTN_WARPS_HD], kr[ATTN_WARPS_HD];
        __shared__ __align__(16) u16 k_new[ATTN_WARPS_HD], v_new[ATTN_WARPS_HD];
        const float* qh = q + h * hd;
        int t_new = -1;
        if (rope) {
            rope_values(qh, nullptr, q_norm, qr, len - 1, hd, *rope);
            qh = qr;
            if (end == len) {
                rope_values(k + kvh * hd, nullptr, k_norm, kr, len - 1, hd, *rope);
                for (int i = threadIdx.x; i < hd; i += blockDim.x) {
                    k_new[i] = f2h(kr[i]);
                    v_new[i] = f2h(v[kvh * hd + i]);
                }
                __syncthreads();
                t_new = len - 1;
                if (h % group == 0) {
                    size_t row = (size_t)t_new * n_head_kv * hd + (size_t)kvh * hd;
                    for (int i = threadIdx.x; i < hd; i += blockDim.x) {
                        kc[row + i] = k_new[i];
                        vc[row + i] = v_new[i];
                    }
                }
            }
        }
        if (hd == 256)
            attend_warps<8>(qh, kc, vc, n_head_kv * hd, kvh * hd, start, end, scale, cap, parts,
                            k_new, v_new, t_new, M, L, so);
        else
            attend_warps<4>(qh, kc, vc, n_head_kv * hd, kvh * hd, start, end, scale, cap, parts,
                            k_new, v_new, t_new, M, L, so);
    } else {
        attend_tiles(q + h * hd, kc, vc, n_head_kv * hd, kvh * hd, hd, start, end, scale, cap, M,
                     L, so);
    }
    // A sink (gpt-oss) joins the softmax as one more column with no value.
    if (ns == 1) {
        if (sinks) L += expf(sinks[h] - M);
        for (int i = threadIdx.x; i < hd; i += blockDim.x) {
            out[h * hd + i] = so[i] / L;
            if (xq) quantize_lane(so[i] / L, h * hd + i, xq, n_head * hd, mode);
        }
    } else {
        size_t part = (size_t)h * n_splits + s;
        for (int i = threadIdx.x; i < hd; i += blockDim.x) part_o[part * hd + i] = so[i];
        if (threadIdx.x == 0) {
            part_ml[2 * part] = M;
            part_ml[2 * part + 1] = L;
        }
        // Publish the partials, then count this block in.
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) last = atomicAdd(done + h, 1u) == (u32)(ns - 1);
        __syncthreads();
        if (!last) return;
        __threadfence();
        const float* ml = part_ml + 2 * (size_t)h * n_splits;
        float MM = -INFINITY;
        for (int j = 0; j < ns; j++) MM = fmaxf(MM, __ldcg(ml + 2 * j));
        float LL = 0.f;
        for (int j = 0; j < ns; j++) {
            float m = __ldcg(ml + 2 * j);
            if (m != -INFINITY) LL += __ldcg(ml + 2 * j + 1) * expf(m - MM);
        }
        if (sinks) LL += expf(sinks[h] - MM);
        for (int i = threadIdx.x; i < hd; i += blockDim.x) {
            float o = 0.f;
            for (int j = 0; j < ns; j++) {
                float m = __ldcg(ml + 2 * j);
                if (m != -INFINITY)
                    o += __ldcg(part_o + ((size_t)h * n_splits + j) * hd + i) * expf(m - MM);
            }
            out[h * hd + i] = o / LL;
            if (xq) quantize_lane(o / LL, h * hd + i, xq, n_head * hd, mode);
        }
        if (threadIdx.x == 0) done[h] = 0;
    }
}

// attn_split_body with the tiles: 128 threads (ATTN_TILE). xq non-null: the output quantized
// into it too (quantize_lane's modes).
extern "C" __global__ void attn_split(const float* q, u16* kc, u16* vc, const u32* pos,
                                      float* part_o, float* part_ml, u32* done, float* out,
                                      int n_head, int n_head_kv, int hd, int n_splits,
                                      float scale, float cap, int window, const float* sinks,
                                      int tile, u8* xq, int mode) {
    attn_split_body<false>(q, kc, vc, pos, part_o, part_ml, done, out, n_head, n_head_kv, hd,
                           n_splits, scale, cap, window, sinks, tile, xq, mode);
}

// attn_split_body with the warps: heads of 128 or 256 values, up to ATTN_WARPS warps.
extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32)
    attn_split_warps(const float* q, u16* kc, u16* vc, const u32* pos, float* part_o,
                     float* part_ml, u32* done, float* out, int n_head, int n_head_kv, int hd,
                     int n_splits, float scale, float cap, int window, const float* sinks,
                     int tile, u8* xq, int mode) {
    attn_split_body<true>(q, kc, vc, pos, part_o, part_ml, done, out, n_head, n_head_kv, hd,
                          n_splits, scale, cap, window, sinks, tile, xq, mode);
}

// attn_split_warps with the token's rotation and cache store (rope_store's work) done here: q,
// k and v the products' raw heads; then rope_store's arguments from q_norm on.
extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32)
    attn_rope_split_warps(const float* q, u16* kc, u16* vc, const u32* pos, float* part_o,
                          float* part_ml, u32* done, float* out, int n_head, int n_head_kv,
                          int hd, int n_splits, float scale, float cap, int window,
                          const float* sinks, int tile, u8* xq, int mode, const float* k,
                          const float* v, const float* q_norm, const float* k_norm, int n_dims,
                          int neox, float theta_scale, float freq_scale,
                          const float* freq_factors, float eps, float mscale, float ext,
                          float low, float high) {
    RopeArgs r{n_dims, neox, theta_scale, freq_scale, freq_factors, eps, mscale, ext, low, high};
    attn_split_body<true>(q, kc, vc, pos, part_o, part_ml, done, out, n_head, n_head_kv, hd,
                          n_splits, scale, cap, window, sinks, tile, xq, mode, k, v, q_norm,
                          k_norm, &r);
}

// out = swiglu_oai(g, u) (gpt-oss).
extern "C" __global__ void swiglu_oai(const float* g, const float* u, float* out, int n) {
    step_begin();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = swiglu_oai_f(g[i], u[i]);
}

// y[j * rows + r] += bias[ids[j] * rows + r]: each chosen expert's bias (gpt-oss) added to its
// product's rows; grid (ceil(rows / 256), k).
extern "C" __global__ void moe_add_bias(float* y, const float* bias, const u32* ids, int rows) {
    step_begin();
    int r = blockIdx.x * blockDim.x + threadIdx.x, j = blockIdx.y;
    if (r < rows) y[(size_t)j * rows + r] += bias[(size_t)ids[j] * rows + r];
}

// out = silu(g) * u.
extern "C" __global__ void swiglu(const float* g, const float* u, float* out, int n) {
    step_begin();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float x = g[i];
        out[i] = x / (1.f + expf(-x)) * u[i];
    }
}

// The first index of the largest of n logits, in thread 0 of the block (1024 threads).
__device__ __forceinline__ u32 block_argmax(const float* logits, int n) {
    __shared__ float sv[32];
    __shared__ int si[32];
    float best = -INFINITY;
    int bi = 0x7fffffff;
    // Four values a load and four loads in flight: one pass over a large vocabulary is bound
    // by how many loads wait at once, not by the compares.
    // (a row of a prompt's logits may start off the 16-byte grid: then one value a load)
    int n4 = ((size_t)logits & 15) == 0 ? n / 4 : 0, step = blockDim.x;
    const float4* l4 = (const float4*)logits;
    for (int i0 = threadIdx.x; i0 < n4; i0 += 4 * step) {
        float4 v[4];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            int i = i0 + u * step;
            v[u] = i < n4 ? l4[i] : make_float4(-INFINITY, -INFINITY, -INFINITY, -INFINITY);
        }
#pragma unroll
        for (int u = 0; u < 4; u++) {
            int i = 4 * (i0 + u * step);
            float e[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
#pragma unroll
            for (int k = 0; k < 4; k++)
                if (e[k] > best || (e[k] == best && i + k < bi)) { best = e[k]; bi = i + k; }
        }
    }
    for (int i = 4 * n4 + threadIdx.x; i < n; i += step) {
        float v = logits[i];
        if (v > best || (v == best && i < bi)) { best = v; bi = i; }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, best, o);
        int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ov > best || (ov == best && oi < bi)) { best = ov; bi = oi; }
    }
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) { sv[warp] = best; si[warp] = bi; }
    __syncthreads();
    if (warp == 0) {
        int nw = blockDim.x >> 5;
        best = lane < nw ? sv[lane] : -INFINITY;
        bi = lane < nw ? si[lane] : 0x7fffffff;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, best, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > best || (ov == best && oi < bi)) { best = ov; bi = oi; }
        }
    }
    return bi == 0x7fffffff ? 0u : (u32)bi;
}

// ---- choosing the next token on the device ----
//
// cfg (device memory, so that a captured step needs no re-capture when it changes): k = 0 is
// greedy; otherwise the CPU sampler's chain (ferrolm-engine's Sampler): the k most likely
// (ties: the lower id), sorted; top-p and min-p on their probabilities at temperature 1; the
// draw draws[*draw_idx] (the host's generator, in the order the CPU sampler would draw) over
// their probabilities at the temperature. The first k is found by a radix select on the
// logits' bits, the tail (at most SAMPLE_MAX_K candidates) by one thread in the CPU's order.
struct SampleCfg {
    int k;
    float top_p;
    float min_p;
    float temperature;
    int n_draws;
};

#define SAMPLE_MAX_K 256
#define SAMPLE_CAND 1024

// Larger float -> larger key.
__device__ __forceinline__ u32 order_key(float f) {
    u32 b = __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ u32 sample_tail(const float* logits, int n, const SampleCfg* cfg, const float* draws,
                           u32* draw_idx) {
    __shared__ u32 hist[256];
    __shared__ u32 s_prefix, s_need;
    __shared__ float cand_l[SAMPLE_CAND];
    __shared__ int cand_i[SAMPLE_CAND];
    __shared__ u32 n_cand;
    __shared__ u32 chosen;
    int tid = threadIdx.x, nt = blockDim.x;
    int k = min(cfg->k, min(n, SAMPLE_MAX_K));
    if (tid == 0) {
        s_prefix = 0;
        s_need = (u32)k;
        n_cand = 0;
    }
    u32 mask = 0;
    // Radix select: the key of the k-th largest logit, 8 bits at a time.
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = tid; i < 256; i += nt) hist[i] = 0;
        __syncthreads();
        u32 prefix = s_prefix;
        for (int i = tid; i < n; i += nt) {
            u32 key = order_key(logits[i]);
            if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255], 1u);
        }
        __syncthreads();
        if (tid == 0) {
            u32 need = s_need, above = 0;
            int bin = 255;
            for (; bin > 0; bin--) {
                if (above + hist[bin] >= need) break;
                above += hist[bin];
            }
            s_need = need - above;
            s_prefix = prefix | ((u32)bin << shift);
        }
        mask |= 255u << shift;
        __syncthreads();
    }
    u32 kth = s_prefix;
    // Candidates: every logit above the k-th, and those equal to it (the lowest ids kept by
    // the sort below).
    for (int i = tid; i < n; i += nt) {
        u32 key = order_key(logits[i]);
        if (key >= kth) {
            u32 slot = atomicAdd(&n_cand, 1u);
            if (slot < SAMPLE_CAND) {
                cand_l[slot] = logits[i];
                cand_i[slot] = i;
            }
        }
    }
    __syncthreads();
    int m = (int)min(n_cand, (u32)SAMPLE_CAND);
    for (int i = m + tid; i < SAMPLE_CAND; i += nt) {
        cand_l[i] = -INFINITY;
        cand_i[i] = 0x7fffffff;
    }
    __syncthreads();
    // Bitonic sort, largest logit first, then the lower id.
    for (int size = 2; size <= SAMPLE_CAND; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int i = tid; i < SAMPLE_CAND; i += nt) {
                int j = i ^ stride;
                if (j > i) {
                    bool desc = (i & size) == 0;
                    float li = cand_l[i], lj = cand_l[j];
                    int ii = cand_i[i], ij = cand_i[j];
                    bool i_first = li > lj || (li == lj && ii < ij);
                    if (desc != i_first) {
                        cand_l[i] = lj; cand_l[j] = li;
                        cand_i[i] = ij; cand_i[j] = ii;
                    }
                }
            }
            __syncthreads();
        }
    }
    if (tid == 0) {
        int c = min(k, m);
        // Probabilities at temperature 1 (the CPU's order of operations).
        float mx = cand_l[0], sum = 0.f;
        for (int i = 0; i < c; i++) sum += expf(cand_l[i] - mx);
        int keep = c;
        if (cfg->top_p < 1.f) {
            float cum = 0.f;
            for (int i = 0; i < c; i++) {
                cum += expf(cand_l[i] - mx) / sum;
                if (cum >= cfg->top_p) {
                    keep = i + 1;
                    break;
                }
            }
        }
        if (cfg->min_p > 0.f) {
            float floor = cfg->min_p * (1.f / sum);
            int n_ok = 0;
            while (n_ok < c && expf(cand_l[n_ok] - mx) / sum >= floor) n_ok++;
            keep = min(keep, max(n_ok, 1));
        }
        keep = max(keep, 1);
        float t = cfg->temperature, sum_t = 0.f;
        for (int i = 0; i < keep; i++) sum_t += expf((cand_l[i] - mx) / t);
        float r = draws[*draw_idx % (u32)max(cfg->n_draws, 1)];
        *draw_idx += 1;
        float cum = 0.f;
        int pick = keep - 1;
        for (int i = 0; i < keep; i++) {
            cum += expf((cand_l[i] - mx) / t) / sum_t;
            if (r < cum) {
                pick = i;
                break;
            }
        }
        chosen = (u32)cand_i[pick];
    }
    __syncthreads();
    return chosen;
}

// Slots of the host's ring of chosen ids (a power of two).
#define TOKEN_RING 4

// The next token (greedy, or drawn as cfg says) into *token, and (ring, mapped host memory, and
// pos present) into ring[*pos % TOKEN_RING], where the host reads it without a copy; with
// advance, *pos += 1: the next replay of the step reads both. One block of 1024 threads.
extern "C" __global__ void choose_token(const float* logits, int n, u32* token, u32* pos,
                                        int advance, const SampleCfg* cfg, const float* draws,
                                        u32* draw_idx, u32* ring) {
    step_begin();
    u32 id = cfg->k > 0 ? sample_tail(logits, n, cfg, draws, draw_idx) : block_argmax(logits, n);
    if (threadIdx.x == 0) {
        *token = id;
        if (ring && pos) {
            ring[*pos & (TOKEN_RING - 1)] = id;
            __threadfence_system();
        }
        if (advance) *pos += 1;
    }
}

// *pos += 1 (a step of the first layers only, whose output head runs on the CPU).
extern "C" __global__ void advance_pos(u32* pos) {
    step_begin();
    if (threadIdx.x == 0) *pos += 1;
}


// ---- a prompt as one batch of n tokens: matrices dequantized to f16 for cuBLAS ----

// out (f16, rows x 32 n_chunks, row-major) = W dequantized: a thread per chunk of 32.
template <typename T>
__device__ __forceinline__ void dequant_f16(const u8* __restrict__ W, int row_bytes,
                                            int n_chunks, long long total, u16* out) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= total) return;
    long long r = i / n_chunks;
    int c = (int)(i - r * n_chunks);
    float w[32];
    T::load(W + r * row_bytes, c, n_chunks, w);
    uint4* o = (uint4*)(out + i * 32);
#pragma unroll
    for (int k = 0; k < 4; k++) {
        u32 h[4];
#pragma unroll
        for (int j = 0; j < 4; j++)
            h[j] = (u32)f2h(w[8 * k + 2 * j]) | ((u32)f2h(w[8 * k + 2 * j + 1]) << 16);
        uint4 v;
        v.x = h[0]; v.y = h[1]; v.z = h[2]; v.w = h[3];
        o[k] = v;
    }
}

// x[t][..] = row ids[t] of the embedding table: block (chunk group, token t).
template <typename T>
__device__ __forceinline__ void embed_rows(const u8* __restrict__ table, int row_bytes,
                                           int n_chunks, const u32* ids, float* x) {
    int t = blockIdx.y;
    embed<T>(table, row_bytes, n_chunks, ids + t, x + (size_t)t * n_chunks * 32);
}

#define FOR_TYPE_BATCH(T)                                                                        \
    extern "C" __global__ void dequant_f16_##T(const u8* W, int row_bytes, int n_chunks,        \
                                               long long total, u16* out) { step_begin();        \
        dequant_f16<T>(W, row_bytes, n_chunks, total, out);                                      \
    }                                                                                            \
    extern "C" __global__ void embed_rows_##T(const u8* table, int row_bytes, int n_chunks,     \
                                              const u32* ids, float* x) { step_begin();          \
        embed_rows<T>(table, row_bytes, n_chunks, ids, x);                                       \
    }

// The block types of kernels_iquants.cu (both lists below take them).
#define IQUANT_TYPES(X) \
    X(IQ2_XXS) \
    X(IQ2_XS) \
    X(IQ2_S) \
    X(IQ3_XXS) \
    X(IQ3_S) \
    X(IQ1_S) \
    X(IQ1_M) \
    X(IQ4_XS) \
    X(TQ1_0) \
    X(TQ2_0) \
    X(Q1_0) \
    X(Q2_0) \
    X(NVFP4)

// Every block type the kernels read, once: each instantiates the decode kernels (FOR_TYPE)
// and the prompt-batch kernels (FOR_TYPE_BATCH); `schedule::kernel_type` names the same list.
#define ALL_TYPES(X) \
    X(F32) \
    X(F16) \
    X(Q8_0) \
    X(Q4_0) \
    X(Q4_1) \
    X(Q5_0) \
    X(Q5_1) \
    X(Q4_K) \
    X(Q6_K) \
    X(BF16) \
    X(IQ4_NL) \
    X(MXFP4) \
    X(Q2_K) \
    X(Q3_K) \
    X(Q5_K) \
    IQUANT_TYPES(X) \
    X(Q8_0R) \
    X(Q6_KR)

ALL_TYPES(FOR_TYPE)
ALL_TYPES(FOR_TYPE_BATCH)

// The block types whose rows multiply quantized activations (`schedule::activation_format`
// names the same list).
#define QUANTIZED_TYPES(X) \
    X(Q8_0) \
    X(Q4_0) \
    X(Q4_1) \
    X(Q5_0) \
    X(Q5_1) \
    X(Q4_K) \
    X(Q6_K) \
    X(IQ4_NL) \
    X(MXFP4) \
    X(Q2_K) \
    X(Q3_K) \
    X(Q5_K) \
    IQUANT_TYPES(X) \
    X(Q8_0R) \
    X(Q6_KR)

QUANTIZED_TYPES(FOR_QTYPE)
// Types whose products stage their rows (a fetch<SHARED> in the type).
FOR_PRODUCTS(Q4_K, true, s_Q4_K, true)
FOR_PRODUCTS(Q6_KR, true, s_Q6_KR, true)
FOR_PRODUCTS(Q8_0R, true, s_Q8_0R, true)
FOR_PRODUCTS(Q4_0, true, s_Q4_0, true)

// Q and K of type T0 and V of type T1 in one launch (llama-quantize's mixes give V more bits
// in some layers): matvec3 and matvec3r with V's blocks reading rows of rb1 bytes as T1. The
// host launches them only where the Q and K rows fill whole blocks (r0 + r1 a multiple of
// ROWS), so that a block's rows are all of one type; their input format is shared. Arguments
// as matvec3's and matvec3r's, then rb1.
#define MIXED_QKV(T0, T1, S, ST0, ST1)                                                           \
    extern "C" __global__ void matvec3##S(const u8* W0, const u8* W1, const u8* W2, int r0,     \
                                          int r1, int r2, int rb0, int n_chunks, const void* x,  \
                                          const float* b0, const float* b1, const float* b2,     \
                                          float* y0, float* y1, float* y2, int rb1) {            \
        if ((int)blockIdx.x * ROWS < r0 + r1)                                                    \
            matvec3<T0, true, ST0>(W0, W1, W2, r0, r1, r2, rb0, n_chunks, x, b0, b1, b2, y0, y1, \
                                   y2);                                                          \
        else                                                                                     \
            matvec3<T1, true, ST1>(W0, W1, W2, r0, r1, r2, rb1, n_chunks, x, b0, b1, b2, y0, y1, \
                                   y2);                                                          \
    }                                                                                            \
    extern "C" __global__ void matvec3r##S(                                                      \
        const u8* W0, const u8* W1, const u8* W2, int r0, int r1, int r2, int rb0, int n_chunks, \
        const void* x, const float* b0, const float* b1, const float* b2, float* y0, u16* kc,    \
        u16* vc, const u32* pos, int kv_dim, int hd, int n_dims, float theta_scale,              \
        float freq_scale, const float* freq_factors, int rb1) {                                  \
        if ((int)blockIdx.x * ROWS < r0 + r1)                                                    \
            matvec3_rope<T0, true, ST0>(blockIdx.x, W0, W1, W2, r0, r1, r2, rb0, n_chunks, x,    \
                                        b0, b1, b2, y0, kc, vc, pos, kv_dim, hd, n_dims,         \
                                        theta_scale, freq_scale, freq_factors);                  \
        else                                                                                     \
            matvec3_rope<T1, true, ST1>(blockIdx.x, W0, W1, W2, r0, r1, r2, rb1, n_chunks, x,    \
                                        b0, b1, b2, y0, kc, vc, pos, kv_dim, hd, n_dims,         \
                                        theta_scale, freq_scale, freq_factors);                  \
    }

// (`schedule::MIXED_QKV` lists the same pairs)
MIXED_QKV(Q5_0, Q8_0, q_Q5_0_Q8_0, false, false)
MIXED_QKV(Q5_0, Q8_0R, q_Q5_0_Q8_0R, false, false)
MIXED_QKV(Q4_K, Q6_KR, q_Q4_K_Q6_KR, false, false)
MIXED_QKV(Q4_K, Q6_KR, s_Q4_K_Q6_KR, true, true)
MIXED_QKV(Q4_K, Q6_K, q_Q4_K_Q6_K, false, false)

// out[t] = x[t] / rms(x[t]) * w as f16, one block per row t of n values.
// Rows of a multiple of 4 values up to RMS_HELD * 4 * blockDim.x are read once, as float4s
// held in registers; others as single values, twice.
#define RMS_HELD 8
extern "C" __global__ void rms_norm_rows(const float* x, const float* w, u16* out, int n,
                                         float eps) {
    step_begin();
    const float* xr = x + (size_t)blockIdx.x * n;
    u16* o = out + (size_t)blockIdx.x * n;
    float s = 0.f;
    if (n % 4 == 0 && n <= RMS_HELD * 4 * (int)blockDim.x) {
        const float4* x4 = (const float4*)xr;
        float4 v[RMS_HELD];
#pragma unroll
        for (int k = 0; k < RMS_HELD; k++) {
            const int i = threadIdx.x + k * blockDim.x;
            v[k].x = v[k].y = v[k].z = v[k].w = 0.f;
            if (i < n / 4) v[k] = x4[i];
            s += v[k].x * v[k].x + v[k].y * v[k].y + v[k].z * v[k].z + v[k].w * v[k].w;
        }
        s = block_sum(s);
        const float scale = rsqrtf(s / (float)n + eps);
        const float4* w4 = (const float4*)w;
#pragma unroll
        for (int k = 0; k < RMS_HELD; k++) {
            const int i = threadIdx.x + k * blockDim.x;
            if (i < n / 4) {
                const float4 g = w4[i];
                uint2 h;
                h.x = (u32)f2h((v[k].x * scale) * g.x) | ((u32)f2h((v[k].y * scale) * g.y) << 16);
                h.y = (u32)f2h((v[k].z * scale) * g.z) | ((u32)f2h((v[k].w * scale) * g.w) << 16);
                ((uint2*)o)[i] = h;
            }
        }
        return;
    }
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += xr[i] * xr[i];
    s = block_sum(s);
    float scale = rsqrtf(s / (float)n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) o[i] = f2h((xr[i] * scale) * w[i]);
}

// rope_store for token t = blockIdx.y of a batch at position pos0 + t (Q, K, V rows of the
// batch; biases added here, the GEMMs leave them out).
extern "C" __global__ void rope_rows(float* q, const float* k, const float* v, const float* q_bias,
                                     const float* k_bias, const float* v_bias,
                                     const float* q_norm, const float* k_norm, u16* kc, u16* vc,
                                     int pos0, int n_head, int n_head_kv, int hd, int n_dims,
                                     int neox, float theta_scale, float freq_scale,
                                     const float* freq_factors, float eps, float mscale,
                                     float ext, float low, float high) {
    step_begin();
    int t = blockIdx.y;
    size_t qo = (size_t)t * n_head * hd, ko = (size_t)t * n_head_kv * hd;
    rope_head(q + qo, k + ko, v + ko, q_bias, k_bias, v_bias, q_norm, k_norm, kc, vc, pos0 + t,
              blockIdx.x, n_head, n_head_kv, hd, n_dims, neox, theta_scale, freq_scale,
              freq_factors, eps, mscale, ext, low, high);
}

// Causal attention of a batch, QT tokens per block: block (h, tile) attends query head h of
// tokens QT*tile.. (at positions pos0 + t) over the cache positions they see, key and value
// rows staged KT at a time in shared memory (as f16 pairs) and shared by the tile's queries.
// Warp w takes queries 4w..4w+3 of the tile; lane j scores staged key j; each lane owns hd/32
// output dimensions. Writes the normalized output as f16.
#define QT 16
#define KT 32
extern "C" __global__ void attn_tile(const float* q, const u16* kc, const u16* vc, u16* out,
                                     int pos0, int n_tok, int n_head, int n_head_kv, int hd,
                                     float scale, float cap, int window, const float* sinks) {
    step_begin();
    __shared__ u32 ks[KT * 129];
    __shared__ u32 vs[KT * 128];
    __shared__ u32 qs[QT * 128];
    int h = blockIdx.x, t0 = blockIdx.y * QT;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int kvh = h / (n_head / n_head_kv);
    int hp = hd / 2, kstride = hp + 1, epl = hd / 32;
    for (int i = threadIdx.x; i < QT * hp; i += blockDim.x) {
        int r = i / hp, c = i - r * hp;
        int t = t0 + r;
        u32 v = 0;
        if (t < n_tok) {
            const float* qr = q + ((size_t)t * n_head + h) * hd;
            v = (u32)f2h(qr[2 * c]) | ((u32)f2h(qr[2 * c + 1]) << 16);
        }
        qs[r * hp + c] = v;
    }
    int last = min(t0 + QT, n_tok) - 1;
    int hi = pos0 + last + 1;
    int lo = window > 0 ? max(0, pos0 + t0 + 1 - window) : 0;
    float m[4], l[4], o[4][MAX_EPL];
#pragma unroll
    for (int r = 0; r < 4; r++) {
        m[r] = -INFINITY;
        l[r] = 0.f;
#pragma unroll
        for (int e = 0; e < MAX_EPL; e++) o[r][e] = 0.f;
    }
    size_t stride = (size_t)n_head_kv * hd;
    for (int kb = lo; kb < hi; kb += KT) {
        __syncthreads();
        for (int i = threadIdx.x; i < KT * hp; i += blockDim.x) {
            int j = i / hp, c = i - j * hp;
            u32 kv = 0, vv = 0;
            if (kb + j < hi) {
                size_t row = (size_t)(kb + j) * stride + (size_t)kvh * hd;
                kv = ((const u32*)(kc + row))[c];
                vv = ((const u32*)(vc + row))[c];
            }
            ks[j * kstride + c] = kv;
            vs[j * hp + c] = vv;
        }
        __syncthreads();
        // The warp's 4 queries side by side: independent chains for the latency to hide in.
        int key = kb + lane;
        const u32* kr = ks + lane * kstride;
        const u32* qr = qs + warp * 4 * hp;
        float sc[4] = {0.f, 0.f, 0.f, 0.f};
        for (int c = 0; c < hp; c++) {
            u32 b = kr[c];
            float k0 = h2f((u16)(b & 0xffff)), k1 = h2f((u16)(b >> 16));
#pragma unroll
            for (int r = 0; r < 4; r++) {
                u32 a = qr[r * hp + c];
                sc[r] += h2f((u16)(a & 0xffff)) * k0 + h2f((u16)(a >> 16)) * k1;
            }
        }
        float pj[4];
#pragma unroll
        for (int r = 0; r < 4; r++) {
            int p = pos0 + t0 + warp * 4 + r;
            bool ok = key < hi && key <= p && (window == 0 || key > p - window);
            float v = ok ? soft_cap(sc[r] * scale, cap) : -INFINITY;
            float mn = fmaxf(m[r], warp_max(v));
            // A query past the batch, or one that sees no key of this tile, keeps its state.
            if (mn == -INFINITY) {
                pj[r] = 0.f;
                continue;
            }
            pj[r] = ok ? __expf(v - mn) : 0.f;
            float corr = __expf(m[r] - mn);
            l[r] = l[r] * corr + warp_sum(pj[r]);
#pragma unroll
            for (int e = 0; e < MAX_EPL; e++) o[r][e] *= corr;
            m[r] = mn;
        }
        int n_keys = min(KT, hi - kb);
        for (int jj = 0; jj < n_keys; jj++) {
            const u16* vr = (const u16*)(vs + jj * hp) + lane * epl;
            float v[MAX_EPL];
#pragma unroll
            for (int e = 0; e < MAX_EPL; e++) v[e] = e < epl ? h2f(vr[e]) : 0.f;
#pragma unroll
            for (int r = 0; r < 4; r++) {
                float pv = __shfl_sync(0xffffffffu, pj[r], jj);
#pragma unroll
                for (int e = 0; e < MAX_EPL; e++)
                    if (e < epl) o[r][e] += pv * v[e];
            }
        }
    }
#pragma unroll
    for (int r = 0; r < 4; r++) {
        int t = t0 + warp * 4 + r;
        if (t >= n_tok) continue;
        u16* orow = out + ((size_t)t * n_head + h) * hd + lane * epl;
        // A sink (gpt-oss): one more column of the softmax, with no value.
        float sum = sinks ? l[r] + __expf(sinks[h] - m[r]) : l[r];
#pragma unroll
        for (int e = 0; e < MAX_EPL; e++)
            if (e < epl) orow[e] = f2h(o[r][e] / sum);
    }
}

// ---- the prompt's attention on the tensor cores ----
//
// Flash attention with mma.sync m16n8k16 (f16 operands, f32 accumulation): block (h, y) takes
// query head h for FQ tokens of the batch (16 a warp), key tiles of FK positions staged in
// shared memory as f16 (the cache's own values), the query rounded to f16 as the CPU rounds
// it. S = Q K^T, the scaled and masked scores' running max and sum per row, the
// probabilities (unnormalized, rounded to f16) times V accumulated in f32, divided by the sum
// at the end. Fragment layouts: PTX ISA, "Matrix Fragments for mma.m16n8k16" (g = lane / 4,
// c = lane % 4; A: rows g, g+8, columns 2c, 2c+1 and 8 more; B: rows 2c, 2c+1 and 8 more,
// column g; C: rows g, g+8, columns 2c, 2c+1).
#define FPAD 8

__device__ __forceinline__ void mma16816(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0,
                                         u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 pack_h2(float lo, float hi) {
    return (u32)f2h(lo) | ((u32)f2h(hi) << 16);
}

// The f16 GEMMs of batched steps of at most 16 input rows, where a GEMM library's tiles are
// made for wider inputs: c[t][r] = a[t] . w[r] (+ beta c[t][r]). A block of 8 warps owns 32
// weight rows; its warps take 32-column chunks of them in turn (4 at a time, for enough loads
// in flight) and multiply them with every input row on the tensor cores (m16n8k16 tiles: two
// of weight rows by NT of 8 input rows); their f32 sums meet in shared memory, added in warp
// order. A lane reads 16 bytes (8 columns) of a row at once: its mma k positions are then a
// permutation of the columns, the same for weights and inputs, so each product sums the same
// terms. Rows and inputs past the ends read the last ones and are not written.
#define SG_ROWS 32
#define SG_WARPS 8
#define SG_UNROLL 4

// The end of skinny_gemm and dq4k_gemm: each warp's accumulators (m16n8k16 tiles: m of weight
// rows by t of inputs) through shared memory, summed in warp order, for the block's SG_ROWS of
// `rows` rows and the n inputs. Output (row rr, input cc) of the block is fragment (m, t, e) of
// lane (g, c), as mma's accumulators lie (rows g and g + 8, inputs 8t + 2c and 8t + 2c + 1).
// Each warp's accumulators into its part of shared memory, where the block's threads then
// sum them in warp order (skinny_store, dq4k_glu).
template <int NT>
__device__ __forceinline__ void park_sums(float (*part)[8 * NT][32],
                                          const float (&acc)[2][NT][4]) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
    for (int m = 0; m < 2; m++)
#pragma unroll
        for (int t = 0; t < NT; t++)
#pragma unroll
            for (int e = 0; e < 4; e++) part[warp][(m * NT + t) * 4 + e][lane] = acc[m][t][e];
    __syncthreads();
}

template <int NT, int WARPS = SG_WARPS>
__device__ __forceinline__ void skinny_store(float (*part)[8 * NT][32],
                                             const float (&acc)[2][NT][4], int r0, int rows,
                                             int n, float* C, float beta) {
    park_sums<NT>(part, acc);
    for (int o = threadIdx.x; o < SG_ROWS * 8 * NT; o += blockDim.x) {
        const int rr = o % SG_ROWS, cc = o / SG_ROWS;
        const int r = r0 + rr;
        if (r >= rows || cc >= n) continue;
        const int m = rr / 16, within = rr % 16, t = cc / 8, ct = cc % 8;
        const int slot = (m * NT + t) * 4 + (within / 8) * 2 + ct % 2;
        const int from = (within % 8) * 4 + ct / 2;
        float s = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; w++) s += part[w][slot][from];
        float* out = C + (long long)cc * rows + r;
        *out = beta != 0.f ? s + beta * *out : s;
    }
}

template <int NT>
__device__ __forceinline__ void skinny_gemm(const u16* __restrict__ W, const u16* __restrict__ A,
                                            float* C, int rows, int cols, int n, float beta) {
    __shared__ float part[SG_WARPS][8 * NT][32];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, c = lane % 4;
    const int r0 = blockIdx.x * SG_ROWS;
    const uint4* wr[4];
#pragma unroll
    for (int i = 0; i < 4; i++)
        wr[i] = (const uint4*)(W + (long long)min(r0 + g + 8 * i, rows - 1) * cols) + c;
    const uint4* ar[NT];
#pragma unroll
    for (int t = 0; t < NT; t++) ar[t] = (const uint4*)(A + (long long)min(g + 8 * t, n - 1) * cols) + c;
    float acc[2][NT][4] = {};
    const int chunks = cols / 32;
    for (int j0 = warp * SG_UNROLL; j0 < chunks; j0 += SG_WARPS * SG_UNROLL) {
        uint4 wv[SG_UNROLL][4], av[SG_UNROLL][NT];
#pragma unroll
        for (int u = 0; u < SG_UNROLL; u++) {
            if (j0 + u < chunks) {
#pragma unroll
                for (int i = 0; i < 4; i++) wv[u][i] = __ldg(wr[i] + 4 * (j0 + u));
#pragma unroll
                for (int t = 0; t < NT; t++) av[u][t] = __ldg(ar[t] + 4 * (j0 + u));
            }
        }
#pragma unroll
        for (int u = 0; u < SG_UNROLL; u++) {
            if (j0 + u < chunks) {
#pragma unroll
                for (int m = 0; m < 2; m++) {
                    const uint4 lo = wv[u][2 * m], hi = wv[u][2 * m + 1];
#pragma unroll
                    for (int t = 0; t < NT; t++) {
                        mma16816(acc[m][t], lo.x, hi.x, lo.y, hi.y, av[u][t].x, av[u][t].y);
                        mma16816(acc[m][t], lo.z, hi.z, lo.w, hi.w, av[u][t].z, av[u][t].w);
                    }
                }
            }
        }
    }
    skinny_store<NT>(part, acc, r0, rows, n, C, beta);
}

// At most 8 input rows (one tile of inputs), and at most 16 (two).
extern "C" __global__ void __launch_bounds__(SG_WARPS * 32)
    skinny_gemm_8(const u16* __restrict__ W, const u16* __restrict__ A, float* C, int rows,
                  int cols, int n, float beta) {
    step_begin();
    skinny_gemm<1>(W, A, C, rows, cols, n, beta);
}

extern "C" __global__ void __launch_bounds__(SG_WARPS * 32)
    skinny_gemm_16(const u16* __restrict__ W, const u16* __restrict__ A, float* C, int rows,
                   int cols, int n, float beta) {
    step_begin();
    skinny_gemm<2>(W, A, C, rows, cols, n, beta);
}

// Q4_K products of batched steps of at most 16 input rows, reading the quantized blocks
// (a third of the f16 copies' bytes): c[t][r] = a[t] . w[r] (+ beta c[t][r]). The block and
// warp layout is skinny_gemm's, with a 256-column super-block for a warp's step: lane (g, c)
// reads 32 bytes of its rows' 4-bit values (group c: 64 columns, two sub-blocks of 32) and
// their 16-byte header, dequantizes them to f16 in registers (d * scale and dmin * min in f32,
// as the CPU's dequantization, then q * d1 - m1 in f16 arithmetic) and multiplies them on the
// tensor cores. A 4-byte word of values gives, per nibble half, the columns (4t, 4t + 2) and
// (4t + 1, 4t + 3): those are the lane's mma k positions, and its inputs are permuted alike.
__device__ __forceinline__ void q4k_scale_min(uint4 h, int j, float& d1, float& m1) {
    const float d = h2f((u16)(h.x & 0xFFFF)), dmin = h2f((u16)(h.x >> 16));
    const int sh = 8 * (j & 3);
    const u32 y = (h.y >> sh) & 0xFF, z = (h.z >> sh) & 0xFF, w = (h.w >> sh) & 0xFF;
    // (both forms, then a mask: j differs between the lanes of a warp, and a branch on it
    // would run both sides one after the other)
    const u32 high = 0u - (u32)(j >= 4);
    const u32 sc = ((y & 63) & ~high) | (((w & 15) | ((y >> 6) << 4)) & high);
    const u32 m = ((z & 63) & ~high) | (((w >> 4) | ((z >> 6) << 4)) & high);
    d1 = d * (float)sc;
    m1 = dmin * (float)m;
}

// Two nibbles of x (bits 0 and 16 after shifting by `shift`) as an f16 pair, times the pair d
// plus the pair nm (f16 arithmetic: 1024 + q made exact by the exponent bits, 1024 taken off).
// (the two masks from the constant bank: one operand of a LOP3 besides its immediate, where a
// second immediate would take a register move each time)
__constant__ u32 q4_masks[2] = {0x000F000Fu, 0x64006400u};
__device__ __forceinline__ u32 q4_pair(u32 x, int shift, u32 d, u32 nm) {
    const u32 v = ((x >> shift) & q4_masks[0]) | q4_masks[1];
    u32 q, r;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(q) : "r"(v), "r"(0x64006400u));
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(q), "r"(d), "r"(nm));
    return r;
}

// f as an f16 pair (both halves).
__device__ __forceinline__ u32 f2h2(float f) {
    const u32 h = f2h(f);
    return h | (h << 16);
}

// prefetch non-zero: the block's weight rows asked of L2 before it waits for its predecessor
// (which a launch overlapping that predecessor lets start early: CudaTuning::batch_overlap).
// WARPS: the block's warps, each taking every WARPS-th super-block of the rows.
// A warp's sums over its super-blocks (every WARPS-th) for rows wr[0..4] (the lane's rows g,
// g + 8, g + 16, g + 24 of the block's 32) and the n inputs: acc[m][t] holds rows 16 m ..
// 16 m + 15 by inputs 8 t .. 8 t + 7, as mma lays out its accumulators.
template <int NT, int WARPS>
__device__ __forceinline__ void dq4k_sums(const u8* const (&wr)[4], int n_sb,
                                          const u16* __restrict__ A, int cols, int n,
                                          float (&acc)[2][NT][4]) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, c = lane % 4;
    const u16* ar[NT];
#pragma unroll
    for (int t = 0; t < NT; t++) ar[t] = A + (long long)min(g + 8 * t, n - 1) * cols + 64 * c;
    for (int sb = warp; sb < n_sb; sb += WARPS) {
        uint4 hd[4], qv[4][2];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const u8* b = wr[i] + sb * 144;
            hd[i] = __ldg((const uint4*)b);
            qv[i][0] = __ldg((const uint4*)(b + 16 + 32 * c));
            qv[i][1] = __ldg((const uint4*)(b + 32 + 32 * c));
        }
        uint4 av[NT][8];
#pragma unroll
        for (int t = 0; t < NT; t++)
#pragma unroll
            for (int j = 0; j < 8; j++) av[t][j] = __ldg((const uint4*)(ar[t] + sb * 256) + j);
        // Each row's two sub-blocks' (d * scale, -(dmin * min)) as f16 pairs.
        u32 dl[4], ml[4], dh[4], mh[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float d1, m1, d2, m2;
            q4k_scale_min(hd[i], 2 * c, d1, m1);
            q4k_scale_min(hd[i], 2 * c + 1, d2, m2);
            dl[i] = f2h2(d1);
            ml[i] = f2h2(-m1);
            dh[i] = f2h2(d2);
            mh[i] = f2h2(-m2);
        }
#pragma unroll
        for (int t4 = 0; t4 < 8; t4++) {
            // Word t4 of a row's 32 bytes: columns 4 t4 .. 4 t4 + 3 of both sub-blocks.
            u32 x[4];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const uint4 q = qv[i][t4 / 4];
                x[i] = (t4 % 4 == 0) ? q.x : (t4 % 4 == 1) ? q.y : (t4 % 4 == 2) ? q.z : q.w;
            }
#pragma unroll
            for (int nib = 0; nib < 2; nib++) {
                // Inputs: columns 32 half + 4 t4 .. + 3 (words (0, 1) and (2, 3)).
                u32 b01[NT], b23[NT];
#pragma unroll
                for (int t = 0; t < NT; t++) {
                    const uint4 a4 = av[t][nib * 4 + t4 / 2];
                    const u32 lo = (t4 % 2 == 0) ? a4.x : a4.z, hi = (t4 % 2 == 0) ? a4.y : a4.w;
                    b01[t] = __byte_perm(lo, hi, 0x5410);
                    b23[t] = __byte_perm(lo, hi, 0x7632);
                }
                u32 w02[4], w13[4];
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const u32 d = nib ? dh[i] : dl[i], nm = nib ? mh[i] : ml[i];
                    w02[i] = q4_pair(x[i], 4 * nib, d, nm);
                    w13[i] = q4_pair(x[i], 4 * nib + 8, d, nm);
                }
#pragma unroll
                for (int m = 0; m < 2; m++)
#pragma unroll
                    for (int t = 0; t < NT; t++)
                        mma16816(acc[m][t], w02[2 * m], w02[2 * m + 1], w13[2 * m], w13[2 * m + 1],
                                 b01[t], b23[t]);
            }
        }
    }
}

// r0: the block's first row.
template <int NT, int WARPS = SG_WARPS>
__device__ __forceinline__ void dq4k_gemm(const u8* __restrict__ W, int row_bytes, int rows,
                                          int n_sb, const u16* __restrict__ A, int cols, int n,
                                          float* C, float beta, int prefetch, int r0) {
    __shared__ float part[WARPS][8 * NT][32];
    const int g = threadIdx.x % 32 / 4;
    if (prefetch && threadIdx.x < SG_ROWS && r0 + (int)threadIdx.x < rows)
        prefetch_l2(W + (size_t)(r0 + threadIdx.x) * row_bytes, row_bytes);
    step_begin();
    const u8* wr[4];
#pragma unroll
    for (int i = 0; i < 4; i++) wr[i] = W + (long long)min(r0 + g + 8 * i, rows - 1) * row_bytes;
    float acc[2][NT][4] = {};
    dq4k_sums<NT, WARPS>(wr, n_sb, A, cols, n, acc);
    skinny_store<NT, WARPS>(part, acc, r0, rows, n, C, beta);
}

// Gate and up products with the activation after them (`CudaTuning::dq_glu`): a block takes
// 16 rows of each, gate's in the places of dq4k_gemm's rows 0-15 and up's in those of 16-31,
// sums them as dq4k_gemm does (the same f32 sums, in the same warp order) and writes
// act[t][r] = silu(g) * u (gelu: 1) in f16, as swiglu_f16 and geglu_f16 make it from those
// sums: no f32 gate and up rows, no activation launch.
template <int NT, int WARPS = SG_WARPS>
__device__ __forceinline__ void dq4k_glu(const u8* __restrict__ Wg, const u8* __restrict__ Wu,
                                         int row_bytes, int rows, int n_sb,
                                         const u16* __restrict__ A, int cols, int n, u16* act,
                                         int gelu, int prefetch) {
    __shared__ float part[WARPS][8 * NT][32];
    const int g = threadIdx.x % 32 / 4;
    const int r0 = blockIdx.x * 16;
    if (prefetch && threadIdx.x < 32 && r0 + (int)threadIdx.x % 16 < rows)
        prefetch_l2((threadIdx.x < 16 ? Wg : Wu) + (size_t)(r0 + threadIdx.x % 16) * row_bytes,
                    row_bytes);
    step_begin();
    const u8* wr[4];
#pragma unroll
    for (int i = 0; i < 4; i++)
        wr[i] = (i < 2 ? Wg : Wu) + (long long)min(r0 + g + 8 * (i % 2), rows - 1) * row_bytes;
    float acc[2][NT][4] = {};
    dq4k_sums<NT, WARPS>(wr, n_sb, A, cols, n, acc);
    park_sums<NT>(part, acc);
    for (int o = threadIdx.x; o < 16 * 8 * NT; o += blockDim.x) {
        const int rr = o % 16, cc = o / 16;
        const int r = r0 + rr;
        if (r >= rows || cc >= n) continue;
        const int t = cc / 8, ct = cc % 8;
        const int at = (rr / 8) * 2 + ct % 2, from = (rr % 8) * 4 + ct / 2;
        float sg = 0.f, su = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; w++) {
            sg += part[w][t * 4 + at][from];
            su += part[w][(NT + t) * 4 + at][from];
        }
        const float a = gelu ? gelu_table(sg) : sg / (1.f + __expf(-sg));
        act[(long long)cc * rows + r] = f2h(a * su);
    }
}

// dq4k_glu_8 and _16: one tile of 8 input rows, or two.
#define DQ4K_GLU(ROWS, NT)                                                                        \
    extern "C" __global__ void __launch_bounds__(SG_WARPS * 32) dq4k_glu_##ROWS(                  \
        const u8* __restrict__ Wg, const u8* __restrict__ Wu, int row_bytes, int rows, int n_sb, \
        const u16* __restrict__ A, int cols, int n, u16* act, int gelu, int prefetch) {          \
        dq4k_glu<NT>(Wg, Wu, row_bytes, rows, n_sb, A, cols, n, act, gelu, prefetch);            \
    }
DQ4K_GLU(8, 1)
DQ4K_GLU(16, 2)

// (An explicit `__launch_bounds__(256, 1)` takes dq4k_gemm_16 from 102 registers to 140, and
// `DQ_MIN_BLOCKS=3`'s 80 registers measured slower: docs/PERFORMANCE.md.)
#define DQ_BOUNDS __launch_bounds__(SG_WARPS * 32)

extern "C" __global__ void DQ_BOUNDS dq4k_gemm_8(const u8* __restrict__ W, int row_bytes,
                                                 int rows, int n_sb, const u16* __restrict__ A,
                                                 int cols, int n, float* C, float beta,
                                                 int prefetch) {
    dq4k_gemm<1>(W, row_bytes, rows, n_sb, A, cols, n, C, beta, prefetch,
                 blockIdx.x * SG_ROWS);
}

extern "C" __global__ void DQ_BOUNDS dq4k_gemm_16(const u8* __restrict__ W, int row_bytes,
                                                  int rows, int n_sb, const u16* __restrict__ A,
                                                  int cols, int n, float* C, float beta,
                                                  int prefetch) {
    dq4k_gemm<2>(W, row_bytes, rows, n_sb, A, cols, n, C, beta, prefetch,
                 blockIdx.x * SG_ROWS);
}

// Two or three matrices of the same input and width in one launch (Q, K and V; gate and up:
// `CudaTuning::dq_segments`): a block takes SG_ROWS rows of the matrix its index falls in,
// the first's blocks first. Fewer launches, and K and V's few blocks fill the SMs that Q's
// leave idle.
template <int NT, int WARPS = SG_WARPS>
__device__ __forceinline__ void dq4k_segments(const u8* W0, int rows0, float* C0, const u8* W1,
                                              int rows1, float* C1, const u8* W2, int rows2,
                                              float* C2, int row_bytes, int n_sb, const u16* A,
                                              int cols, int n, float beta, int prefetch) {
    const int b0 = (rows0 + SG_ROWS - 1) / SG_ROWS, b1 = (rows1 + SG_ROWS - 1) / SG_ROWS;
    const int b = blockIdx.x;
    if (b < b0)
        dq4k_gemm<NT, WARPS>(W0, row_bytes, rows0, n_sb, A, cols, n, C0, beta, prefetch,
                             b * SG_ROWS);
    else if (b < b0 + b1)
        dq4k_gemm<NT, WARPS>(W1, row_bytes, rows1, n_sb, A, cols, n, C1, beta, prefetch,
                             (b - b0) * SG_ROWS);
    else
        dq4k_gemm<NT, WARPS>(W2, row_bytes, rows2, n_sb, A, cols, n, C2, beta, prefetch,
                             (b - b0 - b1) * SG_ROWS);
}

// dq4k_gemm3_8 and _16: one tile of 8 input rows, or two.
#define DQ4K_SEGMENTS(SUFFIX, BOUNDS, NT, WARPS)                                                  \
    extern "C" __global__ void BOUNDS dq4k_gemm3_##SUFFIX(                                       \
        const u8* W0, int rows0, float* C0, const u8* W1, int rows1, float* C1, const u8* W2,   \
        int rows2, float* C2, int row_bytes, int n_sb, const u16* A, int cols, int n,           \
        float beta, int prefetch) {                                                              \
        dq4k_segments<NT, WARPS>(W0, rows0, C0, W1, rows1, C1, W2, rows2, C2, row_bytes, n_sb,  \
                                 A, cols, n, beta, prefetch);                                    \
    }
DQ4K_SEGMENTS(8, DQ_BOUNDS, 1, SG_WARPS)
DQ4K_SEGMENTS(16, DQ_BOUNDS, 2, SG_WARPS)

// The same products in a pipeline (dq_pipe: dq4k_pipe_*, and dq6k_pipe_* over Q6_KR rows): a
// block of WARPS warps takes WARPS x 32 rows
// and a run of their super-blocks (blockIdx.y: the runs split K, so that small matrices still
// fill the GPU); the super-blocks' weights and the inputs' 256 columns are copied into shared
// memory STAGES - 1 super-blocks ahead (cp.async), so loads stay in flight while the warps
// dequantize and multiply, each warp its own 32 rows of the shared inputs, as dq4k_gemm does.
// A run's sums go to `partial`; the block that finishes a row block's last run adds the runs'
// sums in run order (the same bits whatever order the blocks ran in) and writes the outputs.

// The formats the pipeline reads. ROW: the bytes of one row's super-block a stage holds,
// STAGE_PIECES of 16 bytes from `piece`; a lane's Row of them gives the f16 weight pairs of
// word t4 (columns 4t4 .. 4t4 + 3) of the half `nib` of its 64 columns: (4t4, 4t4 + 2) and
// (4t4 + 1, 4t4 + 3), as dq4k_gemm's.
struct PipeQ4K {
    static constexpr int ROW = 144, STAGE_PIECES = 9;
    static __device__ __forceinline__ const u8* piece(const u8* row, int, int sb, int part) {
        return row + sb * 144 + 16 * part;
    }
    struct Row {
        uint4 q[2];
        u32 d[2], nm[2];
        // b: the row's 144 bytes in the stage; c: the lane's 64 columns (two sub-blocks).
        __device__ __forceinline__ void load(const u8* b, int c, int) {
            const uint4 h = *(const uint4*)b;
            q[0] = *(const uint4*)(b + 16 + 32 * c);
            q[1] = *(const uint4*)(b + 32 + 32 * c);
#pragma unroll
            for (int s = 0; s < 2; s++) {
                float d1, m1;
                q4k_scale_min(h, 2 * c + s, d1, m1);
                d[s] = f2h2(d1);
                nm[s] = f2h2(-m1);
            }
        }
        __device__ __forceinline__ void load_half(const u8*, int, int) {}
        __device__ __forceinline__ void pairs(int nib, int t4, u32& w02, u32& w13) const {
            const uint4 v = q[t4 / 4];
            const u32 x = (t4 % 4 == 0) ? v.x : (t4 % 4 == 1) ? v.y : (t4 % 4 == 2) ? v.z : v.w;
            w02 = q4_pair(x, 4 * nib, d[nib], nm[nib]);
            w13 = q4_pair(x, 4 * nib + 8, d[nib], nm[nib]);
        }
    };
};

// Q6_K rows regrouped (Q6_KR: every ql, then every qh, scales and d of the row): a stage row
// of 224 bytes, the super-block's 128 ql, 64 qh and 16 scale bytes and the 16 bytes holding
// its d. Column 64c + 32 nib + l of a super-block is 6 bits from ql[64 (c / 2) + 32 nib + l]
// (the low nibble for even c, the high for odd) and qh[32 (c / 2) + l] (bits 4 (c % 2) +
// 2 nib), scaled by scale 4c + 2 nib + l / 16: the same columns of a lane as Q4_K's.
__constant__ u32 q6_masks[3] = {0x000F000Fu, 0x64006400u, 0x00030003u};
struct PipeQ6K {
    static constexpr int ROW = 224, STAGE_PIECES = 14;
    static __device__ __forceinline__ const u8* piece(const u8* row, int n_sb, int sb, int part) {
        return part < 8 ? row + 128 * sb + 16 * part
             : part < 12 ? row + 128 * n_sb + 64 * sb + 16 * (part - 8)
             : part == 12 ? row + 192 * n_sb + 16 * sb
                          : row + 208 * n_sb + 16 * (sb / 8);
    }
    struct Row {
        uint4 l[2], h[2];
        u32 dsc[4];
        int c;
        __device__ __forceinline__ void load(const u8* b, int lane_c, int sb) {
            c = lane_c;
            const float d = h2f(*(const u16*)(b + 208 + 2 * (sb % 8)));
            const u32 sc = *(const u32*)(b + 192 + 4 * c);
#pragma unroll
            for (int i = 0; i < 4; i++) dsc[i] = f2h2(d * (float)(signed char)(sc >> (8 * i)));
        }
        __device__ __forceinline__ void load_half(const u8* b, int, int nib) {
            const u8* ql = b + 64 * (c / 2) + 32 * nib;
            l[0] = *(const uint4*)ql;
            l[1] = *(const uint4*)(ql + 16);
            h[0] = *(const uint4*)(b + 128 + 32 * (c / 2));
            h[1] = *(const uint4*)(b + 144 + 32 * (c / 2));
        }
        __device__ __forceinline__ u32 pair(u32 x, u32 y, int lsh, int hsh, u32 s) const {
            const u32 lo = ((x >> lsh) & q6_masks[0]) | q6_masks[1];
            const u32 v = lo + (((y >> hsh) & q6_masks[2]) << 4);
            u32 q, r;
            asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(q) : "r"(v), "r"(0x64206420u));
            asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(q), "r"(s));
            return r;
        }
        __device__ __forceinline__ void pairs(int nib, int t4, u32& w02, u32& w13) const {
            const uint4 lv = l[t4 / 4], hv = h[t4 / 4];
            const int e = t4 % 4;
            const u32 x = e == 0 ? lv.x : e == 1 ? lv.y : e == 2 ? lv.z : lv.w;
            const u32 y = e == 0 ? hv.x : e == 1 ? hv.y : e == 2 ? hv.z : hv.w;
            const int lsh = 4 * (c % 2), hsh = 4 * (c % 2) + 2 * nib;
            const u32 s = dsc[2 * nib + t4 / 4];
            w02 = pair(x, y, lsh, hsh, s);
            w13 = pair(x, y, lsh + 8, hsh + 8, s);
        }
    };
};

template <class F, int NT, int WARPS, int STAGES>
__device__ __forceinline__ void dq_pipe(const u8* __restrict__ W, int row_bytes, int rows,
                                        int n_sb, int run, const u16* __restrict__ A, int cols,
                                        int n, float* C, float beta, float* __restrict__ partial,
                                        u32* counters) {
    constexpr int BLOCK_ROWS = 32 * WARPS, STAGE_WEIGHTS = BLOCK_ROWS * F::ROW;
    constexpr int STAGE_BYTES = STAGE_WEIGHTS + NT * 8 * 512;
    extern __shared__ __align__(16) u8 stage_mem[];
    __shared__ int last;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, c = lane % 4;
    const int r0 = blockIdx.x * BLOCK_ROWS;
    const int sb0 = blockIdx.y * run, count = min(n_sb, sb0 + run) - sb0;
    // Super-block i of the run into its stage: each row's pieces, and the inputs' 256 columns
    // as lanes read them (chunk j of 8 columns of lane (g, c): [t][j][lane]).
    auto issue = [&](int i) {
        u8* st = stage_mem + (i % STAGES) * STAGE_BYTES;
        for (int p = tid; p < BLOCK_ROWS * F::STAGE_PIECES; p += 32 * WARPS) {
            const int rr = p / F::STAGE_PIECES, part = p % F::STAGE_PIECES;
            const u8* row = W + (long long)min(r0 + rr, rows - 1) * row_bytes;
            copy16_async(st + rr * F::ROW + 16 * part, F::piece(row, n_sb, sb0 + i, part));
        }
        for (int p = tid; p < NT * 8 * 32; p += 32 * WARPS) {
            const int row = p / 32, piece = p % 32, t = row / 8, gg = row % 8;
            const int cc = piece / 8, j = piece % 8;
            copy16_async(st + STAGE_WEIGHTS + ((t * 8 + j) * 32 + gg * 4 + cc) * 16,
                       A + (long long)min(row, n - 1) * cols + (sb0 + i) * 256 + 8 * piece);
        }
    };
#pragma unroll
    for (int i = 0; i < STAGES - 1; i++) {
        if (i < count) issue(i);
        copies_issued();
    }
    float acc[2][NT][4] = {};
    for (int i = 0; i < count; i++) {
        copies_wait_but<STAGES - 2>();
        __syncthreads();
        if (i + STAGES - 1 < count) issue(i + STAGES - 1);
        copies_issued();
        const u8* st = stage_mem + (i % STAGES) * STAGE_BYTES;
        const uint4* sa = (const uint4*)(st + STAGE_WEIGHTS) + lane;
        typename F::Row wr[4];
#pragma unroll
        for (int k = 0; k < 4; k++) wr[k].load(st + (32 * warp + g + 8 * k) * F::ROW, c, sb0 + i);
#pragma unroll
        for (int nib = 0; nib < 2; nib++) {
#pragma unroll
            for (int k = 0; k < 4; k++)
                wr[k].load_half(st + (32 * warp + g + 8 * k) * F::ROW, c, nib);
#pragma unroll
            for (int j2 = 0; j2 < 4; j2++) {
                uint4 av[NT];
#pragma unroll
                for (int t = 0; t < NT; t++) av[t] = sa[(t * 8 + nib * 4 + j2) * 32];
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int t4 = 2 * j2 + h;
                    u32 b01[NT], b23[NT];
#pragma unroll
                    for (int t = 0; t < NT; t++) {
                        const u32 lo = h == 0 ? av[t].x : av[t].z, hi = h == 0 ? av[t].y : av[t].w;
                        b01[t] = __byte_perm(lo, hi, 0x5410);
                        b23[t] = __byte_perm(lo, hi, 0x7632);
                    }
                    u32 w02[4], w13[4];
#pragma unroll
                    for (int k = 0; k < 4; k++) wr[k].pairs(nib, t4, w02[k], w13[k]);
#pragma unroll
                    for (int m = 0; m < 2; m++)
#pragma unroll
                        for (int t = 0; t < NT; t++)
                            mma16816(acc[m][t], w02[2 * m], w02[2 * m + 1], w13[2 * m],
                                     w13[2 * m + 1], b01[t], b23[t]);
                }
            }
        }
    }
    // Runs past the first: every run's sums through `partial`, added by the last block.
    if (gridDim.y > 1) {
        const long long slot = ((long long)blockIdx.y * gridDim.x + blockIdx.x) * blockDim.x + tid;
        float4* mine = (float4*)partial + slot * 2 * NT;
#pragma unroll
        for (int m = 0; m < 2; m++)
#pragma unroll
            for (int t = 0; t < NT; t++) {
                const float* a = acc[m][t];
                mine[m * NT + t] = make_float4(a[0], a[1], a[2], a[3]);
            }
        __threadfence();
        __syncthreads();
        if (tid == 0) last = atomicAdd(&counters[blockIdx.x], 1u) == gridDim.y - 1;
        __syncthreads();
        if (!last) return;
        __threadfence();
#pragma unroll
        for (int m = 0; m < 2; m++)
#pragma unroll
            for (int t = 0; t < NT; t++)
#pragma unroll
                for (int e = 0; e < 4; e++) acc[m][t][e] = 0.f;
        for (int y = 0; y < (int)gridDim.y; y++) {
            const float4* theirs = (const float4*)partial +
                ((long long)y * gridDim.x + blockIdx.x) * blockDim.x * 2 * NT + tid * 2 * NT;
#pragma unroll
            for (int m = 0; m < 2; m++)
#pragma unroll
                for (int t = 0; t < NT; t++) {
                    const float4 v = __ldcg(theirs + m * NT + t);
                    acc[m][t][0] += v.x;
                    acc[m][t][1] += v.y;
                    acc[m][t][2] += v.z;
                    acc[m][t][3] += v.w;
                }
        }
        if (tid == 0) counters[blockIdx.x] = 0;
    }
    // Output (row g + 8 (e / 2) of tile m, input 2c + e % 2 of tile t) of this warp's rows.
#pragma unroll
    for (int m = 0; m < 2; m++)
#pragma unroll
        for (int t = 0; t < NT; t++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int r = r0 + 32 * warp + 16 * m + g + 8 * (e / 2), cc = 8 * t + 2 * c + e % 2;
                if (r >= rows || cc >= n) continue;
                float* out = C + (long long)cc * rows + r;
                *out = beta != 0.f ? acc[m][t][e] + beta * *out : acc[m][t][e];
            }
}

#define DQ_PIPE(NAME, FORMAT, NT, WARPS, STAGES)                                               \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                  \
        NAME(const u8* __restrict__ W, int row_bytes, int rows, int n_sb, int run,            \
             const u16* __restrict__ A, int cols, int n, float* C, float beta,                \
             float* __restrict__ partial, u32* counters) { step_begin();                      \
        dq_pipe<FORMAT, NT, WARPS, STAGES>(W, row_bytes, rows, n_sb, run, A, cols, n, C,      \
                                           beta, partial, counters);                          \
    }
// dq4k_pipe_{8,16}_{warps}x{stages}: the layouts the tuning may choose (CudaTuning::dq_pipe);
// dq6k_pipe_{8,16}: Q6_KR rows, four warps, three stages (prefill.rs: DQ6_PIPE).
DQ_PIPE(dq4k_pipe_8_4x3, PipeQ4K, 1, 4, 3)
DQ_PIPE(dq4k_pipe_16_4x3, PipeQ4K, 2, 4, 3)
DQ_PIPE(dq6k_pipe_8, PipeQ6K, 1, 4, 3)
DQ_PIPE(dq6k_pipe_16, PipeQ6K, 2, 4, 3)

template <int HD, int FQ, int FK>
__device__ __forceinline__ void attn_mma(const float* q, const u16* kc, const u16* vc, u16* out,
                                         int pos0, int n_tok, int n_head, int n_head_kv,
                                         float scale, float cap, int window,
                                         const float* sinks) {
    constexpr int ST = HD + FPAD;  // shared row stride in halfs (rows 16-byte aligned, no
                                   // bank conflicts between the 8 rows a fragment reads)
    __shared__ __align__(16) u16 qs[FQ * ST];
    __shared__ __align__(16) u16 ks[FK * ST];
    __shared__ __align__(16) u16 vs[FK * ST];
    int h = blockIdx.x;
    int t0 = (gridDim.y - 1 - blockIdx.y) * FQ;  // the blocks with the most keys first
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    int kvh = h / (n_head / n_head_kv);
    for (int i = threadIdx.x; i < FQ * HD / 2; i += blockDim.x) {
        int r = i / (HD / 2), j = i - r * (HD / 2);
        int t = t0 + r;
        u32 v = 0;
        if (t < n_tok) {
            const float* qr = q + ((size_t)t * n_head + h) * HD;
            v = pack_h2(qr[2 * j], qr[2 * j + 1]);
        }
        *(u32*)(qs + r * ST + 2 * j) = v;
    }
    int last = min(t0 + FQ, n_tok) - 1;
    int hi = pos0 + last + 1;
    int lo = window > 0 ? max(0, pos0 + t0 + 1 - window) : 0;
    float o[HD / 8][4];
#pragma unroll
    for (int n = 0; n < HD / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;
    int p0 = pos0 + t0 + warp * 16 + g, p1 = p0 + 8;  // the positions of this lane's rows
    size_t stride = (size_t)n_head_kv * HD;
    const u16* qw = qs + warp * 16 * ST;
    for (int kb = lo; kb < hi; kb += FK) {
        __syncthreads();
        constexpr int VECS = HD / 8;  // 16-byte loads a row
        for (int i = threadIdx.x; i < FK * VECS; i += blockDim.x) {
            int j = i / VECS, v = i - j * VECS;
            uint4 kv = make_uint4(0, 0, 0, 0), vv = kv;
            if (kb + j < hi) {
                size_t row = (size_t)(kb + j) * stride + (size_t)kvh * HD;
                kv = ((const uint4*)(kc + row))[v];
                vv = ((const uint4*)(vc + row))[v];
            }
            *(uint4*)(ks + j * ST + 8 * v) = kv;
            *(uint4*)(vs + j * ST + 8 * v) = vv;
        }
        __syncthreads();
        float s[FK / 8][4];
#pragma unroll
        for (int n = 0; n < FK / 8; n++) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < HD / 16; kk++) {
            const u16* qa = qw + 16 * kk + 2 * c;
            u32 a0 = *(const u32*)(qa + g * ST), a1 = *(const u32*)(qa + (g + 8) * ST);
            u32 a2 = *(const u32*)(qa + g * ST + 8), a3 = *(const u32*)(qa + (g + 8) * ST + 8);
#pragma unroll
            for (int n = 0; n < FK / 8; n++) {
                const u16* kr = ks + (n * 8 + g) * ST + 16 * kk + 2 * c;
                mma16816(s[n], a0, a1, a2, a3, *(const u32*)kr, *(const u32*)(kr + 8));
            }
        }
        // Scale and mask; the running max and sum of rows g and g + 8 (the quad's 4 lanes
        // hold a row's columns).
        float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
        for (int n = 0; n < FK / 8; n++) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                int key = kb + n * 8 + 2 * c + e;
                bool in = key < hi;
                bool ok0 = in && key <= p0 && (window == 0 || key > p0 - window);
                bool ok1 = in && key <= p1 && (window == 0 || key > p1 - window);
                s[n][e] = ok0 ? soft_cap(s[n][e] * scale, cap) : -INFINITY;
                s[n][2 + e] = ok1 ? soft_cap(s[n][2 + e] * scale, cap) : -INFINITY;
                mx0 = fmaxf(mx0, s[n][e]);
                mx1 = fmaxf(mx1, s[n][2 + e]);
            }
        }
#pragma unroll
        for (int o_ = 1; o_ <= 2; o_ <<= 1) {
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, o_));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, o_));
        }
        float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
        float c0 = mn0 == -INFINITY ? 1.f : __expf(m0 - mn0);
        float c1 = mn1 == -INFINITY ? 1.f : __expf(m1 - mn1);
        float sum0 = 0.f, sum1 = 0.f;
#pragma unroll
        for (int n = 0; n < FK / 8; n++) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                s[n][e] = s[n][e] == -INFINITY ? 0.f : __expf(s[n][e] - mn0);
                s[n][2 + e] = s[n][2 + e] == -INFINITY ? 0.f : __expf(s[n][2 + e] - mn1);
                sum0 += s[n][e];
                sum1 += s[n][2 + e];
            }
        }
#pragma unroll
        for (int o_ = 1; o_ <= 2; o_ <<= 1) {
            sum0 += __shfl_xor_sync(0xffffffffu, sum0, o_);
            sum1 += __shfl_xor_sync(0xffffffffu, sum1, o_);
        }
        l0 = l0 * c0 + sum0;
        l1 = l1 * c1 + sum1;
        m0 = mn0;
        m1 = mn1;
#pragma unroll
        for (int n = 0; n < HD / 8; n++) {
            o[n][0] *= c0;
            o[n][1] *= c0;
            o[n][2] *= c1;
            o[n][3] *= c1;
        }
        // O += P V: the score tiles 2kk and 2kk + 1 are the A fragment of keys 16kk..16kk+16.
#pragma unroll
        for (int kk = 0; kk < FK / 16; kk++) {
            u32 a0 = pack_h2(s[2 * kk][0], s[2 * kk][1]);
            u32 a1 = pack_h2(s[2 * kk][2], s[2 * kk][3]);
            u32 a2 = pack_h2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            u32 a3 = pack_h2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
            const u16* vr = vs + (16 * kk + 2 * c) * ST + g;
#pragma unroll
            for (int n = 0; n < HD / 8; n++) {
                const u16* vn = vr + 8 * n;
                u32 b0 = (u32)vn[0] | ((u32)vn[ST] << 16);
                u32 b1 = (u32)vn[8 * ST] | ((u32)vn[9 * ST] << 16);
                mma16816(o[n], a0, a1, a2, a3, b0, b1);
            }
        }
    }
    int r0 = t0 + warp * 16 + g, r1 = r0 + 8;
    // A sink (gpt-oss) joins each row's softmax as one more column with no value.
    if (sinks) {
        l0 += __expf(sinks[h] - m0);
        l1 += __expf(sinks[h] - m1);
    }
    float i0 = 1.f / l0, i1 = 1.f / l1;
#pragma unroll
    for (int n = 0; n < HD / 8; n++) {
        int d = 8 * n + 2 * c;
        if (r0 < n_tok)
            *(u32*)(out + ((size_t)r0 * n_head + h) * HD + d) = pack_h2(o[n][0] * i0, o[n][1] * i0);
        if (r1 < n_tok)
            *(u32*)(out + ((size_t)r1 * n_head + h) * HD + d) = pack_h2(o[n][2] * i1, o[n][3] * i1);
    }
}

// Heads of HD, FQ queries a block (a warp per 16), FK keys a tile: heads of 256 take half the
// queries and keys, so that the staged rows fit the 48 KB of static shared memory.
#define ATTN_MMA(HD, FQ, FK)                                                                     \
    extern "C" __global__ void __launch_bounds__(2 * FQ)                                         \
        attn_mma_##HD(const float* q, const u16* kc, const u16* vc, u16* out, int pos0,          \
                      int n_tok, int n_head, int n_head_kv, float scale, float cap,            \
                      int window, const float* sinks) { step_begin();                            \
        attn_mma<HD, FQ, FK>(q, kc, vc, out, pos0, n_tok, n_head, n_head_kv, scale, cap,        \
                             window, sinks);                                                     \
    }
ATTN_MMA(64, 64, 32)
ATTN_MMA(128, 64, 32)
ATTN_MMA(256, 32, 16)

// out = silu(g) * u as f16, over n values.
extern "C" __global__ void swiglu_f16(const float* g, const float* u, u16* out, long long n) {
    step_begin();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float x = g[i];
        out[i] = f2h(x / (1.f + __expf(-x)) * u[i]);
    }
}

// ---- Batched decode: one token of each of n sequences ("slots") per step --------------------
// Token t of the step belongs to slot slot[t] at position pos[t]; each layer's cache holds every
// slot's positions, slot s from s * slot_stride halfs on.

// rope_rows for tokens of different slots and positions.
// Token t's queries start at q + t * q_stride, its keys and values at k, v + t * kv_stride (the
// rows of separate Q, K and V products, or one fused product's (q | k | v) row per token).
extern "C" __global__ void rope_rows_slots(float* q, const float* k, const float* v,
                                           const float* q_bias, const float* k_bias,
                                           const float* v_bias, const float* q_norm,
                                           const float* k_norm, u16* kc, u16* vc, const u32* slot,
                                           const u32* pos, long long slot_stride, int q_stride,
                                           int kv_stride, int n_head, int n_head_kv, int hd,
                                           int n_dims, int neox, float theta_scale,
                                           float freq_scale, const float* freq_factors,
                                           float eps, float mscale, float ext, float low,
                                           float high) {
    step_begin();
    int t = blockIdx.y;
    size_t qo = (size_t)t * q_stride, ko = (size_t)t * kv_stride;
    size_t base = (size_t)slot[t] * (size_t)slot_stride;
    rope_head(q + qo, k + ko, v + ko, q_bias, k_bias, v_bias, q_norm, k_norm, kc + base,
              vc + base, (int)pos[t], blockIdx.x, n_head, n_head_kv, hd, n_dims, neox,
              theta_scale, freq_scale, freq_factors, eps, mscale, ext, low, high);
}

// Block (h, t): query head h of token t over its slot's positions 0..pos[t] (the decode step's
// attention, without splitting the positions: the step has a block per head and token). Writes
// the normalized output as f16, the rows the output product's GEMM reads, or, where out32 is
// given, as f32 there (to be quantized as the CPU quantizes its f32 rows, for mmq_*).
extern "C" __global__ void attn_rows(const float* q, const u16* kc, const u16* vc, u16* out,
                                     const u32* slot, const u32* pos, long long slot_stride,
                                     int q_stride, int n_head, int n_head_kv, int hd, float scale,
                                     float cap, int window, const float* sinks, float* out32) {
    step_begin();
    __shared__ float so[256];
    int h = blockIdx.x, t = blockIdx.y;
    int kvh = h / (n_head / n_head_kv);
    int len = (int)pos[t] + 1;
    int lo = window > 0 ? max(0, len - window) : 0;
    size_t base = (size_t)slot[t] * (size_t)slot_stride;
    size_t row = ((size_t)t * n_head + h) * hd;
    float M, L;
    attend_tiles(q + (size_t)t * q_stride + (size_t)h * hd, kc + base, vc + base, n_head_kv * hd,
                 kvh * hd, hd, lo, len, scale, cap, M, L, so);
    if (sinks) L += expf(sinks[h] - M);
    for (int i = threadIdx.x; i < hd; i += blockDim.x) {
        if (out32)
            out32[row + i] = so[i] / L;
        else
            out[row + i] = f2h(so[i] / L);
    }
}

// out[r] = the index of the largest of row r's n values (the first such, as the host's argmax).
extern "C" __global__ void argmax_rows(const float* x, int n, u32* out) {
    step_begin();
    __shared__ float wv[32];
    __shared__ int wi[32];
    const float* row = x + (size_t)blockIdx.x * n;
    float best = -INFINITY;
    int bi = n;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = row[i];
        if (v > best || bi == n) {
            best = v;
            bi = i;
        }
    }
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_down_sync(0xffffffffu, best, o);
        int oi = __shfl_down_sync(0xffffffffu, bi, o);
        if (ov > best || (ov == best && oi < bi) || bi == n) {
            if (oi != n) {
                best = ov;
                bi = oi;
            }
        }
    }
    if (lane == 0) {
        wv[warp] = best;
        wi[warp] = bi;
    }
    __syncthreads();
    if (warp == 0) {
        int nw = blockDim.x >> 5;
        best = lane < nw ? wv[lane] : -INFINITY;
        bi = lane < nw ? wi[lane] : n;
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_down_sync(0xffffffffu, best, o);
            int oi = __shfl_down_sync(0xffffffffu, bi, o);
            if (oi != n && (bi == n || ov > best || (ov == best && oi < bi))) {
                best = ov;
                bi = oi;
            }
        }
        if (lane == 0) out[blockIdx.x] = (u32)(bi == n ? 0 : bi);
    }
}


// The k largest of row r's n values (by value, then the lower index first: the host sampler's
// order), unsorted: their ids and values at out_ids/out_vals[r * k ..]. The k-th largest key is
// found exactly, 8 bits a pass (a histogram of the keys that match the bits found so far), then
// the row is read in index order, taking every larger key and the first equal ones. k <= n.
extern "C" __global__ void topk_rows(const float* x, int n, int k, u32* out_ids, float* out_vals) {
    step_begin();
    __shared__ u32 hist[256];
    __shared__ u32 s_prefix, s_mask, s_need, s_taken;
    __shared__ u32 warp_counts[32];
    const float* row = x + (size_t)blockIdx.x * n;
    int tid = threadIdx.x, nt = blockDim.x, lane = tid & 31, warp = tid >> 5;
    if (tid == 0) {
        s_prefix = 0;
        s_mask = 0;
        s_need = (u32)k;
        s_taken = 0;
    }
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = tid; i < 256; i += nt) hist[i] = 0;
        __syncthreads();
        u32 prefix = s_prefix, mask = s_mask;
        for (int i = tid; i < n; i += nt) {
            u32 key = order_key(row[i]);
            if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (tid == 0) {
            u32 need = s_need, cum = 0;
            for (int b = 255; b >= 0; b--) {
                if (cum + hist[b] >= need) {
                    s_need = need - cum;
                    s_prefix = prefix | ((u32)b << shift);
                    s_mask = mask | (255u << shift);
                    break;
                }
                cum += hist[b];
            }
        }
        __syncthreads();
    }
    // s_prefix: the k-th largest key; s_need: how many keys equal to it are taken.
    u32 kth = s_prefix, equal_left = s_need;
    u32* ids = out_ids + (size_t)blockIdx.x * k;
    float* vals = out_vals + (size_t)blockIdx.x * k;
    __shared__ u32 s_equal_seen;
    if (tid == 0) s_equal_seen = 0;
    __syncthreads();
    for (int base = 0; base < n; base += nt) {
        int i = base + tid;
        u32 key = i < n ? order_key(row[i]) : 0u;
        bool greater = i < n && key > kth;
        bool equal = i < n && key == kth;
        // Rank of this thread's equal key among the chunk's, in index order.
        u32 ballot = __ballot_sync(0xffffffffu, equal);
        if (lane == 0) warp_counts[warp] = __popc(ballot);
        __syncthreads();
        u32 before = 0;
        for (int w = 0; w < warp; w++) before += warp_counts[w];
        before += __popc(ballot & ((1u << lane) - 1u));
        u32 seen = s_equal_seen;
        bool take_equal = equal && seen + before < equal_left;
        if (greater || take_equal) {
            u32 at = atomicAdd(&s_taken, 1u);
            ids[at] = (u32)i;
            vals[at] = row[i];
        }
        __syncthreads();
        if (tid == 0) {
            u32 total = 0;
            for (int w = 0; w < (nt >> 5); w++) total += warp_counts[w];
            s_equal_seen = seen + total;
        }
        __syncthreads();
    }
}

// act = silu(gate) * up as f16, where row t of gu holds its gate then its up values (one fused
// product), ff of each.
extern "C" __global__ void swiglu_pairs_f16(const float* gu, u16* act, int ff, long long n) {
    step_begin();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        long long t = i / ff, j = i - t * ff;
        float x = gu[t * 2 * ff + j];
        act[i] = f2h(x / (1.f + __expf(-x)) * gu[t * 2 * ff + ff + j]);
    }
}

// swiglu_oai over n values of a batch (gpt-oss), as f16; _pairs: each row (gate | up) as
// swiglu_pairs_f16 reads it.
extern "C" __global__ void swiglu_oai_f16(const float* g, const float* u, u16* out, long long n) {
    step_begin();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = f2h(swiglu_oai_f(g[i], u[i]));
}

extern "C" __global__ void swiglu_oai_pairs_f16(const float* gu, u16* act, int ff, long long n) {
    step_begin();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        long long t = i / ff, j = i - t * ff;
        act[i] = f2h(swiglu_oai_f(gu[t * 2 * ff + j], gu[t * 2 * ff + ff + j]));
    }
}

// x[i] += bias[i % d] over n values (a batch's rows of d: gpt-oss's output and router biases,
// which the GEMMs leave out).
extern "C" __global__ void add_bias_rows(float* x, const float* bias, int d, long long n) {
    step_begin();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += bias[i % d];
}

// ---- Past the llama family: Gemma's and Granite's plan fields --------------------------------

// x *= s over n values (the embedding scale, applied to the embedded rows as the CPU does).
extern "C" __global__ void scale_f32(float* x, long long n, float s) {
    step_begin();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= s;
}

// out = gelu(g) * u over n values (Gemma's gated feed-forward, one token).
extern "C" __global__ void geglu(const float* g, const float* u, float* out, int n) {
    step_begin();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = gelu_table(g[i]) * u[i];
}

// geglu over n values of a batch, as f16 (the down product's GEMM input).
extern "C" __global__ void geglu_f16(const float* g, const float* u, u16* out, long long n) {
    step_begin();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = f2h(gelu_table(g[i]) * u[i]);
}

// geglu_f16 where row t of gu holds its gate then its up values (one fused product).
extern "C" __global__ void geglu_pairs_f16(const float* gu, u16* act, int ff, long long n) {
    step_begin();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        long long t = i / ff, j = i - t * ff;
        act[i] = f2h(gelu_table(gu[t * 2 * ff + j]) * gu[t * 2 * ff + ff + j]);
    }
}

// x[r] += (y[r] / rms(y[r]) * w) * scale for row r = blockIdx.x of n values: a block's output
// through Gemma's post-norm (w; null: none) and Granite's residual scale, then the residual
// add, in the CPU's order and with its f64 sum of squares.
__device__ __forceinline__ void post_norm_add_row(const float* y, const float* w, float* x,
                                                  int n, float eps, float scale) {
    const float* yr = y + (size_t)blockIdx.x * n;
    float* xr = x + (size_t)blockIdx.x * n;
    float r = 1.f;
    if (w) {
        double s = 0.0;
        for (int i = threadIdx.x; i < n; i += blockDim.x) s += (double)(yr[i] * yr[i]);
        r = rms_scale(s, n, eps);
    }
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = w ? (yr[i] * r) * w[i] : yr[i];
        xr[i] = __fadd_rn(xr[i], __fmul_rn(v, scale));
    }
}

extern "C" __global__ void post_norm_add(const float* y, const float* w, float* x, int n,
                                         float eps, float scale) {
    step_begin();
    post_norm_add_row(y, w, x, n, eps, scale);
}

// The residual stream's new values xv (a lane's 8, at 256 warp + 8 lane) stored into x, then
// its RMS norm (weights nv, loaded likewise) as rms_norm or rms_norm_q writes it.
template <bool QUANT>
__device__ __forceinline__ void store_and_norm_held(const float* xv, float* x, int n, float eps,
                                                    const float* nv, float* out, u8* xq,
                                                    int mode) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int j0 = 256 * warp + 8 * lane;
    bool ok = j0 < n;
    double s2 = 0.0;
#pragma unroll
    for (int i = 0; i < 8; i++) s2 += (double)(xv[i] * xv[i]);
    if (ok) store8(x + j0, xv);
    float r2 = rms_scale(s2, n, eps);
    float v[8];
#pragma unroll
    for (int i = 0; i < 8; i++) v[i] = (xv[i] * r2) * nv[i];
    if constexpr (QUANT) {
        quantize_group(v, xq, n, warp, mode);
    } else if (ok) {
        store8(out + j0, v);
    }
}

// post_norm_add and the next norm where a lane holds 8 values of each (n at most 256 x warps,
// as the host launches it): both norms' weights loaded before waiting for the previous kernel
// (they are the model's, no kernel writes them), the new residual kept in registers for the
// second norm rather than read back. The same arithmetic as post_norm_add_row, then
// rms_norm_groups (sums of squares in f64, whose order does not change the f32 result).
template <bool QUANT>
__device__ __forceinline__ void post_norm_add_norm_in_registers(const float* y, const float* w,
                                                                float* x, int n, float eps,
                                                                float scale, const float* nw,
                                                                float* out, u8* xq, int mode) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int j0 = 256 * warp + 8 * lane;
    bool ok = j0 < n;
    float pw[8], nv[8], yv[8], xv[8];
    load8(nw + j0, ok, nv);
    load8(w ? w + j0 : nw + j0, ok && w, pw);
    step_begin();
    load8(y + j0, ok, yv);
    load8(x + j0, ok, xv);
    float r = 1.f;
    if (w) {
        double s = 0.0;
#pragma unroll
        for (int i = 0; i < 8; i++) s += (double)(yv[i] * yv[i]);
        r = rms_scale(s, n, eps);
    }
#pragma unroll
    for (int i = 0; i < 8; i++) {
        float v = w ? (yv[i] * r) * pw[i] : yv[i];
        xv[i] = __fadd_rn(xv[i], __fmul_rn(v, scale));
    }
    store_and_norm_held<QUANT>(xv, x, n, eps, nv, out, xq, mode);
}

// post_norm_add (one token), then the next block's RMS norm of the residual stream (weights
// nw) as rms_norm or rms_norm_q writes it: one launch instead of two. The norm may write
// where y was: y is read before the block's threads meet.
extern "C" __global__ void post_norm_add_norm(const float* y, const float* w, float* x, int n,
                                              float eps, float scale, const float* nw,
                                              float* out) {
    step_begin();
    post_norm_add_row(y, w, x, n, eps, scale);
    __syncthreads();
    rms_norm_groups<false>(x, nw, out, nullptr, n, eps, 0);
}

extern "C" __global__ void post_norm_add_norm_q(const float* y, const float* w, float* x, int n,
                                                float eps, float scale, const float* nw, u8* xq,
                                                int mode) {
    step_begin();
    post_norm_add_row(y, w, x, n, eps, scale);
    __syncthreads();
    rms_norm_groups<true>(x, nw, nullptr, xq, n, eps, mode);
}

// The same two with post_norm_add_norm_in_registers' layout (`CudaTuning::held_post_norm`;
// the host launches them where n is at most 256 x warps).
extern "C" __global__ void post_norm_add_norm_held(const float* y, const float* w, float* x,
                                                   int n, float eps, float scale, const float* nw,
                                                   float* out) {
    post_norm_add_norm_in_registers<false>(y, w, x, n, eps, scale, nw, out, nullptr, 0);
}

extern "C" __global__ void post_norm_add_norm_held_q(const float* y, const float* w, float* x,
                                                     int n, float eps, float scale,
                                                     const float* nw, u8* xq, int mode) {
    post_norm_add_norm_in_registers<true>(y, w, x, n, eps, scale, nw, nullptr, xq, mode);
}

// The logits through Gemma 2's final soft cap (cap 0: none; inv_cap = 1 / cap as the CPU
// rounds it) and Granite's logit scale (multiplied by inv_scale = 1 / scale), over n values.
extern "C" __global__ void adjust_logits(float* x, long long n, float inv_cap, float cap,
                                         float inv_scale) {
    step_begin();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float v = x[i];
        if (cap > 0.f) v = tanhf(v * inv_cap) * cap;
        x[i] = v * inv_scale;
    }
}

// ---- Mixture of experts: routing on the device, only the chosen experts read ----------------

// The routing of one token, a block per token (ferrolm-model's cpu/routing.rs, step by step): probabilities from
// the ne router logits (gating 0 softmax, 1 sigmoid, 2 the logits themselves, softmaxed after
// the top-k), the selection bias added for choosing, experts outside the n_group_used best
// groups masked (n_group 0: no groups), the k best by selection score (ties: the lower index,
// as the CPU's stable sort), their probabilities as weights, renormalized (norm, the sum in
// f64 clamped to 2^-14) and scaled (scale 1: none). One block of at most 1024 threads, thread
// i on expert i; the softmax's sum by the block, the k weights' sums in one thread in the
// CPU's order.
// counts (when not null): how often each expert was chosen, row by row, but for the padding
// rows of a batched step (row_slots[row] == spare).
__device__ __forceinline__ void route_body(const float* logits, const float* sel_bias, u32* ids,
                                           float* weights, int ne, int k, int gating,
                                           int n_group, int n_group_used, int norm, float scale,
                                           u32* counts, bool counted) {
    __shared__ float p[1024], sel[1024], gscore[64];
    __shared__ float mx;
    __shared__ double sum;
    int i = threadIdx.x;
    // (__ldcg: in moe_route_f32 other blocks wrote them)
    float l = i < ne ? __ldcg(logits + i) : -INFINITY;
    if (gating == 0) {
        float m = warp_max(l);
        __shared__ float wm[32];
        if ((i & 31) == 0) wm[i >> 5] = m;
        __syncthreads();
        if (i == 0) {
            float t = -INFINITY;
            for (int w = 0; w < (int)(blockDim.x >> 5); w++) t = fmaxf(t, wm[w]);
            mx = t;
        }
        __syncthreads();
        // (the sum in f64 by the whole block, not one thread: with terms of 24 bits the order
        // moves only the f64 sum's last bits, below what the f32 scale taken from it keeps
        // but at a rounding boundary)
        float e = i < ne ? expf(l - mx) : 0.f;
        if (i < ne) p[i] = e;
        double s = (double)e;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        __shared__ double ws[32];
        if ((i & 31) == 0) ws[i >> 5] = s;
        __syncthreads();
        if (i < 32) {
            double t = i < (int)(blockDim.x >> 5) ? ws[i] : 0.0;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
            if (i == 0) sum = t;
        }
        __syncthreads();
        if (i < ne) p[i] *= (float)(1.0 / sum);
    } else if (gating == 1) {
        if (i < ne) p[i] = 1.f / (1.f + expf(-l));
    } else if (i < ne) {
        p[i] = l;
    }
    __syncthreads();
    if (i < ne) sel[i] = p[i] + (sel_bias ? sel_bias[i] : 0.f);
    __syncthreads();
    if (n_group > 0) {
        int per = ne / n_group;
        if (i < n_group) {
            // The group's two best, summed in f64 (ties: the lower index).
            int b0 = -1, b1 = -1;
            for (int j = i * per; j < (i + 1) * per; j++) {
                if (b0 < 0 || sel[j] > sel[b0]) { b1 = b0; b0 = j; }
                else if (b1 < 0 || sel[j] > sel[b1]) b1 = j;
            }
            double t = (double)sel[b0] + (b1 >= 0 ? (double)sel[b1] : 0.0);
            gscore[i] = (float)t;
        }
        __syncthreads();
        if (i < ne) {
            int g = i / per, rank = 0;
            for (int h = 0; h < n_group; h++)
                rank += gscore[h] > gscore[g] || (gscore[h] == gscore[g] && h < g);
            if (rank >= n_group_used) sel[i] = -INFINITY;
        }
        __syncthreads();
    }
    if (i < ne) {
        float v = sel[i];
        int rank = 0;
        for (int j = 0; j < ne; j++) rank += sel[j] > v || (sel[j] == v && j < i);
        if (rank < k) {
            ids[rank] = (u32)i;
            weights[rank] = p[i];
            if (counted) atomicAdd(counts + i, 1u);
        }
    }
    __syncthreads();
    if (i == 0) {
        if (gating == 2) {
            float m = -INFINITY;
            for (int j = 0; j < k; j++) m = fmaxf(m, weights[j]);
            double s = 0.0;
            for (int j = 0; j < k; j++) {
                weights[j] = expf(weights[j] - m);
                s += (double)weights[j];
            }
            float inv = (float)(1.0 / s);
            for (int j = 0; j < k; j++) weights[j] *= inv;
        }
        if (norm) {
            double s = 0.0;
            for (int j = 0; j < k; j++) s += (double)weights[j];
            float t = fmaxf((float)s, 6.103515625e-5f);
            for (int j = 0; j < k; j++) weights[j] /= t;
        }
        if (scale != 1.f)
            for (int j = 0; j < k; j++) weights[j] *= scale;
    }
}

extern "C" __global__ void moe_route(const float* logits, const float* sel_bias, u32* ids,
                                     float* weights, int ne, int k, int gating, int n_group,
                                     int n_group_used, int norm, float scale, u32* counts,
                                     const u32* row_slots, u32 spare) {
    step_begin();
    bool counted = counts && !(row_slots && row_slots[blockIdx.x] == spare);
    // Row blockIdx.x of a batch (a decode step has one).
    logits += (size_t)blockIdx.x * ne;
    ids += (size_t)blockIdx.x * k;
    weights += (size_t)blockIdx.x * k;
    route_body(logits, sel_bias, ids, weights, ne, k, gating, n_group, n_group_used, norm, scale,
               counts, counted);
}

// The decode step's router product (f32 rows of d: logits = W h) and moe_route in one launch
// (`CudaTuning::router_in_route`): each row split into `parts` runs of columns, each block's
// warps take a (run, row) each (the lanes' float4s, then a warp sum into logits[run * ne +
// row]: so many warps that the whole matrix is read at once), and the block that finishes
// last (done[0], reset by it) adds each row's runs in order and routes as moe_route does,
// with at least ne threads. moe_route's arguments, then W, h, d, done and parts (logits holds
// parts * ne values).
extern "C" __global__ void moe_route_f32(float* logits, const float* sel_bias, u32* ids,
                                         float* weights, int ne, int k, int gating, int n_group,
                                         int n_group_used, int norm, float scale, u32* counts,
                                         const u32* row_slots, u32 spare, const float* W,
                                         const float* h, int d, u32* done, int parts) {
    step_begin();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    const int item = blockIdx.x * warps + warp, r = item % ne, run = item / ne;
    if (run < parts) {
        const int len = d / 4 / parts;
        const float4* w4 = (const float4*)(W + (size_t)r * d) + run * len;
        const float4* h4 = (const float4*)h + run * len;
        float s = 0.f;
        for (int i = lane; i < len; i += 32) {
            const float4 a = __ldg(w4 + i), b = h4[i];
            s = fmaf(a.x, b.x, s);
            s = fmaf(a.y, b.y, s);
            s = fmaf(a.z, b.z, s);
            s = fmaf(a.w, b.w, s);
        }
        s = warp_sum(s);
        if (lane == 0) logits[(size_t)run * ne + r] = s;
    }
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(done, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    if (threadIdx.x == 0) done[0] = 0;
    (void)row_slots;
    (void)spare;
    // (each thread adds its own row's runs: the first run's place takes the sum)
    if (threadIdx.x < ne && parts > 1) {
        float s = __ldcg(logits + threadIdx.x);
        for (int c = 1; c < parts; c++) s += __ldcg(logits + (size_t)c * ne + threadIdx.x);
        logits[threadIdx.x] = s;
    }
    route_body(logits, sel_bias, ids, weights, ne, k, gating, n_group, n_group_used, norm, scale,
               counts, counts != nullptr);
}

// gate_w . h over d f32 values by the whole block (each block of a launch the same sum).
__device__ __forceinline__ float shared_gate_logit(const float* gate_w, const float* h, int d) {
    float s = 0.f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) s = fmaf(gate_w[i], h[i], s);
    return block_sum(s);
}

// ---- The expert slot cache (slots.rs): each chosen expert's rows staged before its products --
// tables: the gate, up and down tables of the layer, ne addresses each (an expert's rows in a
// device slot, or in mapped host memory). Block (x, j) copies its share of expert ids[j]'s
// three matrices into slot j of the three stages (16-byte words; the sizes are multiples of
// 16), so that the products read the chosen experts from device memory at ids 0 .. k - 1.
extern "C" __global__ void moe_stage(const u64* tables, int ne, const u32* ids, u8* g, u8* u,
                                     u8* dn, long long g_bytes, long long u_bytes,
                                     long long d_bytes) {
    step_begin();
    const int j = blockIdx.y;
    const u32 e = ids[j];
    u8* const dst[3] = {g, u, dn};
    const long long bytes[3] = {g_bytes, u_bytes, d_bytes};
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (int m = 0; m < 3; m++) {
        const uint4* src = (const uint4*)tables[(size_t)m * ne + e];
        uint4* d = (uint4*)(dst[m] + (size_t)j * bytes[m]);
        const long long n = bytes[m] / 16;
        for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
            d[i] = src[i];
    }
}

// ---- The CPU tier (cpu_tier.rs): the CPU computes a layer's last c chosen experts ----------
// A layer's exchange in mapped host memory: u32 flags (0: the step that published, 1: the
// step the CPU answered, 2: a step whose wait ran out of time), the c expert ids from word 4,
// the experts' input (d f32) from byte CPU_X_AT, then the CPU's c outputs (c x d f32).
#define CPU_X_AT 256

__device__ __forceinline__ u32 ld_acquire_sys(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void st_release_sys(u32* p, u32 v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// The last c of the k chosen ids and the input h handed to the CPU: written, then made
// visible to the host, then the step's number for layer slot i (seq[i] + 1) published.
extern "C" __global__ void moe_cpu_publish(const u32* ids, int k, int c, const float* h, int d,
                                           u8* exchange, long long offset, u32* seq, int i) {
    step_begin();
    u8* at = exchange + offset;
    u32* flags = (u32*)at;
    for (int j = threadIdx.x; j < c; j += blockDim.x) flags[4 + j] = ids[k - c + j];
    float* x = (float*)(at + CPU_X_AT);
    for (int j = threadIdx.x; j < d; j += blockDim.x) x[j] = h[j];
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) {
        const u32 s = seq[i] + 1;
        seq[i] = s;
        st_release_sys(flags, s);
    }
}

// Waits for the CPU to answer layer slot i's step (flag 1 = seq[i]), then copies its c outputs
// into rows k - c .. k - 1 of ys. After CPU_WAIT_NS without an answer it marks the step (flag
// 2), which the host reports, and goes on.
#define CPU_WAIT_NS 10000000000ull
extern "C" __global__ void moe_cpu_wait(u8* exchange, long long offset, const u32* seq, int i,
                                        float* ys, int k, int c, int d) {
    step_begin();
    u8* at = exchange + offset;
    u32* flags = (u32*)at;
    __shared__ int answered;
    if (threadIdx.x == 0) {
        const u32 s = seq[i];
        u64 t0, t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
        answered = 1;
        while (ld_acquire_sys(flags + 1) != s) {
            __nanosleep(256);
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
            if (t - t0 > CPU_WAIT_NS) {
                answered = 0;
                flags[2] = s;
                __threadfence_system();
                break;
            }
        }
    }
    __syncthreads();
    if (!answered) return;
    const float* y = (const float*)(at + CPU_X_AT) + d;
    float* dst = ys + (size_t)(k - c) * d;
    for (int j = threadIdx.x; j < c * d; j += blockDim.x) dst[j] = __ldcv(y + j);
}

// x += the k experts' outputs (rows of d), each times its weight, summed in slot order as the
// CPU sums them, then the shared expert's output (null: none) times sigmoid of its gate logit
// (null: 1; computed as silu(g) / g, as llama.cpp's graph does). Token t = blockIdx.y: its
// slot j's output is row at[t * k + j] of ys (at null: row t * k + j), its weights, shared row
// and residual row t's. gate_w non-null (one token): the gate logit is the dot of that row of
// d f32 weights with h, the normed input, taken here (shared_gate unused).
extern "C" __global__ void moe_combine(const float* ys, const float* w, int k, int d,
                                       const float* shared, const float* shared_gate, float* x,
                                       const u32* at, const float* gate_w, const float* h) {
    step_begin();
    float gate = gate_w ? shared_gate_logit(gate_w, h, d) : 0.f;
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= d) return;
    size_t t = blockIdx.y;
    w += t * k;
    x += t * d;
    auto row = [&](int j) { return (size_t)(at ? at[t * k + j] : t * k + j) * d; };
    float o = __fmul_rn(ys[row(0) + i], w[0]);
    for (int j = 1; j < k; j++) o = __fadd_rn(o, __fmul_rn(ys[row(j) + i], w[j]));
    if (shared) {
        float y = shared[t * d + i];
        if (shared_gate || gate_w) {
            float g = gate_w ? gate : shared_gate[t];
            y = __fmul_rn(y, (g / (1.f + expf(-g))) / g);
        }
        o = __fadd_rn(o, y);
    }
    x[i] = __fadd_rn(x[i], o);
}

// moe_combine of one token (at null), then the next block's RMS norm of the residual stream
// (weights nw) as rms_norm or rms_norm_q writes it: one block whose lanes hold 8 values each
// (the host launches them where d is at most 256 x warps), the same sums in the same order.
template <bool QUANT>
__device__ __forceinline__ void moe_combine_norm_in_registers(
    const float* ys, const float* w, int k, int d, const float* shared, const float* shared_gate,
    float* x, const float* gate_w, const float* h, float eps, const float* nw, float* out, u8* xq,
    int mode) {
    int j0 = 256 * (threadIdx.x >> 5) + 8 * (threadIdx.x & 31);
    bool ok = j0 < d;
    float nv[8], yv[8], o[8], xv[8];
    load8(nw + j0, ok, nv);
    step_begin();
    float gate = gate_w ? shared_gate_logit(gate_w, h, d) : 0.f;
    load8(ys + j0, ok, yv);
#pragma unroll
    for (int i = 0; i < 8; i++) o[i] = __fmul_rn(yv[i], w[0]);
    for (int j = 1; j < k; j++) {
        load8(ys + (size_t)j * d + j0, ok, yv);
        float wj = w[j];
#pragma unroll
        for (int i = 0; i < 8; i++) o[i] = __fadd_rn(o[i], __fmul_rn(yv[i], wj));
    }
    if (shared) {
        load8(shared + j0, ok, yv);
        if (shared_gate || gate_w) {
            float g = gate_w ? gate : shared_gate[0];
            float gs = (g / (1.f + expf(-g))) / g;
#pragma unroll
            for (int i = 0; i < 8; i++) yv[i] = __fmul_rn(yv[i], gs);
        }
#pragma unroll
        for (int i = 0; i < 8; i++) o[i] = __fadd_rn(o[i], yv[i]);
    }
    load8(x + j0, ok, xv);
#pragma unroll
    for (int i = 0; i < 8; i++) xv[i] = __fadd_rn(xv[i], o[i]);
    store_and_norm_held<QUANT>(xv, x, d, eps, nv, out, xq, mode);
}

extern "C" __global__ void moe_combine_norm_held(const float* ys, const float* w, int k, int d,
                                                 const float* shared, const float* shared_gate,
                                                 float* x, const u32* at, const float* gate_w,
                                                 const float* h, float eps, const float* nw,
                                                 float* out) {
    moe_combine_norm_in_registers<false>(ys, w, k, d, shared, shared_gate, x, gate_w, h, eps, nw,
                                         out, nullptr, 0);
}

extern "C" __global__ void moe_combine_norm_held_q(const float* ys, const float* w, int k, int d,
                                                   const float* shared,
                                                   const float* shared_gate, float* x,
                                                   const u32* at, const float* gate_w,
                                                   const float* h, float eps, const float* nw,
                                                   u8* xq, int mode) {
    moe_combine_norm_in_registers<true>(ys, w, k, d, shared, shared_gate, x, gate_w, h, eps, nw,
                                        nullptr, xq, mode);
}

// A batch's (token, slot) pairs grouped by expert, in pair order within each expert (one
// thread, for more than 1024 experts: the order is the same every run): counts[e] pairs chose
// expert e, its group starts at offsets[e], and pair i lands at row at[i] of the grouped rows.
extern "C" __global__ void moe_group(const u32* ids, int n_pairs, int ne, u32* counts,
                                     u32* offsets, u32* at) {
    step_begin();
    if (threadIdx.x != 0) return;
    for (int e = 0; e < ne; e++) counts[e] = 0;
    for (int i = 0; i < n_pairs; i++) counts[ids[i]]++;
    u32 o = 0;
    for (int e = 0; e < ne; e++) {
        offsets[e] = o;
        o += counts[e];
    }
    for (int i = 0; i < n_pairs; i++) at[i] = offsets[ids[i]]++;
    for (int e = 0; e < ne; e++) offsets[e] -= counts[e];
}

// moe_group's result from one warp (ne at most 1024): the counts in shared memory, their
// prefix sum, then the pairs 32 at a time, the lanes of one expert (__match_any_sync) taking
// its next places in lane order.
extern "C" __global__ void moe_group_warp(const u32* ids, int n_pairs, int ne, u32* counts,
                                     u32* offsets, u32* at) {
    step_begin();
    __shared__ u32 count[1024], next[1024];
    int lane = threadIdx.x;
    if (lane >= 32) return;
    for (int e = lane; e < ne; e += 32) count[e] = 0;
    __syncwarp();
    for (int i = lane; i < n_pairs; i += 32) atomicAdd(&count[ids[i]], 1u);
    __syncwarp();
    // Each lane sums a run of experts; the runs' sums scanned across the warp.
    int per = (ne + 31) / 32, lo = min(ne, lane * per), hi = min(ne, lo + per);
    u32 run = 0;
    for (int e = lo; e < hi; e++) run += count[e];
    u32 inclusive = run;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        u32 v = __shfl_up_sync(0xffffffffu, inclusive, d);
        if (lane >= d) inclusive += v;
    }
    u32 o = inclusive - run;
    for (int e = lo; e < hi; e++) {
        counts[e] = count[e];
        offsets[e] = o;
        next[e] = o;
        o += count[e];
    }
    __syncwarp();
    for (int base = 0; base < n_pairs; base += 32) {
        int i = base + lane;
        bool ok = i < n_pairs;
        u32 e = ok ? ids[i] : 0xffffffffu;
        u32 same = __match_any_sync(0xffffffffu, e);
        u32 place = ok ? next[e] + __popc(same & ((1u << lane) - 1u)) : 0u;
        __syncwarp();
        if (ok) {
            at[i] = place;
            // (the group's last lane moves the expert's next place on)
            if (lane == 31 - __clz(same)) next[e] = place + 1u;
        }
        __syncwarp();
    }
}

// Each expert's group padded to `most` rows: pair i's row at[i] (its place in the compact
// groups moe_group made) becomes ids[i] * most + its rank within its group, so that one
// strided-batched GEMM per matrix takes every expert.
extern "C" __global__ void moe_pad_rows(const u32* ids, const u32* offsets, u32* at, int n_pairs,
                                        int most) {
    step_begin();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n_pairs) at[i] = ids[i] * (u32)most + (at[i] - offsets[ids[i]]);
}

// Row at[i] of dst = row i / k of src (f16 rows of d): each pair's input in its expert's group.
extern "C" __global__ void moe_gather_f16(const u16* src, const u32* at, int k, int d, u16* dst) {
    step_begin();
    size_t i = blockIdx.x;
    const u16* s = src + (i / k) * (size_t)d;
    u16* o = dst + (size_t)at[i] * d;
    for (int j = threadIdx.x; j < d; j += blockDim.x) o[j] = s[j];
}

// rms_norm over row blockIdx.x of a batch (n values each; f32, the CPU's f64 sum of squares).
extern "C" __global__ void rms_norm_rows_f32(const float* x, const float* w, float* out, int n,
                                             float eps) {
    rms_norm_groups<false>(x + (size_t)blockIdx.x * n, w, out + (size_t)blockIdx.x * n, nullptr,
                           n, eps, 0);
}
