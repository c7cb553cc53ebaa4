// out[r] = sum_c x[r, c]: one block of 256 threads per row; thread t sums columns t, t + 256, ...
// and a shared-memory tree combines the 256 partial sums.
#include <cstdint>
#include <cuda_runtime.h>

constexpr int kThreads = 256;

__global__ void row_sum_kernel(const float* __restrict__ x, float* __restrict__ out, int64_t cols) {
    __shared__ float buf[kThreads];
    const float* xr = x + static_cast<int64_t>(blockIdx.x) * cols;
    float acc = 0.0f;
    for (int64_t c = threadIdx.x; c < cols; c += kThreads) acc += xr[c];
    buf[threadIdx.x] = acc;
    __syncthreads();
    for (int s = kThreads / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) buf[threadIdx.x] += buf[threadIdx.x + s];
        __syncthreads();
    }
    if (threadIdx.x == 0) out[blockIdx.x] = buf[0];
}

extern "C" int row_sum(const float* x, float* out, int64_t rows, int64_t cols, cudaStream_t stream) {
    row_sum_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(x, out, cols);
    return static_cast<int>(cudaGetLastError());
}
