// out[r] = sum over c of x[r, c]
#include <cstdint>

extern "C" void row_sum(const float* x, float* out, int64_t rows, int64_t cols) {
    for (int64_t r = 0; r < rows; ++r) {
        double s = 0.0;
        const float* xr = x + r * cols;
        for (int64_t c = 0; c < cols; ++c) s += xr[c];
        out[r] = static_cast<float>(s);
    }
}
