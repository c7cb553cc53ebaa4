// out[i] = min(max(x[i] + residual[i], 0), clamp_max); one thread per element.
#include <cstdint>
#include <cuda_runtime.h>

__global__ void residual_relu_clamp_kernel(const float* __restrict__ x, const float* __restrict__ residual,
                                           float* __restrict__ out, int64_t n, float clamp_max) {
    const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v = x[i] + residual[i];
    v = v > 0.0f ? v : 0.0f;
    out[i] = v < clamp_max ? v : clamp_max;
}

extern "C" int residual_relu_clamp(const float* x, const float* residual, float* out, int64_t n, float clamp_max,
                                   cudaStream_t stream) {
    const int threads = 256;
    const unsigned blocks = static_cast<unsigned>((n + threads - 1) / threads);
    residual_relu_clamp_kernel<<<blocks, threads, 0, stream>>>(x, residual, out, n, clamp_max);
    return static_cast<int>(cudaGetLastError());
}
