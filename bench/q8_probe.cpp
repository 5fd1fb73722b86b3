// One Q8_0 x Q8_0 matmul at decode shapes, one thread: our kernel (tensorpar/decode/csrc/q8_linear.cpp, included as
// it is, built for the target of the flags given) against llama.cpp's (ggml's GGML_OP_MUL_MAT of a Q8_0 weight and
// an fp32 input, the op llama.cpp's decode runs, with a persistent 1-thread threadpool, as llama.cpp), on the same
// int8 weights and fp16 block scales. Each shape's weights are cycled through >= MB megabytes so each call reads
// them from memory; per call: wall and thread-CPU time, best and median of REPS sweeps; GB/s of the weight bytes
// (34 per 32 weights in both layouts). Also the largest difference of the two outputs relative to the largest
// output (llama.cpp rounds the activation scales to fp16, we keep them in fp32). One JSON object per line.
// bench/bench_q8_kernel.py builds and runs it:
//
//     g++ -O3 <-mavx2 -mfma -mf16c | -mavx512f -mavx512bw -mavx512vl -mavx512vnni -mf16c> -ffp-contract=off
//         -fopenmp -std=c++17 bench/q8_probe.cpp -o q8_probe [-DWITH_GGML -I$GGML/include -L$GGML/lib
//         -lggml-cpu -lggml-base -Wl,-rpath,$GGML/lib]
//     ./q8_probe REPS MB M K N [M K N ...]
// (-DTILE_R=r -DTILE_M=m: the AVX2 target with tiles of r weight rows x m activation rows, to compare tilings)
#include "../tensorpar/decode/csrc/q8_linear.cpp"
#include <stdio.h>
#include <time.h>
#include <algorithm>
#include <functional>
#include <random>
#include <vector>
#ifdef WITH_GGML
#include "ggml.h"
#include "ggml-cpu.h"
#endif

static double now(clockid_t c) { timespec t; clock_gettime(c, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

struct Timing { double wall_best, wall_med, cpu_best, cpu_med; };

// per-call seconds of each of fns' calls fn(i), i in [0, n), REPS sweeps, the candidates' sweeps interleaved (so
// load that comes and goes on a shared machine hits each alike)
template <class F>
static std::vector<Timing> sweep(int reps, int n, const std::vector<F>& fns) {
    const size_t c = fns.size();
    std::vector<std::vector<double>> w(c), u(c);
    for (auto& fn : fns) fn(0);             // warm-up (page faults, threadpool)
    for (int r = 0; r < reps; ++r)
        for (size_t k = 0; k < c; ++k) {
            double w0 = now(CLOCK_MONOTONIC), c0 = now(CLOCK_THREAD_CPUTIME_ID);
            for (int i = 0; i < n; ++i) fns[k](i);
            w[k].push_back((now(CLOCK_MONOTONIC) - w0) / n);
            u[k].push_back((now(CLOCK_THREAD_CPUTIME_ID) - c0) / n);
        }
    std::vector<Timing> out;
    for (size_t k = 0; k < c; ++k) {
        std::sort(w[k].begin(), w[k].end());
        std::sort(u[k].begin(), u[k].end());
        out.push_back({w[k][0], w[k][w[k].size() / 2], u[k][0], u[k][u[k].size() / 2]});
    }
    return out;
}

static void print_timing(const char* who, int64_t M, int64_t K, int64_t N, int n, const Timing& t, double rel) {
    const double bytes = (double)N * K * 34 / 32;
    printf("{\"kernel\": \"%s\", \"M\": %ld, \"K\": %ld, \"N\": %ld, \"copies\": %d, \"us_wall_best\": %.2f, "
           "\"us_wall_median\": %.2f, \"us_cpu_best\": %.2f, \"us_cpu_median\": %.2f, \"gbs_wall_best\": %.2f, "
           "\"gbs_cpu_best\": %.2f, \"max_rel_diff\": %.3g}\n",
           who, (long)M, (long)K, (long)N, n, t.wall_best * 1e6, t.wall_med * 1e6, t.cpu_best * 1e6,
           t.cpu_med * 1e6, bytes / t.wall_best * 1e-9, bytes / t.cpu_best * 1e-9, rel);
    fflush(stdout);
}

int main(int argc, char** argv) {
    if (argc < 6 || (argc - 3) % 3) {
        fprintf(stderr, "usage: %s REPS MB M K N [M K N ...]\n", argv[0]);
        return 2;
    }
    const int reps = atoi(argv[1]);
    const double mb = atof(argv[2]);
    std::mt19937 rng(0);
    std::uniform_int_distribution<int> qd(-127, 127);
    std::normal_distribution<float> nd(0.0f, 1.0f);
#ifdef WITH_GGML
    ggml_cpu_init();
    ggml_threadpool_params tpp = ggml_threadpool_params_default(1);
    ggml_threadpool* pool = ggml_threadpool_new(&tpp);
#endif
    for (int a = 3; a + 2 < argc; a += 3) {
        const int64_t M = atoll(argv[a]), K = atoll(argv[a + 1]), N = atoll(argv[a + 2]), nb = K / QK;
        const double bytes = (double)N * K * 34 / 32;
        const int n = std::max(2, (int)(mb * 1e6 / bytes));
        std::vector<std::vector<int8_t>> q(n, std::vector<int8_t>(N * K));
        std::vector<std::vector<uint16_t>> s(n, std::vector<uint16_t>(N * nb));
        for (int i = 0; i < n; ++i) {
            for (auto& v : q[i]) v = (int8_t)qd(rng);
            for (auto& v : s[i]) v = _cvtss_sh(0.02f * (0.5f + (float)(rng() % 1000) / 1000.0f) / 127.0f, 0);
        }
        std::vector<float> x(M * K), y(M * N);
        for (auto& v : x) v = nd(rng);
        std::vector<uint8_t> scratch(tp_q8_scratch_bytes(M, K) + 64);
        void* sp = (void*)(((uintptr_t)scratch.data() + 63) / 64 * 64);
        std::vector<std::function<void(int)>> fns = {[&](int i) {
            tp_q8_linear_into(x.data(), M, K, q[i].data(), s[i].data(), N, nullptr, y.data(), 1, sp);
        }};
        tp_q8_linear_into(x.data(), M, K, q[0].data(), s[0].data(), N, nullptr, y.data(), 1, sp);
        std::vector<float> y0 = y;
#ifdef WITH_GGML
        const size_t per = ggml_tensor_overhead() * 4 + ggml_graph_overhead_custom(8, false);
        ggml_init_params ip = {(size_t)(n * (bytes + per + 4096) + M * K * 4 + M * N * 4 * n + (1 << 20)), nullptr,
                               false};
        ggml_context* ctx = ggml_init(ip);
        ggml_tensor* X = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, K, M);
        memcpy(ggml_get_data(X), x.data(), M * K * 4);
        std::vector<ggml_cgraph*> graphs(n);
        std::vector<ggml_tensor*> outs(n);
        size_t work = 0;
        for (int i = 0; i < n; ++i) {
            ggml_tensor* W = ggml_new_tensor_2d(ctx, GGML_TYPE_Q8_0, K, N);
            uint8_t* wd = (uint8_t*)ggml_get_data(W);           // block_q8_0: fp16 d, then 32 int8
            for (int64_t r = 0; r < N; ++r)
                for (int64_t b = 0; b < nb; ++b) {
                    uint8_t* blk = wd + (r * nb + b) * 34;
                    memcpy(blk, &s[i][r * nb + b], 2);
                    memcpy(blk + 2, &q[i][r * K + b * QK], QK);
                }
            outs[i] = ggml_mul_mat(ctx, W, X);
            graphs[i] = ggml_new_graph_custom(ctx, 8, false);
            ggml_build_forward_expand(graphs[i], outs[i]);
            work = std::max(work, ggml_graph_plan(graphs[i], 1, pool).work_size);
        }
        std::vector<uint8_t> wbuf(work + 64);
        fns.push_back([&](int i) {
            ggml_cplan plan = ggml_graph_plan(graphs[i], 1, pool);
            plan.work_data = wbuf.data();
            ggml_graph_compute(graphs[i], &plan);
        });
        std::vector<Timing> t = sweep(reps, n, fns);
        print_timing(tp_q8_target(), M, K, N, n, t[0], 0.0);
        const float* gy = (const float*)ggml_get_data(outs[0]);
        double dmax = 0, ymax = 0;
        for (int64_t j = 0; j < M * N; ++j) {
            dmax = std::max(dmax, (double)fabsf(gy[j] - y0[j]));
            ymax = std::max(ymax, (double)fabsf(y0[j]));
        }
        print_timing("llama.cpp Q8_0 (ggml mul_mat)", M, K, N, n, t[1], dmax / ymax);
        ggml_free(ctx);
#else
        print_timing(tp_q8_target(), M, K, N, n, sweep(reps, n, fns)[0], 0.0);
#endif
    }
#ifdef WITH_GGML
    ggml_threadpool_free(pool);
#endif
    return 0;
}
