// The kernels of a pre-norm transformer block (CPU): LayerNorm, a linear layer with a fused
// epilogue (bias, optional GELU, optional residual), attention scores, row softmax, and the
// probability-weighted sum of values. Row reductions use 256 strided partial results and a
// pairwise tree, like one CUDA block of 256 threads.
#include <cmath>
#include <cstdint>

static constexpr int kLanes = 256;
static constexpr int kDotLanes = 16;

static float tree_sum(float* part) {
    for (int s = kLanes / 2; s > 0; s >>= 1)
        for (int t = 0; t < s; ++t) part[t] += part[t + s];
    return part[0];
}

static float tree_max(float* part) {
    for (int s = kLanes / 2; s > 0; s >>= 1)
        for (int t = 0; t < s; ++t) part[t] = part[t] > part[t + s] ? part[t] : part[t + s];
    return part[0];
}

extern "C" void layernorm_rows(const float* x, const float* weight, const float* bias, float* out, int64_t rows,
                               int64_t cols, float eps) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const float* xr = x + r * cols;
        float* orow = out + r * cols;
        float part[kLanes] = {0.0f};
        for (int64_t c = 0; c < cols; ++c) part[c % kLanes] += xr[c];
        const float mean = tree_sum(part) / static_cast<float>(cols);
        for (int t = 0; t < kLanes; ++t) part[t] = 0.0f;
        for (int64_t c = 0; c < cols; ++c) {
            const float d = xr[c] - mean;
            part[c % kLanes] += d * d;
        }
        const float inv_std = 1.0f / std::sqrt(tree_sum(part) / static_cast<float>(cols) + eps);
        for (int64_t c = 0; c < cols; ++c) orow[c] = (xr[c] - mean) * inv_std * weight[c] + bias[c];
    }
}

// out[m, n] = act(sum_k x[m, k] * w[n, k] + b[n]) (+ residual[m, n] if residual is not null);
// act: 0 identity, 1 exact GELU.
extern "C" void linear_fused(const float* x, const float* w, const float* b, const float* residual, float* out,
                             int64_t m_size, int64_t n_size, int64_t k_size, int act) {
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t m = 0; m < m_size; ++m) {
        for (int64_t n = 0; n < n_size; ++n) {
            const float* xa = x + m * k_size;
            const float* wb = w + n * k_size;
            float part[kDotLanes] = {0.0f};
            int64_t k = 0;
            for (; k + kDotLanes <= k_size; k += kDotLanes)
                for (int l = 0; l < kDotLanes; ++l) part[l] += xa[k + l] * wb[k + l];
            for (int l = 0; k + l < k_size; ++l) part[l] += xa[k + l] * wb[k + l];
            float v = 0.0f;
            for (int l = 0; l < kDotLanes; ++l) v += part[l];
            v += b[n];
            if (act == 1) v = 0.5f * v * (1.0f + std::erf(v * 0.70710678118654752f));
            if (residual) v = residual[m * n_size + n] + v;
            out[m * n_size + n] = v;
        }
    }
}

// qkv: [B, S, 3 * H * hd] (q | k | v, head-major inside each); scores: [B, H, S, S].
extern "C" void attention_scores(const float* qkv, float* scores, int64_t batch, int64_t seq, int64_t heads,
                                 int64_t head_dim, float sqrt_head_dim) {
    const int64_t d = heads * head_dim;
#pragma omp parallel for collapse(3) schedule(static)
    for (int64_t b = 0; b < batch; ++b)
        for (int64_t h = 0; h < heads; ++h)
            for (int64_t i = 0; i < seq; ++i) {
                const float* q = qkv + (b * seq + i) * 3 * d + h * head_dim;
                float* srow = scores + ((b * heads + h) * seq + i) * seq;
                for (int64_t j = 0; j < seq; ++j) {
                    const float* k = qkv + (b * seq + j) * 3 * d + d + h * head_dim;
                    float acc = 0.0f;
                    for (int64_t e = 0; e < head_dim; ++e) acc += q[e] * k[e];
                    srow[j] = acc / sqrt_head_dim;
                }
            }
}

extern "C" void softmax_rows(const float* x, float* out, int64_t rows, int64_t cols) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const float* xr = x + r * cols;
        float* orow = out + r * cols;
        float part[kLanes];
        for (int t = 0; t < kLanes; ++t) part[t] = -INFINITY;
        for (int64_t c = 0; c < cols; ++c) part[c % kLanes] = xr[c] > part[c % kLanes] ? xr[c] : part[c % kLanes];
        const float m = tree_max(part);
        for (int t = 0; t < kLanes; ++t) part[t] = 0.0f;
        for (int64_t c = 0; c < cols; ++c) part[c % kLanes] += std::exp(xr[c] - m);
        const float inv = 1.0f / tree_sum(part);
        for (int64_t c = 0; c < cols; ++c) orow[c] = std::exp(xr[c] - m) * inv;
    }
}

// y[b, i, h * hd + e] = sum_j probs[b, h, i, j] * v[b, j, h, e]
extern "C" void attention_apply(const float* probs, const float* qkv, float* y, int64_t batch, int64_t seq,
                                int64_t heads, int64_t head_dim) {
    const int64_t d = heads * head_dim;
#pragma omp parallel for collapse(3) schedule(static)
    for (int64_t b = 0; b < batch; ++b)
        for (int64_t h = 0; h < heads; ++h)
            for (int64_t i = 0; i < seq; ++i) {
                const float* p = probs + ((b * heads + h) * seq + i) * seq;
                float* yrow = y + (b * seq + i) * d + h * head_dim;
                for (int64_t e = 0; e < head_dim; ++e) yrow[e] = 0.0f;
                for (int64_t j = 0; j < seq; ++j) {
                    const float* v = qkv + (b * seq + j) * 3 * d + 2 * d + h * head_dim;
                    for (int64_t e = 0; e < head_dim; ++e) yrow[e] += p[j] * v[e];
                }
            }
}
