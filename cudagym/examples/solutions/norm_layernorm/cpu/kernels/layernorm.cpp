// LayerNorm over the last dimension: out = (x - mean) / sqrt(var + eps) * weight + bias, with the
// biased variance computed in a second pass around the mean. Reductions: 256 strided partial
// sums combined by a pairwise tree, as in the CUDA version.
#include <cmath>
#include <cstdint>

static constexpr int kLanes = 256;

static float lane_tree_sum(float* part) {
    for (int s = kLanes / 2; s > 0; s >>= 1)
        for (int t = 0; t < s; ++t) part[t] += part[t + s];
    return part[0];
}

extern "C" void layernorm_rows(const float* x, const float* weight, const float* bias, float* out, int64_t rows,
                               int64_t cols, float eps) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const float* xr = x + r * cols;
        float* orow = out + r * cols;
        float part[kLanes] = {0.0f};
        for (int64_t c = 0; c < cols; ++c) part[c % kLanes] += xr[c];
        const float mean = lane_tree_sum(part) / static_cast<float>(cols);
        for (int t = 0; t < kLanes; ++t) part[t] = 0.0f;
        for (int64_t c = 0; c < cols; ++c) {
            const float d = xr[c] - mean;
            part[c % kLanes] += d * d;
        }
        const float var = lane_tree_sum(part) / static_cast<float>(cols);
        const float inv_std = 1.0f / std::sqrt(var + eps);
        for (int64_t c = 0; c < cols; ++c) orow[c] = (xr[c] - mean) * inv_std * weight[c] + bias[c];
    }
}
