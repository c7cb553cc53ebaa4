// out[r, c] = exp(x[r, c] - max_r) / sum_c exp(x[r, c] - max_r)
// Per row: a max pass, a sum-of-exponentials pass, a write pass. Both reductions use 256 strided
// partial results combined by a pairwise tree, as one CUDA block of 256 threads does.
#include <cmath>
#include <cstdint>

static constexpr int kLanes = 256;

static float tree_max(float* part) {
    for (int s = kLanes / 2; s > 0; s >>= 1)
        for (int t = 0; t < s; ++t) part[t] = part[t] > part[t + s] ? part[t] : part[t + s];
    return part[0];
}

static float tree_sum(float* part) {
    for (int s = kLanes / 2; s > 0; s >>= 1)
        for (int t = 0; t < s; ++t) part[t] += part[t + s];
    return part[0];
}

extern "C" void softmax_rows(const float* x, float* out, int64_t rows, int64_t cols) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const float* xr = x + r * cols;
        float* orow = out + r * cols;
        float part[kLanes];
        for (int t = 0; t < kLanes; ++t) part[t] = -INFINITY;
        for (int64_t c = 0; c < cols; ++c) part[c % kLanes] = xr[c] > part[c % kLanes] ? xr[c] : part[c % kLanes];
        const float m = tree_max(part);
        for (int t = 0; t < kLanes; ++t) part[t] = 0.0f;
        for (int64_t c = 0; c < cols; ++c) part[c % kLanes] += std::exp(xr[c] - m);
        const float s = tree_sum(part);
        const float inv = 1.0f / s;
        for (int64_t c = 0; c < cols; ++c) orow[c] = std::exp(xr[c] - m) * inv;
    }
}
