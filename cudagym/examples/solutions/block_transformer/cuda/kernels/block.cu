// The kernels of a pre-norm transformer block (GPU), mirroring the CPU version: LayerNorm and row
// softmax with one block of 256 threads per row; a 16x16 tiled GEMM with a fused epilogue (bias,
// optional GELU, optional residual); attention scores and probs @ V with one thread per output.
#include <cstdint>
#include <cuda_runtime.h>

constexpr int kThreads = 256;
constexpr int kTile = 16;

__device__ float block_sum(float v, float* buf) {
    buf[threadIdx.x] = v;
    __syncthreads();
    for (int s = kThreads / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) buf[threadIdx.x] += buf[threadIdx.x + s];
        __syncthreads();
    }
    const float r = buf[0];
    __syncthreads();  // buf is reused by the next reduction
    return r;
}

__device__ float block_max(float v, float* buf) {
    buf[threadIdx.x] = v;
    __syncthreads();
    for (int s = kThreads / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) buf[threadIdx.x] = fmaxf(buf[threadIdx.x], buf[threadIdx.x + s]);
        __syncthreads();
    }
    const float r = buf[0];
    __syncthreads();
    return r;
}

__global__ void layernorm_rows_kernel(const float* __restrict__ x, const float* __restrict__ weight,
                                      const float* __restrict__ bias, float* __restrict__ out, int64_t cols,
                                      float eps) {
    __shared__ float buf[kThreads];
    const float* xr = x + static_cast<int64_t>(blockIdx.x) * cols;
    float* orow = out + static_cast<int64_t>(blockIdx.x) * cols;
    float acc = 0.0f;
    for (int64_t c = threadIdx.x; c < cols; c += kThreads) acc += xr[c];
    const float mean = block_sum(acc, buf) / static_cast<float>(cols);
    acc = 0.0f;
    for (int64_t c = threadIdx.x; c < cols; c += kThreads) {
        const float d = xr[c] - mean;
        acc += d * d;
    }
    const float inv_std = 1.0f / sqrtf(block_sum(acc, buf) / static_cast<float>(cols) + eps);
    for (int64_t c = threadIdx.x; c < cols; c += kThreads) orow[c] = (xr[c] - mean) * inv_std * weight[c] + bias[c];
}

// out[m, n] = act(sum_k x[m, k] * w[n, k] + b[n]) (+ residual[m, n]); act: 0 identity, 1 erf-GELU.
__global__ void linear_fused_kernel(const float* __restrict__ x, const float* __restrict__ w,
                                    const float* __restrict__ b, const float* __restrict__ residual,
                                    float* __restrict__ out, int64_t m_size, int64_t n_size, int64_t k_size,
                                    int act) {
    __shared__ float xs[kTile][kTile + 1];
    __shared__ float ws[kTile][kTile + 1];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int64_t m = static_cast<int64_t>(blockIdx.y) * kTile + ty;
    const int64_t n = static_cast<int64_t>(blockIdx.x) * kTile + tx;
    const int64_t wn = static_cast<int64_t>(blockIdx.x) * kTile + ty;
    float acc = 0.0f;
    for (int64_t k0 = 0; k0 < k_size; k0 += kTile) {
        const int64_t k = k0 + tx;
        xs[ty][tx] = (m < m_size && k < k_size) ? x[m * k_size + k] : 0.0f;
        ws[ty][tx] = (wn < n_size && k < k_size) ? w[wn * k_size + k] : 0.0f;
        __syncthreads();
        for (int kk = 0; kk < kTile; ++kk) acc += xs[ty][kk] * ws[tx][kk];
        __syncthreads();
    }
    if (m < m_size && n < n_size) {
        float v = acc + b[n];
        if (act == 1) v = 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
        if (residual) v = residual[m * n_size + n] + v;
        out[m * n_size + n] = v;
    }
}

// qkv: [B, S, 3 * H * hd] (q | k | v, head-major inside each); scores: [B, H, S, S].
__global__ void attention_scores_kernel(const float* __restrict__ qkv, float* __restrict__ scores, int64_t batch,
                                        int64_t seq, int64_t heads, int64_t head_dim, float sqrt_head_dim) {
    const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= batch * heads * seq * seq) return;
    const int64_t j = i % seq, qi = (i / seq) % seq, h = (i / (seq * seq)) % heads, b = i / (seq * seq * heads);
    const int64_t d = heads * head_dim;
    const float* q = qkv + (b * seq + qi) * 3 * d + h * head_dim;
    const float* k = qkv + (b * seq + j) * 3 * d + d + h * head_dim;
    float acc = 0.0f;
    for (int64_t e = 0; e < head_dim; ++e) acc += q[e] * k[e];
    scores[i] = acc / sqrt_head_dim;
}

__global__ void softmax_rows_kernel(const float* __restrict__ x, float* __restrict__ out, int64_t cols) {
    __shared__ float buf[kThreads];
    const float* xr = x + static_cast<int64_t>(blockIdx.x) * cols;
    float* orow = out + static_cast<int64_t>(blockIdx.x) * cols;
    float m = -INFINITY;
    for (int64_t c = threadIdx.x; c < cols; c += kThreads) m = fmaxf(m, xr[c]);
    m = block_max(m, buf);
    float acc = 0.0f;
    for (int64_t c = threadIdx.x; c < cols; c += kThreads) acc += expf(xr[c] - m);
    const float inv = 1.0f / block_sum(acc, buf);
    for (int64_t c = threadIdx.x; c < cols; c += kThreads) orow[c] = expf(xr[c] - m) * inv;
}

// y[b, i, h * hd + e] = sum_j probs[b, h, i, j] * v[b, j, h, e]
__global__ void attention_apply_kernel(const float* __restrict__ probs, const float* __restrict__ qkv,
                                       float* __restrict__ y, int64_t batch, int64_t seq, int64_t heads,
                                       int64_t head_dim) {
    const int64_t d = heads * head_dim;
    const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= batch * seq * d) return;
    const int64_t e = i % head_dim, h = (i / head_dim) % heads, qi = (i / d) % seq, b = i / (d * seq);
    const float* p = probs + ((b * heads + h) * seq + qi) * seq;
    const float* v = qkv + b * seq * 3 * d + 2 * d + h * head_dim + e;
    float acc = 0.0f;
    for (int64_t j = 0; j < seq; ++j) acc += p[j] * v[j * 3 * d];
    y[i] = acc;
}

static unsigned blocks_for(int64_t n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }

extern "C" int layernorm_rows(const float* x, const float* weight, const float* bias, float* out, int64_t rows,
                              int64_t cols, float eps, cudaStream_t stream) {
    layernorm_rows_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(x, weight, bias, out, cols, eps);
    return static_cast<int>(cudaGetLastError());
}

extern "C" int linear_fused(const float* x, const float* w, const float* b, const float* residual, float* out,
                            int64_t m_size, int64_t n_size, int64_t k_size, int act, cudaStream_t stream) {
    const dim3 block(kTile, kTile);
    const dim3 grid(static_cast<unsigned>((n_size + kTile - 1) / kTile),
                    static_cast<unsigned>((m_size + kTile - 1) / kTile));
    linear_fused_kernel<<<grid, block, 0, stream>>>(x, w, b, residual, out, m_size, n_size, k_size, act);
    return static_cast<int>(cudaGetLastError());
}

extern "C" int attention_scores(const float* qkv, float* scores, int64_t batch, int64_t seq, int64_t heads,
                                int64_t head_dim, float sqrt_head_dim, cudaStream_t stream) {
    attention_scores_kernel<<<blocks_for(batch * heads * seq * seq), kThreads, 0, stream>>>(
        qkv, scores, batch, seq, heads, head_dim, sqrt_head_dim);
    return static_cast<int>(cudaGetLastError());
}

extern "C" int softmax_rows(const float* x, float* out, int64_t rows, int64_t cols, cudaStream_t stream) {
    softmax_rows_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(x, out, cols);
    return static_cast<int>(cudaGetLastError());
}

extern "C" int attention_apply(const float* probs, const float* qkv, float* y, int64_t batch, int64_t seq,
                               int64_t heads, int64_t head_dim, cudaStream_t stream) {
    attention_apply_kernel<<<blocks_for(batch * seq * heads * head_dim), kThreads, 0, stream>>>(
        probs, qkv, y, batch, seq, heads, head_dim);
    return static_cast<int>(cudaGetLastError());
}
