// RMSNorm over the last dimension: out = x / sqrt(mean(x^2) + eps) * weight. The sum of squares
// uses 256 strided partial sums and a pairwise tree, as in the CUDA version.
#include <cmath>
#include <cstdint>

static constexpr int kLanes = 256;

extern "C" void rmsnorm_rows(const float* x, const float* weight, float* out, int64_t rows, int64_t cols, float eps) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const float* xr = x + r * cols;
        float* orow = out + r * cols;
        float part[kLanes] = {0.0f};
        for (int64_t c = 0; c < cols; ++c) part[c % kLanes] += xr[c] * xr[c];
        for (int s = kLanes / 2; s > 0; s >>= 1)
            for (int t = 0; t < s; ++t) part[t] += part[t + s];
        const float rms = std::sqrt(part[0] / static_cast<float>(cols) + eps);
        for (int64_t c = 0; c < cols; ++c) orow[c] = xr[c] / rms * weight[c];
    }
}
