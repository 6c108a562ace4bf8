// ---- Hybrid models: the gated delta-net layer and the gated attention output, one token -----
//
// (appended to kernels.cu by kernels.rs: step_begin, rms_scale, warp_sum come from there)
//
// A delta-net layer of one token is two kernels between its products: delta_conv (the causal
// convolution over the queries, keys and values, state advanced) and delta_rule (per value
// head: L2 norms, decay and rate, the state's update and read-out, the gated norm). The layer's
// states live on the device; a step at position 0 starts them from zeros instead of reading
// them, so a new sequence needs no clearing launch. docs/ARCHITECTURE.md has the layouts.

__device__ __forceinline__ float silu_f(float x) { return x / (1.f + expf(-x)); }

// ggml's softplus: ln(1 + e^x), x itself above 20.
__device__ __forceinline__ float softplus_f(float x) { return x > 20.f ? x : logf(1.f + expf(x)); }

// Where channel c of the convolution (queries of every key head, then keys, then values) is in
// the projection's output: contiguous (split projections), or in the fused ssm_in layout where
// each key head's group holds its query (s), key (s), value heads (ratio * s) and their gates.
__device__ __forceinline__ int conv_source(int c, int fused, int key_dim, int s, int ratio) {
    if (!fused) return c;
    int group = 2 * s + 2 * ratio * s;
    if (c < key_dim) return (c / s) * group + c % s;
    if (c < 2 * key_dim) return ((c - key_dim) / s) * group + s + (c - key_dim) % s;
    int j = c - 2 * key_dim, vw = ratio * s;
    return (j / vw) * group + 2 * s + j % vw;
}

// out[c] = silu(sum over taps of w[c * taps + i] * window_i), the window being the channel's
// last taps - 1 inputs (state, oldest first) then this token's; the state moves on by one.
// A thread per channel; at position 0 the state counts as zeros.
extern "C" __global__ void delta_conv(const float* in, int fused, const float* w, float* state,
                                      const u32* pos, float* out, int channels, int taps,
                                      int key_dim, int s, int ratio) {
    step_begin();
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= channels) return;
    bool fresh = *pos == 0;
    float x = in[conv_source(c, fused, key_dim, s, ratio)];
    const float* wc = w + (size_t)c * taps;
    // Summed in f32 from the oldest tap, as the CPU (and ggml's ssm_conv) does.
    float acc = 0.f;
    for (int i = 0; i < taps - 1; i++) {
        float h = fresh ? 0.f : state[(size_t)i * channels + c];
        acc += h * wc[i];
        if (i > 0) state[(size_t)(i - 1) * channels + c] = h;
    }
    acc += x * wc[taps - 1];
    if (taps > 1) state[(size_t)(taps - 2) * channels + c] = x;
    out[c] = silu_f(acc);
}

// x / |x| over the s values of sh (one per thread) as the CPU computes it for the delta-net:
// an RMS norm with epsilon eps / s, then a scale by 1 / sqrt(s).
__device__ __forceinline__ float l2_normalized(float x, int s, float eps) {
    float r = rms_scale((double)(x * x), s, eps / (float)s);
    return (x * r) * (1.f / sqrtf((float)s));
}

// One value head (block vh, a thread per value dimension j; s threads) of one token: its key
// head's query and key L2-normalized, beta = sigmoid(b), decay = exp(softplus(a + dt_bias) *
// ssm_a); the state S (s x s, key-major: S[i][j] at i * s + j) decayed, u = beta (v - S^T k),
// S += k u^T, o = S^T q / sqrt(s); then rms_norm(o) * norm * silu(z) into out. The gates: in
// ba's fused layout (per key head its value heads' b, then their a) when alpha is null, else b
// from ba and a from alpha. The gates z: in the fused ssm_in layout of in_fused when z is null.
extern "C" __global__ void delta_rule(const float* conv, const float* ba, const float* alpha,
                                      const float* dt_bias, const float* ssm_a,
                                      const float* norm, const float* in_fused, const float* z,
                                      float* state, const u32* pos, float* out, int n_k_heads,
                                      int n_v_heads, int s, int tiled, float eps) {
    step_begin();
    __shared__ float qs[256], ks[256];
    int vh = blockIdx.x, j = threadIdx.x;
    int ratio = n_v_heads / n_k_heads, key_dim = n_k_heads * s;
    int kh = tiled ? vh % n_k_heads : vh / ratio;
    bool fresh = *pos == 0;
    qs[j] = l2_normalized(conv[kh * s + j], s, eps);
    ks[j] = l2_normalized(conv[key_dim + kh * s + j], s, eps);
    float v = conv[2 * key_dim + vh * s + j];
    float b, a;
    if (alpha) {
        b = ba[vh];
        a = alpha[vh];
    } else {
        int g = vh / ratio, r = vh % ratio;
        b = ba[g * 2 * ratio + r];
        a = ba[g * 2 * ratio + ratio + r];
    }
    float beta = 1.f / (1.f + expf(-b));
    float decay = expf(softplus_f(a + dt_bias[vh]) * ssm_a[vh]);
    __syncthreads();
    float* S = state + (size_t)vh * s * s;
    // S^T k over the decayed state, the sum in key order as the CPU's.
    float sk = 0.f;
    for (int i = 0; i < s; i++) sk += ks[i] * (fresh ? 0.f : S[(size_t)i * s + j] * decay);
    float u = (v - sk) * beta;
    float o = 0.f;
    for (int i = 0; i < s; i++) {
        float x = (fresh ? 0.f : S[(size_t)i * s + j] * decay) + ks[i] * u;
        S[(size_t)i * s + j] = x;
        o += qs[i] * x;
    }
    o *= 1.f / sqrtf((float)s);
    float r = rms_scale((double)(o * o), s, eps);
    int zi = vh * s + j;
    float zv = z ? z[zi] : in_fused[(zi / (ratio * s)) * (2 * s + 2 * ratio * s) + 2 * s +
                                    ratio * s + zi % (ratio * s)];
    out[zi] = (o * r) * norm[j] * silu_f(zv);
}

// Qwen3-Next's gated attention output, one token. split_query_gate: the Q projection's rows
// (per head hd query values, then hd gate values) into the queries q and the gates g.
extern "C" __global__ void split_query_gate(const float* qg, float* q, float* g, int n_head,
                                            int hd) {
    step_begin();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_head * hd) return;
    int h = i / hd, e = i % hd;
    q[i] = qg[(size_t)h * 2 * hd + e];
    g[i] = qg[(size_t)h * 2 * hd + hd + e];
}

// x *= sigmoid(g) over n values (ggml's sigmoid: 1 / (1 + e^-x)).
extern "C" __global__ void sigmoid_mul(float* x, const float* g, int n) {
    step_begin();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= 1.f / (1.f + expf(-g[i]));
}

// ---- The same over a prompt's n tokens (the batched pass) -----------------------------------
//
// The projections are GEMMs over the batch's rows (row t of `in` is token t's, in_stride
// floats apart); the convolution runs a thread per channel along the tokens; the delta rule a
// block per value head along the tokens: the recurrence of the decode step token after token
// in one launch, not yet the chunked form on the tensor cores.

// delta_conv over n tokens at positions pos0.. (pos0 == 0: the state starts from zeros).
extern "C" __global__ void delta_conv_rows(const float* in, int in_stride, int fused,
                                           const float* w, float* state, int pos0, float* out,
                                           int channels, int taps, int key_dim, int s, int ratio,
                                           int n) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= channels) return;
    const float* wc = w + (size_t)c * taps;
    int src = conv_source(c, fused, key_dim, s, ratio);
    // The window's older inputs, oldest first (taps is small: at most 8 here).
    float hist[8];
    for (int i = 0; i < taps - 1; i++) hist[i] = pos0 == 0 ? 0.f : state[(size_t)i * channels + c];
    for (int t = 0; t < n; t++) {
        float x = in[(size_t)t * in_stride + src];
        float acc = 0.f;
        for (int i = 0; i < taps - 1; i++) acc += hist[i] * wc[i];
        acc += x * wc[taps - 1];
        for (int i = 0; i + 1 < taps - 1; i++) hist[i] = hist[i + 1];
        if (taps > 1) hist[taps - 2] = x;
        out[(size_t)t * channels + c] = silu_f(acc);
    }
    for (int i = 0; i < taps - 1; i++) state[(size_t)i * channels + c] = hist[i];
}

// delta_rule over n tokens (block vh, s threads; the state read and written in place, a
// thread's column in L2 from token to token): row t of conv holds token t's channels, of ba
// (ba_stride) its gates, of z or in_fused (z_stride) its output gates; out's row t
// (value_dim halfs) the gated norm as f16 for the output GEMM.
extern "C" __global__ void delta_rule_rows(const float* conv, const float* ba, int ba_stride,
                                           const float* alpha, const float* dt_bias,
                                           const float* ssm_a, const float* norm,
                                           const float* in_fused, const float* z, int z_stride,
                                           float* state, int pos0, u16* out, int n_k_heads,
                                           int n_v_heads, int s, int tiled, float eps, int n) {
    __shared__ float qs[256], ks[256];
    int vh = blockIdx.x, j = threadIdx.x;
    int ratio = n_v_heads / n_k_heads, key_dim = n_k_heads * s, value_dim = n_v_heads * s;
    int channels = 2 * key_dim + value_dim;
    int kh = tiled ? vh % n_k_heads : vh / ratio;
    float* S = state + (size_t)vh * s * s;
    float scale = 1.f / sqrtf((float)s);
    for (int t = 0; t < n; t++) {
        bool fresh = pos0 == 0 && t == 0;
        const float* c = conv + (size_t)t * channels;
        __syncthreads();
        qs[j] = l2_normalized(c[kh * s + j], s, eps);
        ks[j] = l2_normalized(c[key_dim + kh * s + j], s, eps);
        float v = c[2 * key_dim + vh * s + j];
        const float* g = ba + (size_t)t * ba_stride;
        float b, a;
        if (alpha) {
            b = g[vh];
            a = alpha[(size_t)t * n_v_heads + vh];
        } else {
            int kg = vh / ratio, r = vh % ratio;
            b = g[kg * 2 * ratio + r];
            a = g[kg * 2 * ratio + ratio + r];
        }
        float beta = 1.f / (1.f + expf(-b));
        float decay = expf(softplus_f(a + dt_bias[vh]) * ssm_a[vh]);
        __syncthreads();
        float sk = 0.f;
        for (int i = 0; i < s; i++) sk += ks[i] * (fresh ? 0.f : S[(size_t)i * s + j] * decay);
        float u = (v - sk) * beta;
        float o = 0.f;
        for (int i = 0; i < s; i++) {
            float x = (fresh ? 0.f : S[(size_t)i * s + j] * decay) + ks[i] * u;
            S[(size_t)i * s + j] = x;
            o += qs[i] * x;
        }
        o *= scale;
        float r = rms_scale((double)(o * o), s, eps);
        int zi = vh * s + j;
        float zv = z ? z[(size_t)t * z_stride + zi]
                     : in_fused[(size_t)t * z_stride + (zi / (ratio * s)) * (2 * s + 2 * ratio * s) +
                                2 * s + ratio * s + zi % (ratio * s)];
        out[(size_t)t * value_dim + zi] = f2h((o * r) * norm[j] * silu_f(zv));
    }
}

// The gated attention output over a batch's rows: split_query_gate per token (row t of qg is
// 2 * n_head * hd floats; q and g rows of n_head * hd), and attention rows (f16) times sigmoid
// of their gates.
extern "C" __global__ void split_query_gate_rows(const float* qg, float* q, float* g, int n_head,
                                                 int hd) {
    int i = blockIdx.x * blockDim.x + threadIdx.x, t = blockIdx.y, w = n_head * hd;
    if (i >= w) return;
    int h = i / hd, e = i % hd;
    const float* row = qg + (size_t)t * 2 * w;
    q[(size_t)t * w + i] = row[h * 2 * hd + e];
    g[(size_t)t * w + i] = row[h * 2 * hd + hd + e];
}

extern "C" __global__ void sigmoid_mul_f16(u16* x, const float* g, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = f2h(h2f(x[i]) * (1.f / (1.f + expf(-g[i]))));
}
