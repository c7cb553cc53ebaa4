// out[r] = sum_c x[r, c]. Each row is summed like the CUDA version does it: 256 strided partial
// sums (one per thread of a block) combined by a pairwise tree, which keeps fp32 error small.
#include <cstdint>

static constexpr int kLanes = 256;

extern "C" void row_sum(const float* x, float* out, int64_t rows, int64_t cols) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const float* xr = x + r * cols;
        float part[kLanes] = {0.0f};
        int64_t c = 0;
        for (; c + kLanes <= cols; c += kLanes)
            for (int t = 0; t < kLanes; ++t) part[t] += xr[c + t];
        for (int t = 0; c + t < cols; ++t) part[t] += xr[c + t];
        for (int s = kLanes / 2; s > 0; s >>= 1)
            for (int t = 0; t < s; ++t) part[t] += part[t + s];
        out[r] = part[0];
    }
}
