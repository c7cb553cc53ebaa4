// c[b] = a[b] @ bm[b] for row-major a: [B, M, K], bm: [B, K, N]: a 16x16 shared-memory tiled GEMM
// per batch (blockIdx.z), one thread per output, accumulating k = 0..K-1 in order.
#include <cstdint>
#include <cuda_runtime.h>

constexpr int kTile = 16;

__global__ void bmm_kernel(const float* __restrict__ a, const float* __restrict__ bm, float* __restrict__ c,
                           int64_t m_size, int64_t n_size, int64_t k_size) {
    __shared__ float as[kTile][kTile];
    __shared__ float bs[kTile][kTile];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int64_t b = blockIdx.z;
    const int64_t m = static_cast<int64_t>(blockIdx.y) * kTile + ty;
    const int64_t n = static_cast<int64_t>(blockIdx.x) * kTile + tx;
    const float* ab = a + b * m_size * k_size;
    const float* bb = bm + b * k_size * n_size;
    float acc = 0.0f;
    for (int64_t k0 = 0; k0 < k_size; k0 += kTile) {
        as[ty][tx] = (m < m_size && k0 + tx < k_size) ? ab[m * k_size + k0 + tx] : 0.0f;
        bs[ty][tx] = (k0 + ty < k_size && n < n_size) ? bb[(k0 + ty) * n_size + n] : 0.0f;
        __syncthreads();
        for (int kk = 0; kk < kTile; ++kk) acc += as[ty][kk] * bs[kk][tx];
        __syncthreads();
    }
    if (m < m_size && n < n_size) c[(b * m_size + m) * n_size + n] = acc;
}

extern "C" int bmm(const float* a, const float* bm, float* c, int64_t batch, int64_t m_size, int64_t n_size,
                   int64_t k_size, cudaStream_t stream) {
    const dim3 block(kTile, kTile);
    const dim3 grid(static_cast<unsigned>((n_size + kTile - 1) / kTile),
                    static_cast<unsigned>((m_size + kTile - 1) / kTile), static_cast<unsigned>(batch));
    bmm_kernel<<<grid, block, 0, stream>>>(a, bm, c, m_size, n_size, k_size);
    return static_cast<int>(cudaGetLastError());
}
