// c[b] = a[b] @ bm[b] for row-major a: [B, M, K], bm: [B, K, N], c: [B, M, N].
// i-k-j loop order: the inner loop streams a row of bm and a row of c (contiguous, vectorizable),
// and every output accumulates its K products in order k = 0..K-1.
#include <cstdint>

extern "C" void bmm(const float* a, const float* bm, float* c, int64_t batch, int64_t m_size, int64_t n_size,
                    int64_t k_size) {
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t b = 0; b < batch; ++b) {
        for (int64_t i = 0; i < m_size; ++i) {
            const float* arow = a + (b * m_size + i) * k_size;
            float* crow = c + (b * m_size + i) * n_size;
            for (int64_t j = 0; j < n_size; ++j) crow[j] = 0.0f;
            for (int64_t k = 0; k < k_size; ++k) {
                const float av = arow[k];
                const float* brow = bm + (b * k_size + k) * n_size;
                for (int64_t j = 0; j < n_size; ++j) crow[j] += av * brow[j];
            }
        }
    }
}
