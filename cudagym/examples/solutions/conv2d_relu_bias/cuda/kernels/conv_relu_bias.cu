// out[n, o, y, x] = relu(cb[o] + sum_{c, ky, kx} in[n, c, y + ky, x + kx] * w[o, c, ky, kx]) + bias[o]
// (stride 1, no padding, NCHW): a direct convolution, one thread per output element.
#include <cstdint>
#include <cuda_runtime.h>

__global__ void conv2d_relu_bias_kernel(const float* __restrict__ in, const float* __restrict__ w,
                                        const float* __restrict__ conv_bias, const float* __restrict__ bias,
                                        float* __restrict__ out, int64_t batch, int64_t in_ch, int64_t out_ch,
                                        int64_t height, int64_t width, int64_t ksize) {
    const int64_t oh = height - ksize + 1, ow = width - ksize + 1;
    const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= batch * out_ch * oh * ow) return;
    const int64_t x = i % ow, y = (i / ow) % oh, o = (i / (ow * oh)) % out_ch, n = i / (ow * oh * out_ch);
    float acc = conv_bias[o];
    for (int64_t c = 0; c < in_ch; ++c) {
        const float* src = in + ((n * in_ch + c) * height + y) * width + x;
        const float* wk = w + (o * in_ch + c) * ksize * ksize;
        for (int64_t ky = 0; ky < ksize; ++ky)
            for (int64_t kx = 0; kx < ksize; ++kx) acc += wk[ky * ksize + kx] * src[ky * width + kx];
    }
    out[i] = (acc > 0.0f ? acc : 0.0f) + bias[o];
}

extern "C" int conv2d_relu_bias(const float* in, const float* w, const float* conv_bias, const float* bias, float* out,
                                int64_t batch, int64_t in_ch, int64_t out_ch, int64_t height, int64_t width,
                                int64_t ksize, cudaStream_t stream) {
    const int64_t total = batch * out_ch * (height - ksize + 1) * (width - ksize + 1);
    const int threads = 256;
    const unsigned blocks = static_cast<unsigned>((total + threads - 1) / threads);
    conv2d_relu_bias_kernel<<<blocks, threads, 0, stream>>>(in, w, conv_bias, bias, out, batch, in_ch, out_ch, height,
                                                            width, ksize);
    return static_cast<int>(cudaGetLastError());
}
