// One input row of the GEMV (tensorpar/decode/csrc/gemv.cpp, included as it is): the weight rows read one after
// the other (f32_rows<1>, bf16_rows<1, 0>: one stream) against 8 at a time (f32_stripes, bf16_stripes<0>: 8
// streams), GB/s of weights, one thread, interleaved, each shape's weights cycled through >= 300 MB so they come
// from memory; median and best of REPS. Why the kernel takes 8 streams only for rows of >= STRIPE_ROW_BYTES.
//
//     g++ -O3 -mavx512f -mavx512bw -mavx512vl -mavx512bf16 -std=c++17 -fopenmp -o gemv_streams_probe \
//         bench/gemv_streams_probe.cpp && ./gemv_streams_probe [REPS]
// (AVX2 machines: -mavx2 -mfma instead of the -mavx512 flags)
#include "../tensorpar/decode/csrc/gemv.cpp"
#include <stdio.h>
#include <time.h>
#include <algorithm>
#include <vector>

static double now() { timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

static void probe(int64_t N, int64_t K, int bf, int reps) {
    const int64_t esz = bf ? 2 : 4, per = N * K * esz;
    const int copies = (int)std::max<int64_t>(1, (300LL << 20) / per);
    std::vector<char*> ws(copies);
    for (auto& p : ws) { p = (char*)aligned_alloc(64, (size_t)(per + 63) / 64 * 64); memset(p, 0x3c, per); }
    float* x = (float*)aligned_alloc(64, (size_t)(K * 4 + 63) / 64 * 64);
    for (int64_t i = 0; i < K; ++i) x[i] = 0.5f;
    float* out = (float*)aligned_alloc(64, (size_t)(N * 4 + 63) / 64 * 64);
    std::vector<double> t[2];
    for (int r = 0; r < reps; ++r)
        for (int v = 0; v < 2; ++v) {
            const double t0 = now();
            for (int c = 0; c < copies; ++c) {
                if (!bf) {
                    const float* w = (const float*)ws[c];
                    if (v == 0) f32_rows<1>(x, K, w, 0, N, out, 0, 0); else f32_stripes(x, K, w, 0, N, out);
                } else {
                    const uint16_t* w = (const uint16_t*)ws[c];
                    const uint16_t* xb = (const uint16_t*)x;
                    if (v == 0) bf16_rows<1, 0>(xb, nullptr, K, w, 0, N, out, 0, 0);
                    else bf16_stripes<0>(xb, nullptr, K, w, 0, N, out);
                }
            }
            t[v].push_back((double)per * copies / (now() - t0) / 1e9);
        }
    for (auto& v : t) std::sort(v.begin(), v.end());
    printf("| %s | %ld x %ld | %ld | %.1f (%.1f) | %.1f (%.1f) | %.2fx |\n", bf ? "bf16" : "fp32", (long)N, (long)K,
           (long)(K * esz), t[0][reps / 2], t[0].back(), t[1][reps / 2], t[1].back(), t[1][reps / 2] / t[0][reps / 2]);
    for (auto p : ws) free(p);
    free(x);
    free(out);
}

int main(int argc, char** argv) {
    const int reps = argc > 1 ? atoi(argv[1]) : 11;
    printf("| dtype | out x in | row bytes | one row at a time, GB/s median (best) | 8 rows at a time | ratio |\n");
    printf("|---|---|---|---|---|---|\n");
    const int64_t shapes[][3] = {{1280, 2048, 0}, {2048, 1024, 0}, {5632, 2048, 0}, {2048, 2816, 0}, {16000, 2048, 0},
                                 {1536, 576, 0}, {576, 768, 0}, {480, 576, 0}, {576, 288, 0},
                                 {5632, 2048, 1}, {2048, 2816, 1}, {2048, 1024, 1}, {1536, 576, 1}, {576, 288, 1}};
    for (auto& s : shapes) probe(s[0], s[1], (int)s[2], reps);
    return 0;
}
