// out[r, c] = gelu(x[r, c] * scale + bias[c]), exact (erf) GELU; one thread per element.
#include <cstdint>
#include <cuda_runtime.h>

__global__ void scale_bias_gelu_kernel(const float* __restrict__ x, const float* __restrict__ bias,
                                       float* __restrict__ out, int64_t n, int64_t cols, float scale) {
    const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float v = x[i] * scale + bias[i % cols];
    out[i] = 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
}

extern "C" int scale_bias_gelu(const float* x, const float* bias, float* out, int64_t rows, int64_t cols, float scale,
                               cudaStream_t stream) {
    const int64_t n = rows * cols;
    const int threads = 256;
    const unsigned blocks = static_cast<unsigned>((n + threads - 1) / threads);
    scale_bias_gelu_kernel<<<blocks, threads, 0, stream>>>(x, bias, out, n, cols, scale);
    return static_cast<int>(cudaGetLastError());
}
