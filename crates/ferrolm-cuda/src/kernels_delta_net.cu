// ---- Hybrid models: the gated delta-net layer and the gated attention output ----------------
//
// (appended to kernels.cu by kernels.rs: step_begin, rms_scale, h2f, f2h come from there)
//
// A delta-net layer is, between its products, delta_conv (the causal convolution over the
// queries, keys and values, its state advanced) and delta_rule (per value head: L2 norms, decay
// and rate, the state's update and read-out, the gated norm); each comes for one token (the
// decode step), a prompt's tokens (_rows; the delta rule of heads of 64 and 128 in chunks,
// below) and one token of each of several sequences (_slots). The states live on the device;
// a token at position 0 reads them as zeros, so a new sequence needs no clearing launch.
// docs/ARCHITECTURE.md has the layouts.

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

__device__ __forceinline__ void delta_rate_decay(const float* ba, const float* alpha, int vh,
                                                 int ratio, float& b, float& a) {
    if (alpha) {
        b = ba[vh];
        a = alpha[vh];
    } else {
        int kg = vh / ratio, r = vh % ratio;
        b = ba[kg * 2 * ratio + r];
        a = ba[kg * 2 * ratio + ratio + r];
    }
}

__device__ __forceinline__ float delta_gate_z(const float* in_fused, const float* z, int zi,
                                              int ratio, int s) {
    return z ? z[zi]
             : in_fused[(zi / (ratio * s)) * (2 * s + 2 * ratio * s) + 2 * s + ratio * s +
                        zi % (ratio * s)];
}

__device__ __forceinline__ DeltaGates delta_gates(const float* ba, const float* alpha,
                                                  const float* in_fused, const float* z, int vh,
                                                  int zi, int ratio, int s) {
    DeltaGates g;
    delta_rate_decay(ba, alpha, vh, ratio, g.b, g.a);
    g.z = delta_gate_z(in_fused, z, zi, ratio, s);
    return g;
}

// Value head vh of one token (c: the token's channels), thread j its value dimension: the key
// head's query and key L2-normalized, beta = sigmoid(b), decay = exp(softplus(a + dt_bias) *
// ssm_a); the state S (s x s, key-major: S[i][j] at i * s + j; zeros when fresh) decayed,
// u = beta (v - S^T k), S += k u^T, o = S^T q / sqrt(s); returns rms_norm(o) * norm * silu(z).
// Every thread of the block calls it (block-wide sums); qs, ks: s floats of shared memory. The
// thread's column of S is in place in S. RUN: values of the column read before they are used
// (the decode step's `delta_rule` with CudaTuning::delta_runs: 16, so that a run's loads are in
// flight together rather than one after another); the sums keep their order either way.
template <int RUN>
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
    int i = 0;
    for (; i + RUN <= s; i += RUN) {
        float col[RUN];
#pragma unroll
        for (int r = 0; r < RUN; r++) col[r] = fresh ? 0.f : S[(size_t)(i + r) * s + j];
#pragma unroll
        for (int r = 0; r < RUN; r++) sk += ks[i + r] * (fresh ? 0.f : col[r] * decay);
    }
    for (; i < s; i++) sk += ks[i] * (fresh ? 0.f : S[(size_t)i * s + j] * decay);
    float u = (v - sk) * beta;
    for (i = 0; i + RUN <= s; i += RUN) {
        float col[RUN];
#pragma unroll
        for (int r = 0; r < RUN; r++) col[r] = fresh ? 0.f : S[(size_t)(i + r) * s + j];
#pragma unroll
        for (int r = 0; r < RUN; r++) {
            float x = (fresh ? 0.f : col[r] * decay) + ks[i + r] * u;
            S[(size_t)(i + r) * s + j] = x;
            o += qs[i + r] * x;
        }
    }
    for (; i < s; i++) {
        float x = (fresh ? 0.f : S[(size_t)i * s + j] * decay) + ks[i] * u;
        S[(size_t)i * s + j] = x;
        o += qs[i] * x;
    }
    o *= 1.f / sqrtf((float)s);
    float r = rms_scale((double)(o * o), s, eps);
    return (o * r) * norm[j] * silu_f(g.z);
}

// One token, a block per value head (s threads, at most 256); run: delta_rule_token's RUN
// (16, else 1).
extern "C" __global__ void delta_rule(const float* conv, const float* ba, const float* alpha,
                                      const float* dt_bias, const float* ssm_a,
                                      const float* norm, const float* in_fused, const float* z,
                                      float* state, const u32* pos, float* out, int n_k_heads,
                                      int n_v_heads, int s, int tiled, float eps, u8* xq,
                                      int mode, int run) {
    step_begin();
    __shared__ float qs[256], ks[256];
    int vh = blockIdx.x, zi = vh * s + threadIdx.x, ratio = n_v_heads / n_k_heads;
    int kh = tiled ? vh % n_k_heads : vh / ratio;
    DeltaGates g = delta_gates(ba, alpha, in_fused, z, vh, zi, ratio, s);
    float* S = state + (size_t)vh * s * s;
    float o = run >= 16 ? delta_rule_token<16>(conv, g, dt_bias, ssm_a, norm, S, *pos == 0, vh,
                                               kh, n_k_heads * s, s, eps, qs, ks)
                        : delta_rule_token<1>(conv, g, dt_bias, ssm_a, norm, S, *pos == 0, vh, kh,
                                              n_k_heads * s, s, eps, qs, ks);
    out[zi] = o;
    // (xq non-null: quantized for the output product too, quantize_lane's modes)
    if (xq) quantize_lane(o, zi, xq, n_v_heads * s, mode);
}

// ---- The same over a prompt's n tokens (the prompt pass) ------------------------------------
// The projections are GEMMs over the batch's rows (row t of `in` is token t's, in_stride floats
// apart; of ba, ba_stride; of alpha, n_v_heads; of z or in_fused, z_stride); the tokens at
// positions pos0.. (pos0 == 0: the states start from zeros). The read-out rows are f16, the
// output GEMM's input.

// Heads of other widths than 64 and 128 (those go in chunks, below): the state in place, a
// token at a time through delta_rule_token.
extern "C" __global__ void delta_rule_rows(const float* conv, const float* ba, int ba_stride,
                                           const float* alpha, const float* dt_bias,
                                           const float* ssm_a, const float* norm,
                                           const float* in_fused, const float* z, int z_stride,
                                           float* state, int pos0, u16* out, int n_k_heads,
                                           int n_v_heads, int s, int tiled, float eps, int n) {
    step_begin();
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
        float o = delta_rule_token<1>(conv + (size_t)t * channels, g, dt_bias, ssm_a, norm, S,
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
    step_begin();
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

// ---- A prompt's delta rule in chunks (heads of 64 and 128) -----------------------------------
// The CPU's chunked (WY / UT) form, docs/ARCHITECTURE.md, with its sums in the same order and its
// roundings (each product and sum rounded apiece, no fused multiply-adds): delta_qk_norm_rows
// L2-normalizes the queries and keys in place; delta_chunk_gram takes each chunk's k_t . k_r and
// q_t . k_r; delta_rule_chunks carries each value head's state through the chunks, a block per 32
// of its columns (a column's update reads only that column); delta_gated_norm_rows applies the
// read-out's gated norm.

#define DELTA_CHUNK 64

__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }

// Block (kh, t), s threads: token t's query and key of key head kh.
extern "C" __global__ void delta_qk_norm_rows(float* conv, int n_k_heads, int s, int channels,
                                              float eps) {
    step_begin();
    int kh = blockIdx.x, j = threadIdx.x;
    float* c = conv + (size_t)blockIdx.y * channels;
    int key_dim = n_k_heads * s;
    float q = c[kh * s + j], k = c[key_dim + kh * s + j];
    float qn = l2_normalized(q, s, eps), kn = l2_normalized(k, s, eps);
    c[kh * s + j] = qn;
    c[key_dim + kh * s + j] = kn;
}

// Block (kh, chunk), 256 threads: thread (t, r0) takes k_t . k_r and q_t . k_r for the chunk's
// r = r0, r0 + 4, ..., each summed over the s dimensions in order from -0.0, the chunk's keys
// staged 32 dimensions at a time. gram holds per (chunk, key head) kk then qk, C x C each.
extern "C" __global__ void delta_chunk_gram(const float* conv, float* gram, int n_k_heads, int s,
                                            int channels, int n) {
    step_begin();
    constexpr int C = DELTA_CHUNK, M = C / 4;
    __shared__ float ks[C][33];
    int kh = blockIdx.x, chunk = blockIdx.y, t0 = chunk * C, l = min(C, n - t0);
    int key_dim = n_k_heads * s, t = threadIdx.x >> 2, r0 = threadIdx.x & 3;
    const float* rows = conv + (size_t)t0 * channels;
    float akk[M], aqk[M];
#pragma unroll
    for (int m = 0; m < M; m++) akk[m] = aqk[m] = -0.f;
    for (int i0 = 0; i0 < s; i0 += 32) {
        __syncthreads();
        for (int e = threadIdx.x; e < C * 32; e += blockDim.x) {
            int r = e >> 5, i = e & 31;
            ks[r][i] = r < l ? rows[(size_t)r * channels + key_dim + kh * s + i0 + i] : 0.f;
        }
        __syncthreads();
        if (t >= l) continue;
        const float* qt = rows + (size_t)t * channels + kh * s + i0;
        for (int i = 0; i < 32; i++) {
            float qi = qt[i], ki = ks[t][i];
#pragma unroll
            for (int m = 0; m < M; m++) {
                float kr = ks[r0 + 4 * m][i];
                akk[m] = add_rn(akk[m], mul_rn(ki, kr));
                aqk[m] = add_rn(aqk[m], mul_rn(qi, kr));
            }
        }
    }
    if (t >= l) return;
    float* kk = gram + ((size_t)chunk * n_k_heads + kh) * 2 * C * C;
#pragma unroll
    for (int m = 0; m < M; m++) {
        int r = r0 + 4 * m;
        if (r < l) {
            kk[t * C + r] = akk[m];
            kk[C * C + t * C + r] = aqk[m];
        }
    }
}

// Block (vh, column block), 256 threads; lane j's column of the state (R x 32 of it in shared
// memory) through the chunks: the right-hand sides u_t = beta_t (v_t - e^{G_t} S0^T k_t), the
// unit lower-triangular solve (one warp, a column a lane), the read-outs e^{G_t} S0^T q_t +
// sum_{r<=t} e^{G_t - G_r} (q_t . k_r) u_r, the state e^{G_last} S0 + sum_r e^{G_last - G_r}
// k_r u_r^T. Read-outs (times 1 / sqrt(R)) in f32 rows of out. Warp w takes tokens w, w + 8,
// ... and the state's rows w, w + 8, ...; the chunk's keys and queries are staged 8
// dimensions at a time (X), so that every warp reads them from shared memory.
#define DELTA_SLICE 8
// (declared once in the kernel: each instance's own would all be allocated)
struct DeltaChunkShared {
    float S[128][32], U[DELTA_CHUNK][32], A[DELTA_CHUNK][DELTA_CHUNK];
    float Xk[DELTA_CHUNK][DELTA_SLICE], Xq[DELTA_CHUNK][DELTA_SLICE];
    float beta[DELTA_CHUNK], cum[DELTA_CHUNK], wts[DELTA_CHUNK];
};

template <int R>
__device__ __forceinline__ void delta_rule_chunks_in(
    const float* conv, const float* ba, int ba_stride, const float* alpha, const float* dt_bias,
    const float* ssm_a, const float* gram, float* state, int pos0, float* out, int n_k_heads,
    int n_v_heads, int tiled, int n, DeltaChunkShared& sh) {
    constexpr int C = DELTA_CHUNK, J = 32, W = 8, M = C / W, X = DELTA_SLICE;
    float(*S)[J] = sh.S;
    float(*U)[J] = sh.U;
    float(*A)[C] = sh.A;
    float *beta = sh.beta, *cum = sh.cum, *wts = sh.wts;
    int vh = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, tid = threadIdx.x;
    int j = blockIdx.y * J + lane, ratio = n_v_heads / n_k_heads;
    int kh = tiled ? vh % n_k_heads : vh / ratio;
    int key_dim = n_k_heads * R, value_dim = n_v_heads * R, channels = 2 * key_dim + value_dim;
    float* St = state + (size_t)vh * R * R;
    for (int i = warp; i < R; i += W) S[i][lane] = pos0 == 0 ? 0.f : St[(size_t)i * R + j];
    const float dtb = dt_bias[vh], sa = ssm_a[vh], scale = 1.f / sqrtf((float)R);
    for (int t0 = 0, chunk = 0; t0 < n; t0 += C, chunk++) {
        int l = min(C, n - t0);
        const float* kk = gram + ((size_t)chunk * n_k_heads + kh) * 2 * C * C;
        const float* qk = kk + C * C;
        const float* rows = conv + (size_t)t0 * channels;
        const float* keys = rows + key_dim + kh * R;
        const float* queries = rows + kh * R;
        // The rates and log-decays (wts holds the decays until the prefix sums), then each
        // token's cumulative log-decay summed from the chunk's first, in order.
        if (tid < l) {
            float b, a;
            delta_rate_decay(ba + (size_t)(t0 + tid) * ba_stride,
                             alpha ? alpha + (size_t)(t0 + tid) * n_v_heads : nullptr, vh, ratio,
                             b, a);
            beta[tid] = 1.f / (1.f + expf(-b));
            wts[tid] = softplus_f(a + dtb) * sa;
        }
        __syncthreads();
        if (tid < l) {
            float acc = 0.f;
            for (int r = 0; r <= tid; r++) acc = add_rn(acc, wts[r]);
            cum[tid] = acc;
        }
        // S0^T k_t and S0^T q_t of the warp's tokens, each summed over the state's rows in
        // order from 0.
        float sk[M], sq[M];
#pragma unroll
        for (int m = 0; m < M; m++) sk[m] = sq[m] = 0.f;
        for (int i0 = 0; i0 < R; i0 += X) {
            __syncthreads();
            for (int e = tid; e < C * X; e += blockDim.x) {
                int t = e / X, i = e % X;
                sh.Xk[t][i] = t < l ? keys[(size_t)t * channels + i0 + i] : 0.f;
                sh.Xq[t][i] = t < l ? queries[(size_t)t * channels + i0 + i] : 0.f;
            }
            __syncthreads();
            float sv[X];
#pragma unroll
            for (int i = 0; i < X; i++) sv[i] = S[i0 + i][lane];
#pragma unroll
            for (int m = 0; m < M; m++) {
                int t = warp + W * m;
#pragma unroll
                for (int i = 0; i < X; i++) {
                    sk[m] = add_rn(sk[m], mul_rn(sh.Xk[t][i], sv[i]));
                    sq[m] = add_rn(sq[m], mul_rn(sh.Xq[t][i], sv[i]));
                }
            }
        }
#pragma unroll
        for (int m = 0; m < M; m++) {
            int t = warp + W * m;
            if (t < l) {
                float v = rows[(size_t)t * channels + 2 * key_dim + vh * R + j];
                U[t][lane] = mul_rn(beta[t], v - mul_rn(expf(cum[t]), sk[m]));
            }
        }
        for (int e = tid; e < C * C; e += blockDim.x) {
            int t = e / C, r = e % C;
            if (t < l && r < t) A[t][r] = -((beta[t] * expf(cum[t] - cum[r])) * kk[t * C + r]);
        }
        __syncthreads();
        if (warp == 0) {
            for (int t = 1; t < l; t++) {
                float acc = U[t][lane];
#pragma unroll 8
                for (int r = 0; r < t; r++) acc = add_rn(acc, mul_rn(A[t][r], U[r][lane]));
                U[t][lane] = acc;
            }
        }
        __syncthreads();
        for (int e = tid; e < C * C; e += blockDim.x) {
            int t = e / C, r = e % C;
            if (t < l && r <= t) A[t][r] = expf(cum[t] - cum[r]) * qk[t * C + r];
        }
        if (tid < l) wts[tid] = expf(cum[l - 1] - cum[tid]);
        __syncthreads();
#pragma unroll
        for (int m = 0; m < M; m++) {
            int t = warp + W * m;
            if (t < l) {
                float o = mul_rn(expf(cum[t]), sq[m]);
#pragma unroll 8
                for (int r = 0; r <= t; r++) o = add_rn(o, mul_rn(A[t][r], U[r][lane]));
                out[(size_t)(t0 + t) * value_dim + vh * R + j] = mul_rn(o, scale);
            }
        }
        // The state after the chunk, the keys staged (times their weights) 8 rows at a time:
        // warp w's row i0 + w.
        const float total = expf(cum[l - 1]);
        for (int i0 = 0; i0 < R; i0 += X) {
            __syncthreads();
            for (int e = tid; e < C * X; e += blockDim.x) {
                int t = e / X, i = e % X;
                sh.Xk[t][i] = t < l ? mul_rn(wts[t], keys[(size_t)t * channels + i0 + i]) : 0.f;
            }
            __syncthreads();
            int i = i0 + warp;
            float x = mul_rn(S[i][lane], total);
#pragma unroll 8
            for (int r = 0; r < l; r++) x = add_rn(x, mul_rn(sh.Xk[r][warp], U[r][lane]));
            S[i][lane] = x;
        }
        __syncthreads();
    }
    for (int i = warp; i < R; i += W) St[(size_t)i * R + j] = S[i][lane];
}

extern "C" __global__ void delta_rule_chunks(const float* conv, const float* ba, int ba_stride,
                                             const float* alpha, const float* dt_bias,
                                             const float* ssm_a, const float* gram, float* state,
                                             int pos0, float* out, int n_k_heads, int n_v_heads,
                                             int s, int tiled, int n) {
    step_begin();
    __shared__ DeltaChunkShared sh;
    if (s == 128)
        delta_rule_chunks_in<128>(conv, ba, ba_stride, alpha, dt_bias, ssm_a, gram, state, pos0,
                                  out, n_k_heads, n_v_heads, tiled, n, sh);
    else
        delta_rule_chunks_in<64>(conv, ba, ba_stride, alpha, dt_bias, ssm_a, gram, state, pos0,
                                 out, n_k_heads, n_v_heads, tiled, n, sh);
}

// Block (vh, t), s threads: token t's read-out of value head vh, rms_norm(o) * norm * silu(z),
// as f16 (o: f32 rows of n_v_heads * s; z as delta_gates reads it).
extern "C" __global__ void delta_gated_norm_rows(const float* o, const float* in_fused,
                                                 const float* z, int z_stride, const float* norm,
                                                 u16* out, int n_v_heads, int s, int ratio,
                                                 float eps) {
    step_begin();
    int vh = blockIdx.x, t = blockIdx.y, j = threadIdx.x, zi = vh * s + j;
    size_t at = (size_t)t * n_v_heads * s + zi;
    float x = o[at];
    float r = rms_scale((double)(x * x), s, eps);
    float zv = delta_gate_z(in_fused + (size_t)t * z_stride, z ? z + (size_t)t * z_stride : nullptr,
                            zi, ratio, s);
    out[at] = f2h((x * r) * norm[j] * silu_f(zv));
}

// ---- One token of each of several sequences (the batched decode step) ------------------------
// Row t belongs to slot slot[t] at position pos[t] (rows laid out as the prompt pass's); a
// slot's states start slot * conv_stride and slot * ssm_stride floats in.

extern "C" __global__ void delta_conv_slots(const float* in, int in_stride, int fused,
                                            const float* w, float* conv_state,
                                            long long conv_stride, const u32* slot,
                                            const u32* pos, float* out, int channels, int taps,
                                            int key_dim, int s, int ratio) {
    step_begin();
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
    step_begin();
    __shared__ float qs[256], ks[256];
    int vh = blockIdx.x, t = blockIdx.y, zi = vh * s + threadIdx.x;
    int ratio = n_v_heads / n_k_heads, kh = tiled ? vh % n_k_heads : vh / ratio;
    int key_dim = n_k_heads * s, value_dim = n_v_heads * s, channels = 2 * key_dim + value_dim;
    DeltaGates g = delta_gates(ba + (size_t)t * ba_stride,
                               alpha ? alpha + (size_t)t * n_v_heads : nullptr,
                               in_fused + (size_t)t * z_stride,
                               z ? z + (size_t)t * z_stride : nullptr, vh, zi, ratio, s);
    float* S = ssm_state + (size_t)slot[t] * ssm_stride + (size_t)vh * s * s;
    float o = delta_rule_token<1>(conv + (size_t)t * channels, g, dt_bias, ssm_a, norm, S,
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
    step_begin();
    int i = blockIdx.x * blockDim.x + threadIdx.x, t = blockIdx.y, w = n_head * hd;
    if (i >= w) return;
    int h = i / hd, e = i % hd;
    const float* row = qg + (size_t)t * 2 * w;
    q[(size_t)t * w + i] = row[h * 2 * hd + e];
    g[(size_t)t * w + i] = row[h * 2 * hd + hd + e];
}

// (xq non-null: the result quantized for the next product too, quantize_lane's modes; n a
// multiple of 32)
extern "C" __global__ void sigmoid_mul(float* x, const float* g, int n, u8* xq, int mode) {
    step_begin();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        x[i] *= 1.f / (1.f + expf(-g[i]));
        if (xq) quantize_lane(x[i], i, xq, n, mode);
    }
}

extern "C" __global__ void sigmoid_mul_f16(u16* x, const float* g, long long n) {
    step_begin();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = f2h(h2f(x[i]) * (1.f / (1.f + expf(-g[i]))));
}
