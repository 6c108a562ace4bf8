// ---- Hybrid models: the gated delta-net layer and the gated attention output ----------------
//
// (appended to kernels.cu by kernels.rs: step_begin, rms_scale, h2f, f2h come from there)
//
// A delta-net layer is, between its products, delta_conv (the causal convolution over the
// queries, keys and values, its state advanced) and delta_rule (per value head: L2 norms, decay
// and rate, the state's update and read-out, the gated norm); each comes for one token (the
// decode step), a prompt's tokens one after another (_rows) and one token of each of several
// sequences (_slots). The states live on the device; a token at position 0 reads them as
// zeros, so a new sequence needs no clearing launch. docs/ARCHITECTURE.md has the layouts.

__device__ __forceinline__ float silu_f(float x) { return x / (1.f + expf(-x)); }

// The most taps of a convolution (the plan declines more).
#define DELTA_CONV_MAX_TAPS 16

// ggml's softplus: ln(1 + e^x), x itself above 20.
__device__ __forceinline__ float softplus_f(float x) { return x > 20.f ? x : logf(1.f + expf(x)); }

// Where channel c of the convolution (queries of every key head, then keys, then values) is in
// the projection's row: contiguous (split projections), or in the fused ssm_in layout where
// each key head's group holds its query (s), key (s), value heads (ratio * s) and their gates.
__device__ __forceinline__ int conv_source(int c, int fused, int key_dim, int s, int ratio) {
    if (!fused) return c;
    int group = 2 * s + 2 * ratio * s;
    if (c < key_dim) return (c / s) * group + c % s;
    if (c < 2 * key_dim) return ((c - key_dim) / s) * group + s + (c - key_dim) % s;
    int j = c - 2 * key_dim, vw = ratio * s;
    return (j / vw) * group + 2 * s + j % vw;
}

// Channel c's output for input x: silu of the taps over its last taps - 1 inputs (state, oldest
// first; zeros when fresh) and x, summed in f32 from the oldest as the CPU (and ggml's
// ssm_conv) does; the state moves on by one.
__device__ __forceinline__ float conv_token(float x, float* state, const float* wc, int taps,
                                            int channels, int c, bool fresh) {
    float acc = 0.f;
    for (int i = 0; i < taps - 1; i++) {
        float h = fresh ? 0.f : state[(size_t)i * channels + c];
        acc += h * wc[i];
        if (i > 0) state[(size_t)(i - 1) * channels + c] = h;
    }
    acc += x * wc[taps - 1];
    if (taps > 1) state[(size_t)(taps - 2) * channels + c] = x;
    return silu_f(acc);
}

// One token's convolution, a thread per channel.
extern "C" __global__ void delta_conv(const float* in, int fused, const float* w, float* state,
                                      const u32* pos, float* out, int channels, int taps,
                                      int key_dim, int s, int ratio) {
    step_begin();
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= channels) return;
    float x = in[conv_source(c, fused, key_dim, s, ratio)];
    out[c] = conv_token(x, state, w + (size_t)c * taps, taps, channels, c, *pos == 0);
}

// x / |x| over the s values of a head (one per thread) as the CPU computes it for the
// delta-net: an RMS norm with epsilon eps / s, then a scale by 1 / sqrt(s).
__device__ __forceinline__ float l2_normalized(float x, int s, float eps) {
    float r = rms_scale((double)(x * x), s, eps / (float)s);
    return (x * r) * (1.f / sqrtf((float)s));
}

// One value head's inputs for one token: its rate b and decay input a (from ba's row in the
// fused ssm_ba layout, per key head its value heads' b then their a, when alpha is null; else b
// from ba and a from alpha), and output gate z of dimension zi (from z's row, or in the fused
// ssm_in layout of in_fused's row when z is null).
struct DeltaGates {
    float b, a, z;
};

__device__ __forceinline__ DeltaGates delta_gates(const float* ba, const float* alpha,
                                                  const float* in_fused, const float* z, int vh,
                                                  int zi, int ratio, int s) {
    DeltaGates g;
    if (alpha) {
        g.b = ba[vh];
        g.a = alpha[vh];
    } else {
        int kg = vh / ratio, r = vh % ratio;
        g.b = ba[kg * 2 * ratio + r];
        g.a = ba[kg * 2 * ratio + ratio + r];
    }
    g.z = z ? z[zi]
            : in_fused[(zi / (ratio * s)) * (2 * s + 2 * ratio * s) + 2 * s + ratio * s +
                       zi % (ratio * s)];
    return g;
}

// Value head vh of one token (c: the token's channels), thread j its value dimension: the key
// head's query and key L2-normalized, beta = sigmoid(b), decay = exp(softplus(a + dt_bias) *
// ssm_a); the state S (s x s, key-major: S[i][j] at i * s + j; zeros when fresh) decayed,
// u = beta (v - S^T k), S += k u^T, o = S^T q / sqrt(s); returns rms_norm(o) * norm * silu(z).
// Every thread of the block calls it (block-wide sums); qs, ks: s floats of shared memory. The
// thread's column of S is in place in S.
__device__ __forceinline__ float delta_rule_token(const float* c, DeltaGates g,
                                                  const float* dt_bias, const float* ssm_a,
                                                  const float* norm, float* S, bool fresh, int vh,
                                                  int kh, int key_dim, int s, float eps,
                                                  float* qs, float* ks) {
    int j = threadIdx.x;
    __syncthreads();
    qs[j] = l2_normalized(c[kh * s + j], s, eps);
    ks[j] = l2_normalized(c[key_dim + kh * s + j], s, eps);
    float v = c[2 * key_dim + vh * s + j];
    float beta = 1.f / (1.f + expf(-g.b));
    float decay = expf(softplus_f(g.a + dt_bias[vh]) * ssm_a[vh]);
    __syncthreads();
    // S^T k over the decayed state, summed in key order as the CPU's.
    float sk = 0.f, o = 0.f;
    for (int i = 0; i < s; i++) sk += ks[i] * (fresh ? 0.f : S[(size_t)i * s + j] * decay);
    float u = (v - sk) * beta;
    for (int i = 0; i < s; i++) {
        float x = (fresh ? 0.f : S[(size_t)i * s + j] * decay) + ks[i] * u;
        S[(size_t)i * s + j] = x;
        o += qs[i] * x;
    }
    o *= 1.f / sqrtf((float)s);
    float r = rms_scale((double)(o * o), s, eps);
    return (o * r) * norm[j] * silu_f(g.z);
}

// One token, a block per value head (s threads, at most 256).
extern "C" __global__ void delta_rule(const float* conv, const float* ba, const float* alpha,
                                      const float* dt_bias, const float* ssm_a,
                                      const float* norm, const float* in_fused, const float* z,
                                      float* state, const u32* pos, float* out, int n_k_heads,
                                      int n_v_heads, int s, int tiled, float eps) {
    step_begin();
    __shared__ float qs[256], ks[256];
    int vh = blockIdx.x, zi = vh * s + threadIdx.x, ratio = n_v_heads / n_k_heads;
    int kh = tiled ? vh % n_k_heads : vh / ratio;
    DeltaGates g = delta_gates(ba, alpha, in_fused, z, vh, zi, ratio, s);
    out[zi] = delta_rule_token(conv, g, dt_bias, ssm_a, norm, state + (size_t)vh * s * s,
                               *pos == 0, vh, kh, n_k_heads * s, s, eps, qs, ks);
}

// ---- The same over a prompt's n tokens (the prompt pass) ------------------------------------
// The projections are GEMMs over the batch's rows (row t of `in` is token t's, in_stride floats
// apart; of ba, ba_stride; of alpha, n_v_heads; of z or in_fused, z_stride); the tokens at
// positions pos0.. (pos0 == 0: the states start from zeros). The read-out rows are f16, the
// output GEMM's input. The delta rule runs the decode step's recurrence token after token in
// one launch, not yet the chunked form on the tensor cores.

// Heads of other widths than 64 and 128 (delta_rule_rows_warps): the state in place, a token
// at a time through delta_rule_token.
extern "C" __global__ void delta_rule_rows(const float* conv, const float* ba, int ba_stride,
                                           const float* alpha, const float* dt_bias,
                                           const float* ssm_a, const float* norm,
                                           const float* in_fused, const float* z, int z_stride,
                                           float* state, int pos0, u16* out, int n_k_heads,
                                           int n_v_heads, int s, int tiled, float eps, int n) {
    __shared__ float qs[256], ks[256];
    int vh = blockIdx.x, j = threadIdx.x, zi = vh * s + j, ratio = n_v_heads / n_k_heads;
    int kh = tiled ? vh % n_k_heads : vh / ratio;
    int key_dim = n_k_heads * s, value_dim = n_v_heads * s, channels = 2 * key_dim + value_dim;
    float* S = state + (size_t)vh * s * s;
    for (int t = 0; t < n; t++) {
        DeltaGates g = delta_gates(ba + (size_t)t * ba_stride,
                                   alpha ? alpha + (size_t)t * n_v_heads : nullptr,
                                   in_fused + (size_t)t * z_stride,
                                   z ? z + (size_t)t * z_stride : nullptr, vh, zi, ratio, s);
        float o = delta_rule_token(conv + (size_t)t * channels, g, dt_bias, ssm_a, norm, S,
                                   pos0 == 0 && t == 0, vh, kh, key_dim, s, eps, qs, ks);
        out[(size_t)t * value_dim + zi] = f2h(o);
    }
}

// A prompt's convolution, block (x, y) taking channels x * blockDim.x.. over the y-th of
// gridDim.y runs of tokens: each output reads the inputs themselves (the state's for the tokens
// before the batch), so the runs are independent. Only the first run reads the state (the host makes every run at least
// taps - 1 tokens long), and it writes the new one after its reads: the batch's last inputs.
extern "C" __global__ void delta_conv_rows_runs(const float* in, int in_stride, int fused,
                                           const float* w, float* state, int pos0, float* out,
                                           int channels, int taps, int key_dim, int s, int ratio,
                                           int n) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= channels) return;
    const float* wc = w + (size_t)c * taps;
    int src = conv_source(c, fused, key_dim, s, ratio);
    // Token t's input (t < 0: the state's, oldest first; zeros when fresh).
    auto input = [&](int t) {
        if (t >= 0) return in[(size_t)t * in_stride + src];
        return pos0 == 0 ? 0.f : state[(size_t)(taps - 1 + t) * channels + c];
    };
    int per = (n + gridDim.y - 1) / gridDim.y, t0 = blockIdx.y * per, t1 = min(n, t0 + per);
    for (int t = t0; t < t1; t++) {
        // (summed from the oldest, as conv_token)
        float acc = 0.f;
        for (int i = 0; i < taps - 1; i++) acc += input(t - (taps - 1) + i) * wc[i];
        acc += input(t) * wc[taps - 1];
        out[(size_t)t * channels + c] = silu_f(acc);
    }
    if (blockIdx.y == 0 && taps > 1) {
        float last[DELTA_CONV_MAX_TAPS - 1];
        for (int i = 0; i < taps - 1; i++) last[i] = input(n - (taps - 1) + i);
        for (int i = 0; i < taps - 1; i++) state[(size_t)i * channels + c] = last[i];
    }
}

// A prompt's delta rule for heads of R (64, 128): thread j holds column j of the state in
// registers for the whole prompt. Each warp normalizes the key head's query and key itself (no block-wide sum for
// them) into its own shared copy, the next token's inputs are loaded while this one's are used,
// and the read-out's norm is the one block-wide sum a token. The arithmetic is
// delta_rule_token's.
template <int R>
__device__ __forceinline__ void delta_rule_rows_reg(
    const float* conv, const float* ba, int ba_stride, const float* alpha, const float* dt_bias,
    const float* ssm_a, const float* norm, const float* in_fused, const float* z, int z_stride,
    float* state, int pos0, u16* out, int n_k_heads, int n_v_heads, int tiled, float eps,
    int n) {
    constexpr int PER = R / 32, WARPS = R / 32;
    __shared__ float qs[WARPS][R], ks[WARPS][R];
    __shared__ double part[2][WARPS];
    int vh = blockIdx.x, j = threadIdx.x, warp = j >> 5, lane = j & 31;
    int zi = vh * R + j, ratio = n_v_heads / n_k_heads;
    int kh = tiled ? vh % n_k_heads : vh / ratio;
    int key_dim = n_k_heads * R, value_dim = n_v_heads * R, channels = 2 * key_dim + value_dim;
    float* S = state + (size_t)vh * R * R;
    float col[R];
#pragma unroll
    for (int i = 0; i < R; i++) col[i] = pos0 == 0 ? 0.f : S[(size_t)i * R + j];
    const float dtb = dt_bias[vh], sa = ssm_a[vh], nj = norm[j], inv_sqrt = 1.f / sqrtf((float)R);
    // Token t's query and key values of this lane (i = lane + 32 m), value and gates.
    auto load = [&](int t, float* q, float* k, float& v, DeltaGates& g) {
        const float* c = conv + (size_t)t * channels;
#pragma unroll
        for (int m = 0; m < PER; m++) {
            q[m] = c[kh * R + lane + 32 * m];
            k[m] = c[key_dim + kh * R + lane + 32 * m];
        }
        v = c[2 * key_dim + vh * R + j];
        g = delta_gates(ba + (size_t)t * ba_stride, alpha ? alpha + (size_t)t * n_v_heads : nullptr,
                        in_fused + (size_t)t * z_stride, z ? z + (size_t)t * z_stride : nullptr,
                        vh, zi, ratio, R);
    };
    float q[PER], k[PER], v = 0.f;
    DeltaGates g = {0.f, 0.f, 0.f};
    if (n > 0) load(0, q, k, v, g);
    for (int t = 0; t < n; t++) {
        float qn[PER], kn[PER], vn = 0.f;
        DeltaGates gn = g;
        if (t + 1 < n) load(t + 1, qn, kn, vn, gn);
        double sq = 0.0, sk2 = 0.0;
#pragma unroll
        for (int m = 0; m < PER; m++) {
            sq += (double)(q[m] * q[m]);
            sk2 += (double)(k[m] * k[m]);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            sq += __shfl_xor_sync(0xffffffffu, sq, o);
            sk2 += __shfl_xor_sync(0xffffffffu, sk2, o);
        }
        float rq = 1.f / sqrtf((float)(sq / (double)R) + eps / (float)R);
        float rk = 1.f / sqrtf((float)(sk2 / (double)R) + eps / (float)R);
        __syncwarp();
#pragma unroll
        for (int m = 0; m < PER; m++) {
            qs[warp][lane + 32 * m] = (q[m] * rq) * inv_sqrt;
            ks[warp][lane + 32 * m] = (k[m] * rk) * inv_sqrt;
        }
        __syncwarp();
        float beta = 1.f / (1.f + expf(-g.b));
        float decay = expf(softplus_f(g.a + dtb) * sa);
        // S^T k over the decayed state, summed in key order as the CPU's.
        float sk = 0.f, o = 0.f;
#pragma unroll
        for (int i = 0; i < R; i++) sk += ks[warp][i] * (col[i] * decay);
        float u = (v - sk) * beta;
#pragma unroll
        for (int i = 0; i < R; i++) {
            col[i] = col[i] * decay + ks[warp][i] * u;
            o += qs[warp][i] * col[i];
        }
        o *= inv_sqrt;
        double so = (double)(o * o);
#pragma unroll
        for (int w = 16; w > 0; w >>= 1) so += __shfl_xor_sync(0xffffffffu, so, w);
        // (two buffers: a warp still reading this token's sums cannot see the next one's)
        if (lane == 0) part[t & 1][warp] = so;
        __syncthreads();
        double total = 0.0;
#pragma unroll
        for (int w = 0; w < WARPS; w++) total += part[t & 1][w];
        float r = 1.f / sqrtf((float)(total / (double)R) + eps);
        out[(size_t)t * value_dim + zi] = f2h((o * r) * nj * silu_f(g.z));
#pragma unroll
        for (int m = 0; m < PER; m++) {
            q[m] = qn[m];
            k[m] = kn[m];
        }
        v = vn;
        g = gn;
    }
#pragma unroll
    for (int i = 0; i < R; i++) S[(size_t)i * R + j] = col[i];
}

// delta_rule_rows' outputs for heads of 64 and 128 (the host launches it for those only).
extern "C" __global__ void delta_rule_rows_warps(const float* conv, const float* ba,
                                                 int ba_stride, const float* alpha,
                                                 const float* dt_bias, const float* ssm_a,
                                                 const float* norm, const float* in_fused,
                                                 const float* z, int z_stride, float* state,
                                                 int pos0, u16* out, int n_k_heads,
                                                 int n_v_heads, int s, int tiled, float eps,
                                                 int n) {
    if (s == 128)
        delta_rule_rows_reg<128>(conv, ba, ba_stride, alpha, dt_bias, ssm_a, norm, in_fused, z,
                                 z_stride, state, pos0, out, n_k_heads, n_v_heads, tiled, eps, n);
    else
        delta_rule_rows_reg<64>(conv, ba, ba_stride, alpha, dt_bias, ssm_a, norm, in_fused, z,
                                z_stride, state, pos0, out, n_k_heads, n_v_heads, tiled, eps, n);
}

// ---- One token of each of several sequences (the batched decode step) ------------------------
// Row t belongs to slot slot[t] at position pos[t] (rows laid out as the prompt pass's); a
// slot's states start slot * conv_stride and slot * ssm_stride floats in.

extern "C" __global__ void delta_conv_slots(const float* in, int in_stride, int fused,
                                            const float* w, float* conv_state,
                                            long long conv_stride, const u32* slot,
                                            const u32* pos, float* out, int channels, int taps,
                                            int key_dim, int s, int ratio) {
    int c = blockIdx.x * blockDim.x + threadIdx.x, t = blockIdx.y;
    if (c >= channels) return;
    float x = in[(size_t)t * in_stride + conv_source(c, fused, key_dim, s, ratio)];
    out[(size_t)t * channels + c] =
        conv_token(x, conv_state + (size_t)slot[t] * conv_stride, w + (size_t)c * taps, taps,
                   channels, c, pos[t] == 0);
}

// Block (vh, t): value head vh of row t.
extern "C" __global__ void delta_rule_slots(const float* conv, const float* ba, int ba_stride,
                                            const float* alpha, const float* dt_bias,
                                            const float* ssm_a, const float* norm,
                                            const float* in_fused, const float* z, int z_stride,
                                            float* ssm_state, long long ssm_stride,
                                            const u32* slot, const u32* pos, u16* out,
                                            int n_k_heads, int n_v_heads, int s, int tiled,
                                            float eps) {
    __shared__ float qs[256], ks[256];
    int vh = blockIdx.x, t = blockIdx.y, zi = vh * s + threadIdx.x;
    int ratio = n_v_heads / n_k_heads, kh = tiled ? vh % n_k_heads : vh / ratio;
    int key_dim = n_k_heads * s, value_dim = n_v_heads * s, channels = 2 * key_dim + value_dim;
    DeltaGates g = delta_gates(ba + (size_t)t * ba_stride,
                               alpha ? alpha + (size_t)t * n_v_heads : nullptr,
                               in_fused + (size_t)t * z_stride,
                               z ? z + (size_t)t * z_stride : nullptr, vh, zi, ratio, s);
    float* S = ssm_state + (size_t)slot[t] * ssm_stride + (size_t)vh * s * s;
    float o = delta_rule_token(conv + (size_t)t * channels, g, dt_bias, ssm_a, norm, S,
                               pos[t] == 0, vh, kh, key_dim, s, eps, qs, ks);
    out[(size_t)t * value_dim + zi] = f2h(o);
}

// ---- Qwen3-Next's gated attention output ------------------------------------------------------
// The Q projection's rows hold per head hd query values, then hd gate values: split_query_gate
// parts them (one token; _rows: token blockIdx.y of a batch), and the attention's output is
// multiplied by the gates' sigmoid (ggml's sigmoid: 1 / (1 + e^-x)) before the output product.

extern "C" __global__ void split_query_gate(const float* qg, float* q, float* g, int n_head,
                                            int hd) {
    step_begin();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_head * hd) return;
    int h = i / hd, e = i % hd;
    q[i] = qg[(size_t)h * 2 * hd + e];
    g[i] = qg[(size_t)h * 2 * hd + hd + e];
}

extern "C" __global__ void split_query_gate_rows(const float* qg, float* q, float* g, int n_head,
                                                 int hd) {
    int i = blockIdx.x * blockDim.x + threadIdx.x, t = blockIdx.y, w = n_head * hd;
    if (i >= w) return;
    int h = i / hd, e = i % hd;
    const float* row = qg + (size_t)t * 2 * w;
    q[(size_t)t * w + i] = row[h * 2 * hd + e];
    g[(size_t)t * w + i] = row[h * 2 * hd + hd + e];
}

extern "C" __global__ void sigmoid_mul(float* x, const float* g, int n) {
    step_begin();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= 1.f / (1.f + expf(-g[i]));
}

extern "C" __global__ void sigmoid_mul_f16(u16* x, const float* g, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = f2h(h2f(x[i]) * (1.f / (1.f + expf(-g[i]))));
}
