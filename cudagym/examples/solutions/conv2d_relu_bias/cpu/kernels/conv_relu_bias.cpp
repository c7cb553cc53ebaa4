// out[n, o, y, x] = relu(cb[o] + sum_{c, ky, kx} in[n, c, y + ky, x + kx] * w[o, c, ky, kx]) + bias[o]
// (stride 1, no padding, NCHW). Per (n, o) output plane: start from the conv bias, then add one
// shifted input plane per weight tap (the inner loop runs along x, contiguous), then ReLU + bias.
#include <cstdint>

extern "C" void conv2d_relu_bias(const float* in, const float* w, const float* conv_bias, const float* bias,
                                 float* out, int64_t batch, int64_t in_ch, int64_t out_ch, int64_t height,
                                 int64_t width, int64_t ksize) {
    const int64_t oh = height - ksize + 1, ow = width - ksize + 1;
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t n = 0; n < batch; ++n) {
        for (int64_t o = 0; o < out_ch; ++o) {
            float* plane = out + (n * out_ch + o) * oh * ow;
            for (int64_t i = 0; i < oh * ow; ++i) plane[i] = conv_bias[o];
            for (int64_t c = 0; c < in_ch; ++c) {
                const float* src = in + (n * in_ch + c) * height * width;
                for (int64_t ky = 0; ky < ksize; ++ky) {
                    for (int64_t kx = 0; kx < ksize; ++kx) {
                        const float wv = w[((o * in_ch + c) * ksize + ky) * ksize + kx];
                        for (int64_t y = 0; y < oh; ++y) {
                            const float* srow = src + (y + ky) * width + kx;
                            float* orow = plane + y * ow;
                            for (int64_t x = 0; x < ow; ++x) orow[x] += wv * srow[x];
                        }
                    }
                }
            }
            const float bo = bias[o];
            for (int64_t i = 0; i < oh * ow; ++i) plane[i] = (plane[i] > 0.0f ? plane[i] : 0.0f) + bo;
        }
    }
}
