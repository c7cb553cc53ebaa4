// Row softmax: one block of 256 threads per row. Pass 1: max (strided partial maxima + shared-memory
// tree); pass 2: sum of exp(x - max) the same way; pass 3: write.
#include <cstdint>
#include <cuda_runtime.h>

constexpr int kThreads = 256;

__device__ float block_max(float v, float* buf) {
    buf[threadIdx.x] = v;
    __syncthreads();
    for (int s = kThreads / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) buf[threadIdx.x] = fmaxf(buf[threadIdx.x], buf[threadIdx.x + s]);
        __syncthreads();
    }
    const float r = buf[0];
    __syncthreads();  // buf is reused by the next reduction
    return r;
}

__device__ float block_sum(float v, float* buf) {
    buf[threadIdx.x] = v;
    __syncthreads();
    for (int s = kThreads / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) buf[threadIdx.x] += buf[threadIdx.x + s];
        __syncthreads();
    }
    const float r = buf[0];
    __syncthreads();
    return r;
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
    const float s = block_sum(acc, buf);
    const float inv = 1.0f / s;
    for (int64_t c = threadIdx.x; c < cols; c += kThreads) orow[c] = expf(xr[c] - m) * inv;
}

extern "C" int softmax_rows(const float* x, float* out, int64_t rows, int64_t cols, cudaStream_t stream) {
    softmax_rows_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(x, out, cols);
    return static_cast<int>(cudaGetLastError());
}
