// out[m, n] = gelu(sum_k x[m, k] * w[n, k] + b1[n] + b2[n]), w in nn.Linear's [out, in] layout.
// A 16x16 shared-memory tiled GEMM, one thread per output; both tiles are loaded along k
// (coalesced), and the w tile is padded to 17 columns so that reading it by column is free of
// bank conflicts. The epilogue adds both biases and applies erf-GELU.
#include <cstdint>
#include <cuda_runtime.h>

constexpr int kTile = 16;

__global__ void linear_bias_gelu_kernel(const float* __restrict__ x, const float* __restrict__ w,
                                        const float* __restrict__ b1, const float* __restrict__ b2,
                                        float* __restrict__ out, int64_t m_size, int64_t n_size, int64_t k_size) {
    __shared__ float xs[kTile][kTile + 1];
    __shared__ float ws[kTile][kTile + 1];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int64_t m = static_cast<int64_t>(blockIdx.y) * kTile + ty;
    const int64_t n = static_cast<int64_t>(blockIdx.x) * kTile + tx;
    const int64_t wn = static_cast<int64_t>(blockIdx.x) * kTile + ty;  // the w row this thread loads
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
        const float v = (acc + b1[n]) + b2[n];
        out[m * n_size + n] = 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
    }
}

extern "C" int linear_bias_gelu(const float* x, const float* w, const float* b1, const float* b2, float* out,
                                int64_t m_size, int64_t n_size, int64_t k_size, cudaStream_t stream) {
    const dim3 block(kTile, kTile);
    const dim3 grid(static_cast<unsigned>((n_size + kTile - 1) / kTile),
                    static_cast<unsigned>((m_size + kTile - 1) / kTile));
    linear_bias_gelu_kernel<<<grid, block, 0, stream>>>(x, w, b1, b2, out, m_size, n_size, k_size);
    return static_cast<int>(cudaGetLastError());
}
