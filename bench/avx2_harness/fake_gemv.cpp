// Stand-in for tensorpar/decode/csrc/gemv.cpp on a CPU without AVX-512 (bench/avx2_harness, verification only):
// fp32 y = x W^T (+ bias), sums in 16 lanes then in order, built with -ffp-contract=off.
#include <stdint.h>
extern "C" int tp_gemv_abi(void) { return 1; }
extern "C" void tp_gemv(int dtype, int mode, const void* x, int64_t M, int64_t K, const void* w, int64_t N,
                        const void* bias, void* y, int threads, int64_t pf) {
    const float* X = (const float*)x;
    const float* W = (const float*)w;
    const float* B = (const float*)bias;
    float* Y = (float*)y;
    const int64_t K16 = K & ~(int64_t)15;
    for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) {
            const float* xr = X + m * K;
            const float* wr = W + n * K;
            float acc[16] = {0};
            for (int64_t k = 0; k < K16; k += 16)
                for (int u = 0; u < 16; ++u) acc[u] = acc[u] + xr[k + u] * wr[k + u];
            for (int64_t k = K16; k < K; ++k) acc[k - K16] = acc[k - K16] + xr[k] * wr[k];
            float s = 0.0f;
            for (int u = 0; u < 16; ++u) s = s + acc[u];
            Y[m * N + n] = B ? s + B[n] : s;
        }
}
extern "C" void tp_gemv_bf16w(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, const float* bias,
                              float* y, int threads, int64_t pf) {}
