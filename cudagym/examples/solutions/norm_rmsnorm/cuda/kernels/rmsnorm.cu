// RMSNorm over the last dimension, one block of 256 threads per row: a block reduction of x^2,
// then out = x / sqrt(sum / cols + eps) * weight.
#include <cstdint>
#include <cuda_runtime.h>

constexpr int kThreads = 256;

__global__ void rmsnorm_rows_kernel(const float* __restrict__ x, const float* __restrict__ weight,
                                    float* __restrict__ out, int64_t cols, float eps) {
    __shared__ float buf[kThreads];
    const float* xr = x + static_cast<int64_t>(blockIdx.x) * cols;
    float* orow = out + static_cast<int64_t>(blockIdx.x) * cols;
    float acc = 0.0f;
    for (int64_t c = threadIdx.x; c < cols; c += kThreads) acc += xr[c] * xr[c];
    buf[threadIdx.x] = acc;
    __syncthreads();
    for (int s = kThreads / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) buf[threadIdx.x] += buf[threadIdx.x + s];
        __syncthreads();
    }
    const float rms = sqrtf(buf[0] / static_cast<float>(cols) + eps);
    for (int64_t c = threadIdx.x; c < cols; c += kThreads) orow[c] = xr[c] / rms * weight[c];
}

extern "C" int rmsnorm_rows(const float* x, const float* weight, float* out, int64_t rows, int64_t cols, float eps,
                            cudaStream_t stream) {
    rmsnorm_rows_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(x, weight, out, cols, eps);
    return static_cast<int>(cudaGetLastError());
}
