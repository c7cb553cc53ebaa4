// out[m, n] = gelu(sum_k x[m, k] * w[n, k] + b1[n] + b2[n]) with w in nn.Linear's [out, in] layout.
// Each dot product keeps 16 independent partial sums (vectorizable without reassociating a
// single accumulator), then adds them up.
#include <cmath>
#include <cstdint>

static constexpr int kLanes = 16;

extern "C" void linear_bias_gelu(const float* x, const float* w, const float* b1, const float* b2, float* out,
                                 int64_t m_size, int64_t n_size, int64_t k_size) {
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t m = 0; m < m_size; ++m) {
        for (int64_t n = 0; n < n_size; ++n) {
            const float* a = x + m * k_size;
            const float* b = w + n * k_size;
            float part[kLanes] = {0.0f};
            int64_t k = 0;
            for (; k + kLanes <= k_size; k += kLanes)
                for (int l = 0; l < kLanes; ++l) part[l] += a[k + l] * b[k + l];
            for (int l = 0; k + l < k_size; ++l) part[l] += a[k + l] * b[k + l];
            float acc = 0.0f;
            for (int l = 0; l < kLanes; ++l) acc += part[l];
            const float v = (acc + b1[n]) + b2[n];
            out[m * n_size + n] = 0.5f * v * (1.0f + std::erf(v * 0.70710678118654752f));
        }
    }
}
