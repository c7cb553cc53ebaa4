// LayerNorm over the last dimension, one block of 256 threads per row: mean, then the biased
// variance around it (two block reductions), then out = (x - mean) / sqrt(var + eps) * w + b.
#include <cstdint>
#include <cuda_runtime.h>

constexpr int kThreads = 256;

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

extern "C" int layernorm_rows(const float* x, const float* weight, const float* bias, float* out, int64_t rows,
                              int64_t cols, float eps, cudaStream_t stream) {
    layernorm_rows_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(x, weight, bias, out, cols, eps);
    return static_cast<int>(cudaGetLastError());
}
