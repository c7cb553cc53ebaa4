// out[i] = min(max(x[i] + residual[i], 0), clamp_max)
#include <cstdint>

extern "C" void residual_relu_clamp(const float* x, const float* residual, float* out, int64_t n, float clamp_max) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
        float v = x[i] + residual[i];
        v = v > 0.0f ? v : 0.0f;
        out[i] = v < clamp_max ? v : clamp_max;
    }
}
