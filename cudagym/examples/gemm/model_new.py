"""A tiled tensor-core GEMM for the half-precision GEMM family (`cudagym tasks gemm`): C = A @ B.

Written for cudagym as an honest reference point against the family's baselines (torch.matmul,
torch.compile, cuBLASLt heuristic and autotuned), not to beat them. One kernel, templated on the
element type (fp16 or bf16), any M, N, K:

- a 128 x 128 tile of C per block of 8 warps; each warp owns 32 x 64 of it, 2 x 4 WMMA 16x16x16
  fragments accumulating in fp32;
- K in steps of 32: the block stages A[128, 32] and B[32, 128] in shared memory (rows padded by
  8 elements against bank conflicts), 16-byte vector loads where a whole vector is in bounds and
  aligned, element loads (zero past the edges) elsewhere, so unaligned shapes stay correct;
- the epilogue rounds each fragment once through a per-warp staging tile, storing only the
  elements inside C.

No double buffering, no asynchronous copies, no swizzle: expect a fraction of cuBLAS's rate.
Check it with `cudagym check gemm/gemm.parquet:TASK_ID examples/gemm/model_new.py` (GPU only).
"""

import torch.nn as nn
from torch.utils.cpp_extension import load_inline

CUDA_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <mma.h>

using namespace nvcuda;

constexpr int BM = 128, BN = 128, BK = 32;
constexpr int PAD = 8;
constexpr int LDA = BK + PAD;   // A tile row pitch (elements)
constexpr int LDB = BN + PAD;   // B tile row pitch
constexpr int THREADS = 256;    // 8 warps: 4 along M x 2 along N
constexpr int WM = 32, WN = 64; // one warp's share of the tile

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}
template <typename T> __device__ __forceinline__ T zero() { return from_float<T>(0.f); }

template <typename T>
__global__ void __launch_bounds__(THREADS) wmma_gemm(const T* __restrict__ A, const T* __restrict__ B,
                                                     T* __restrict__ C, int M, int N, int K, bool vec_a, bool vec_b) {
  __shared__ __align__(128) T As[BM * LDA];
  __shared__ __align__(128) T Bs[BK * LDB];
  __shared__ __align__(128) float stage[THREADS / 32][16 * 16];

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int warp_m = warp % 4, warp_n = warp / 4;
  const int bm = blockIdx.y * BM, bn = blockIdx.x * BN;

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][4];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) wmma::fill_fragment(acc[i][j], 0.f);

  for (int k0 = 0; k0 < K; k0 += BK) {
    // A[bm:bm+128, k0:k0+32]: 512 vectors of 8, two per thread
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      int v = tid + i * THREADS, r = v / 4, c = (v % 4) * 8;
      int gm = bm + r, gk = k0 + c;
      T* dst = &As[r * LDA + c];
      if (vec_a && gm < M && gk + 8 <= K) {
        *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(&A[(size_t)gm * K + gk]);
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) dst[e] = (gm < M && gk + e < K) ? A[(size_t)gm * K + gk + e] : zero<T>();
      }
    }
    // B[k0:k0+32, bn:bn+128]: 512 vectors of 8, two per thread
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      int v = tid + i * THREADS, r = v / 16, c = (v % 16) * 8;
      int gk = k0 + r, gn = bn + c;
      T* dst = &Bs[r * LDB + c];
      if (vec_b && gk < K && gn + 8 <= N) {
        *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(&B[(size_t)gk * N + gn]);
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) dst[e] = (gk < K && gn + e < N) ? B[(size_t)gk * N + gn + e] : zero<T>();
      }
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a[2];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> b[4];
#pragma unroll
      for (int i = 0; i < 2; ++i) wmma::load_matrix_sync(a[i], &As[(warp_m * WM + i * 16) * LDA + kk], LDA);
#pragma unroll
      for (int j = 0; j < 4; ++j) wmma::load_matrix_sync(b[j], &Bs[kk * LDB + warp_n * WN + j * 16], LDB);
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) wmma::mma_sync(acc[i][j], a[i], b[j], acc[i][j]);
    }
    __syncthreads();
  }

  // epilogue: each fragment through this warp's staging tile, rounded once, stored inside C only
  float* st = stage[warp];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      wmma::store_matrix_sync(st, acc[i][j], 16, wmma::mem_row_major);
      __syncwarp();
      int r0 = bm + warp_m * WM + i * 16, c0 = bn + warp_n * WN + j * 16;
#pragma unroll
      for (int e = lane; e < 256; e += 32) {
        int r = r0 + e / 16, c = c0 + e % 16;
        if (r < M && c < N) C[(size_t)r * N + c] = from_float<T>(st[e]);
      }
      __syncwarp();
    }
}

torch::Tensor gemm(torch::Tensor a, torch::Tensor b) {
  TORCH_CHECK(a.is_cuda() && b.is_cuda(), "gemm: A and B must be CUDA tensors");
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(0), "gemm: A[M, K] @ B[K, N]");
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "gemm: A and B must have one dtype");
  a = a.contiguous();
  b = b.contiguous();
  const int M = a.size(0), K = a.size(1), N = b.size(1);
  auto c = torch::empty({M, N}, a.options());
  if (M == 0 || N == 0) return c;
  dim3 grid((N + BN - 1) / BN, (M + BM - 1) / BM);
  auto stream = at::cuda::getCurrentCUDAStream();
  bool vec_a = K % 8 == 0 && reinterpret_cast<uintptr_t>(a.data_ptr()) % 16 == 0;
  bool vec_b = N % 8 == 0 && reinterpret_cast<uintptr_t>(b.data_ptr()) % 16 == 0;
  if (a.scalar_type() == at::kHalf) {
    wmma_gemm<__half><<<grid, THREADS, 0, stream>>>(reinterpret_cast<const __half*>(a.data_ptr()),
        reinterpret_cast<const __half*>(b.data_ptr()), reinterpret_cast<__half*>(c.data_ptr()), M, N, K, vec_a, vec_b);
  } else if (a.scalar_type() == at::kBFloat16) {
    wmma_gemm<__nv_bfloat16><<<grid, THREADS, 0, stream>>>(reinterpret_cast<const __nv_bfloat16*>(a.data_ptr()),
        reinterpret_cast<const __nv_bfloat16*>(b.data_ptr()), reinterpret_cast<__nv_bfloat16*>(c.data_ptr()),
        M, N, K, vec_a, vec_b);
  } else {
    TORCH_CHECK(false, "gemm: fp16 or bf16 only");
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return c;
}
"""

CPP_SOURCE = "torch::Tensor gemm(torch::Tensor a, torch::Tensor b);"

_ext = load_inline(name="cudagym_wmma_gemm", cpp_sources=CPP_SOURCE, cuda_sources=CUDA_SOURCE,
                   functions=["gemm"], extra_cuda_cflags=["-O3"])


class ModelNew(nn.Module):
    def forward(self, A, B):
        return _ext.gemm(A, B)
