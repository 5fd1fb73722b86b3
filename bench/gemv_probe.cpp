// Probe of the GEMV kernel's one-row inner loops (tensorpar/decode/csrc/gemv.cpp, included as it is): GB/s of
// weights, one thread, each shape's weights cycled through >= MB megabytes so they come from memory, from wall time
// and from the thread's CPU time (less disturbed by other processes on a shared machine), median and best of REPS.
// Rows: bf16 vdpbf16ps (mode 0), bf16 widened with an fp32 input (mode 1), fp32, and "x<N>": mode 1's loop reading
// its input from only the first N inputs (a wrong sum; timing only): whether the fp32 input's footprint in L1
// (4 bytes per input, read twice per weight byte) is what limits mode 1 at large K (docs/decode.md).
//
//     g++ -O3 -mavx512f -mavx512bw -mavx512vl -mavx512bf16 -std=c++17 -o gemv_probe bench/gemv_probe.cpp
//     ./gemv_probe [REPS [MB [NAME_FILTER]]]
#include "../tensorpar/decode/csrc/gemv.cpp"
#include <stdio.h>
#include <time.h>
#include <algorithm>
#include <vector>

static double now(clockid_t c) { timespec t; clock_gettime(c, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

// mode 1's inner loop (even / odd weights against the reordered input) with the input read from [0, XM) only
template <int XM>
static void x_footprint(const uint16_t*, const float* xf, int64_t K, const uint16_t* w, int64_t N, float* out) {
    const int64_t K128 = K & ~(int64_t)127, K32 = K & ~(int64_t)31;
    float* xs = split_even_odd(xf, 1, K, K32);
    const __m512i odd = _mm512_set1_epi32((int)0xffff0000u);
    for (int64_t n = 0; n < N; ++n) {
        const uint16_t* wr = w + n * K;
        __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int64_t k = 0; k < K128; k += 128) {
            const float* xk = xs + (k & (XM - 1));
            for (int u = 0; u < 4; ++u) {
                __m512i wv = _mm512_loadu_si512(wr + k + 32 * u);
                a[u] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(wv, 16)), _mm512_load_ps(xk + 32 * u),
                                       a[u]);
                a[u] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(wv, odd)),
                                       _mm512_load_ps(xk + 32 * u + 16), a[u]);
            }
        }
        out[n] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])));
    }
    free(xs);
}
static void dp(const uint16_t* x, const float* xf, int64_t K, const uint16_t* w, int64_t N, float* out) {
    bf16_rows<1, 0>(x, xf, K, w, 0, N, out, N, 0);
}
static void widen(const uint16_t* x, const float* xf, int64_t K, const uint16_t* w, int64_t N, float* out) {
    bf16_rows<1, 1>(x, xf, K, w, 0, N, out, N, 0);
}

int main(int argc, char** argv) {
    const int reps = argc > 1 ? atoi(argv[1]) : 9;
    const int64_t mb = argc > 2 ? atoi(argv[2]) : 160;
    const char* only = argc > 3 ? argv[3] : "";
    struct S { const char* name; int64_t N, K; } shapes[] = {
        {"llama qkv", 2560, 2048}, {"llama o_proj", 2048, 2048}, {"llama gate_up", 11264, 2048},
        {"llama down", 2048, 5632}, {"llama lm_head", 32000, 2048}, {"smollm2 qkv", 960, 576},
        {"smollm2 o_proj", 576, 576}, {"smollm2 gate_up", 3072, 576}, {"smollm2 down", 576, 1536},
        {"smollm2 lm_head", 49152, 576}, {"k 3072", 2048, 3072}, {"k 4096", 2048, 4096}, {"k 8192", 2048, 8192}};
    typedef void (*fn)(const uint16_t*, const float*, int64_t, const uint16_t*, int64_t, float*);
    struct V { const char* name; fn f; } vs[] = {
        {"bf16 vdpbf16ps", dp}, {"bf16 widen", widen}, {"x2048 (probe)", x_footprint<2048>},
        {"x4096 (probe)", x_footprint<4096>}, {"x8192 (probe)", x_footprint<8192>}};
    const int nv = sizeof(vs) / sizeof(vs[0]);
    uint64_t seed = 88172645463325252ull;
    auto rnd = [&]() {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        return ((int)(seed % 2001) - 1000) * 1e-3f;
    };
    for (const S& s : shapes) {
        if (*only && !strstr(s.name, only)) continue;
        const int64_t per = s.N * s.K, cb = (mb << 20) / (per * 2) + 1, cf = (mb << 20) / (per * 4) + 1;
        uint16_t* wb = (uint16_t*)aligned_alloc(64, (per * 2 * cb + 63) / 64 * 64);
        float* wf = (float*)aligned_alloc(64, (per * 4 * cf + 63) / 64 * 64);
        for (int64_t i = 0; i < per * cb; ++i) wb[i] = f32_to_bf16(rnd());
        for (int64_t i = 0; i < per * cf; ++i) wf[i] = rnd();
        std::vector<uint16_t> xb(s.K);
        std::vector<float> xf(s.K), out(s.N);
        for (int64_t i = 0; i < s.K; ++i) xf[i] = bf16_to_f32(xb[i] = f32_to_bf16(rnd()));
        std::vector<std::vector<double>> wall(nv + 1), cpu(nv + 1);
        for (int r = 0; r < reps; ++r)
            for (int v = 0; v <= nv; ++v) {
                if (v < nv && strstr(vs[v].name, "probe") && (s.K & 127)) continue;
                const double t0 = now(CLOCK_MONOTONIC), c0 = now(CLOCK_THREAD_CPUTIME_ID);
                if (v == nv)
                    for (int64_t c = 0; c < cf; ++c)
                        f32_rows<1>(xf.data(), s.K, wf + c * per, 0, s.N, out.data(), s.N, 0);
                else
                    for (int64_t c = 0; c < cb; ++c) vs[v].f(xb.data(), xf.data(), s.K, wb + c * per, s.N, out.data());
                wall[v].push_back(now(CLOCK_MONOTONIC) - t0);
                cpu[v].push_back(now(CLOCK_THREAD_CPUTIME_ID) - c0);
            }
        double la[3];
        getloadavg(la, 3);
        printf("%s %ld x %ld, load %.2f: GB/s wall median (best) | cpu median (best)\n", s.name, (long)s.N,
               (long)s.K, la[0]);
        for (int v = 0; v <= nv; ++v) {
            if (wall[v].empty()) continue;
            const double bytes = v == nv ? per * 4.0 * cf : per * 2.0 * cb;
            std::sort(wall[v].begin(), wall[v].end());
            std::sort(cpu[v].begin(), cpu[v].end());
            printf("  %-15s %6.1f (%5.1f) | %6.1f (%5.1f)\n", v == nv ? "fp32" : vs[v].name,
                   bytes / wall[v][reps / 2] / 1e9, bytes / wall[v][0] / 1e9, bytes / cpu[v][reps / 2] / 1e9,
                   bytes / cpu[v][0] / 1e9);
        }
        fflush(stdout);
        free(wb);
        free(wf);
    }
}
