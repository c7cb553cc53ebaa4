// out[r, c] = gelu(x[r, c] * scale + bias[c]), exact (erf) GELU.
#include <cmath>
#include <cstdint>

extern "C" void scale_bias_gelu(const float* x, const float* bias, float* out, int64_t rows, int64_t cols,
                                float scale) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const float* xr = x + r * cols;
        float* orow = out + r * cols;
        for (int64_t c = 0; c < cols; ++c) {
            float v = xr[c] * scale + bias[c];
            orow[c] = 0.5f * v * (1.0f + std::erf(v * 0.70710678118654752f));
        }
    }
}
