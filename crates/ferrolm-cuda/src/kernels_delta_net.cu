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
