// out[b, c] = mean_r x[b, r, c]: the reduced dimension is the middle one, so each output
// accumulates down a column; the inner loop runs along c (contiguous), like the CUDA threads.
#include <cstdint>

extern "C" void mean_dim1(const float* x, float* out, int64_t batch, int64_t reduce, int64_t cols) {
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < batch; ++b) {
        float* ob = out + b * cols;
        for (int64_t c = 0; c < cols; ++c) ob[c] = 0.0f;
        for (int64_t r = 0; r < reduce; ++r) {
            const float* xr = x + (b * reduce + r) * cols;
            for (int64_t c = 0; c < cols; ++c) ob[c] += xr[c];
        }
        const float inv = 1.0f / static_cast<float>(reduce);
        for (int64_t c = 0; c < cols; ++c) ob[c] *= inv;
    }
}
