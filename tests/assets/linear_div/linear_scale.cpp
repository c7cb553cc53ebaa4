// out[n, o] = (sum_i x[n, i] * w[o, i] + b[o]) * scale
#include <cstdint>

extern "C" void linear_scale(const float* x, const float* w, const float* b, float* out, int64_t rows,
                             int64_t in, int64_t outs, float scale) {
    for (int64_t n = 0; n < rows; ++n)
        for (int64_t o = 0; o < outs; ++o) {
            double s = b[o];
            for (int64_t i = 0; i < in; ++i) s += static_cast<double>(x[n * in + i]) * w[o * in + i];
            out[n * outs + o] = static_cast<float>(s * scale);
        }
}
