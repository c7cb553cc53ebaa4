// out[r] = max_c x[r, c] over the last dimension (rows = all leading dimensions flattened).
#include <cstdint>

extern "C" void max_lastdim(const float* x, float* out, int64_t rows, int64_t cols) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const float* xr = x + r * cols;
        float m = xr[0];
        for (int64_t c = 1; c < cols; ++c) m = xr[c] > m ? xr[c] : m;
        out[r] = m;
    }
}
