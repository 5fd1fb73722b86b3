// fp32 / bf16 GEMV (and small GEMM) on the plain row-major weight [N, K], for the lean decode path's matmuls at a
// few rows (tensorpar.decode.gemv_kernel): y[m, n] = bias[n] + sum_k x[m, k] * w[n, k], summed in fp32.
// Layout: the weight as it is ([out, in], what F.linear takes): read one output row after the other, the whole
// matrix is one sequential stream of cache lines that the hardware prefetcher follows; per row U independent
// accumulators per input row (4 x 64 bytes of weights in flight with AVX-512), reduced once per output.
// bf16: weights and activations bf16, products summed in fp32 (`mode`): AVX512_BF16's vdpbf16ps (pairs of bf16
// products into one fp32 lane) or, without it (AVX2), both widened to fp32 in registers (a shift / an and: even
// and odd halves, below) and fma (each bf16 x bf16 product is exact in fp32); or the weights widened and fma with
// x in fp32; the output rounded to bf16 (round to nearest even) after the bias. More than 4 rows: the weight rows
// in chunks that stay in L2 while every group of 4 input rows reads them (one pass over memory).
//
// Two targets from this one source (tensorpar/decode/gemv_kernel.py picks the one /proc/cpuinfo allows): AVX-512
// (-mavx512f -mavx512bw -mavx512vl -mavx512bf16: 16 fp32 lanes, 32 vector registers) and AVX2 + FMA (-mavx2
// -mfma: 8 lanes, 16 registers). The kernels below are written once over the vector primitives of the next
// section (W lanes per vector); only the primitives name the instruction set. Plain C ABI (ctypes): no torch
// headers. Built with -fopenmp.
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern "C" int tp_gemv_abi(void) { return 4; }

// ----------------------------------------------------------------------------------------- vector primitives
// vf: W fp32 lanes; vi: the same register as 2W bf16 (weight 2j in the low, 2j + 1 in the high half of lane j).
// vload_n: the first n < W floats, the rest zero (never reads past p + n). vsum: the lanes added (a tree).
// veven / vodd: lane j's low / high bf16 as fp32. vdot_bf16: acc + x[2j] w[2j] + x[2j+1] w[2j+1] per lane.
#if defined(__AVX512F__)
#define TP_GEMV_TARGET 512
constexpr int W = 16;
constexpr int NREGS = 32;
typedef __m512 vf;
typedef __m512i vi;
static inline vf vzero() { return _mm512_setzero_ps(); }
static inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
static inline vf vbroadcast(const float* p) { return _mm512_set1_ps(*p); }
static inline void vstore(float* p, vf a) { _mm512_storeu_ps(p, a); }
static inline vf vload_n(const float* p, int64_t n) { return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline float vsum(vf a) { return _mm512_reduce_add_ps(a); }
static inline vi vload_bf16(const uint16_t* p) { return _mm512_loadu_si512(p); }
static inline vi vbroadcast32(const uint32_t* p) { return _mm512_set1_epi32((int)*p); }
static inline vf veven(vi v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
static inline vf vodd(vi v) { return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u))); }
#if defined(__AVX512BF16__)
static inline vf vdot_bf16(vf acc, vi x, vi w) { return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)w); }
#define TP_HAVE_DPBF16 1
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#define TP_GEMV_TARGET 256
constexpr int W = 8;
constexpr int NREGS = 16;
typedef __m256 vf;
typedef __m256i vi;
static inline vf vzero() { return _mm256_setzero_ps(); }
static inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
static inline vf vbroadcast(const float* p) { return _mm256_broadcast_ss(p); }
static inline void vstore(float* p, vf a) { _mm256_storeu_ps(p, a); }
static inline vf vload_n(const float* p, int64_t n) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), lane));
}
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline float vsum(vf a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline vi vload_bf16(const uint16_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
static inline vi vbroadcast32(const uint32_t* p) { return _mm256_set1_epi32((int)*p); }
static inline vf veven(vi v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
static inline vf vodd(vi v) { return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u))); }
#else
#error "csrc/gemv.cpp needs AVX-512 (F, BW, VL, BF16) or AVX2 and FMA"
#endif
#ifndef TP_HAVE_DPBF16      // no vdpbf16ps: both widened, two fma (the products exact in fp32, the sums rounded)
static inline vf vdot_bf16(vf acc, vi x, vi w) { return vfma(vodd(w), vodd(x), vfma(veven(w), veven(x), acc)); }
#endif

extern "C" int tp_gemv_target(void) { return TP_GEMV_TARGET; }     // the vector width in bits it was built for

// the vectors per input row in flight: 4 (4 x 64 bytes with AVX-512); with 16 registers (AVX2) 2 from 3 rows on,
// so that R x U accumulators and the weights fit
constexpr int unroll(int R) { return NREGS >= 32 || R <= 2 ? 4 : 2; }

// the U accumulators added pairwise, then the lanes
template <int U>
static inline float vsum_u(const vf* a) {
    if (U == 1) return vsum(a[0]);
    if (U == 2) return vsum(vadd(a[0], a[1]));
    return vsum(vadd(vadd(a[0], a[1]), vadd(a[2], a[3])));
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {        // round to nearest even; NaN stays NaN
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

// ---------------------------------------------------------------------------------------------- fp32 weights
// rows [n0, n1) of R (<= 4) input rows x (fp32, row stride K) -> acc sums out[r][n]
template <int R>
static void f32_rows(const float* x, int64_t K, const float* w, int64_t n0, int64_t n1, float* out, int64_t ldo,
                     int64_t pf) {
    constexpr int U = unroll(R);
    const int64_t KU = K - K % (U * W), KW = K - K % W;
    for (int64_t n = n0; n < n1; ++n) {
        const float* wr = w + n * K;
        vf a[R][U];
        for (int r = 0; r < R; ++r)
            for (int u = 0; u < U; ++u) a[r][u] = vzero();
        int64_t k = 0;
        for (; k < KU; k += U * W) {
            if (pf) _mm_prefetch((const char*)(wr + k + pf), _MM_HINT_T0);
            vf wv[U];
            for (int u = 0; u < U; ++u) wv[u] = vload(wr + k + u * W);
            for (int r = 0; r < R; ++r)
                for (int u = 0; u < U; ++u) a[r][u] = vfma(wv[u], vload(x + r * K + k + u * W), a[r][u]);
        }
        for (; k < KW; k += W) {
            const vf w0 = vload(wr + k);
            for (int r = 0; r < R; ++r) a[r][0] = vfma(w0, vload(x + r * K + k), a[r][0]);
        }
        if (k < K) {
            const vf w0 = vload_n(wr + k, K - k);
            for (int r = 0; r < R; ++r) a[r][U - 1] = vfma(w0, vload_n(x + r * K + k, K - k), a[r][U - 1]);
        }
        for (int r = 0; r < R; ++r) out[r * ldo + n] = vsum_u<U>(a[r]);
    }
}

// two weight rows at a time for R (2..4) input rows: each x vector loaded once for both rows (at 4 input rows the
// loads of x, not the weights' stream, bound f32_rows); U2 vectors per weight row in flight (1 with 16 registers)
template <int R>
static void f32_rows2(const float* x, int64_t K, const float* w, int64_t n0, int64_t n1, float* out, int64_t ldo) {
    constexpr int U2 = NREGS >= 32 ? 2 : 1;
    const int64_t KU = K - K % (U2 * W), KW = K - K % W;
    int64_t n = n0;
    for (; n + 2 <= n1; n += 2) {
        const float* w0 = w + n * K;
        const float* w1 = w0 + K;
        vf a[R][2][U2];
        for (int r = 0; r < R; ++r)
            for (int j = 0; j < 2; ++j)
                for (int u = 0; u < U2; ++u) a[r][j][u] = vzero();
        int64_t k = 0;
        for (; k < KU; k += U2 * W) {
            vf u0[U2], v0[U2];
            for (int u = 0; u < U2; ++u) u0[u] = vload(w0 + k + u * W), v0[u] = vload(w1 + k + u * W);
            for (int r = 0; r < R; ++r)
                for (int u = 0; u < U2; ++u) {
                    const vf x0 = vload(x + r * K + k + u * W);
                    a[r][0][u] = vfma(u0[u], x0, a[r][0][u]);
                    a[r][1][u] = vfma(v0[u], x0, a[r][1][u]);
                }
        }
        for (; k < KW; k += W) {
            const vf u0 = vload(w0 + k), v0 = vload(w1 + k);
            for (int r = 0; r < R; ++r) {
                const vf x0 = vload(x + r * K + k);
                a[r][0][0] = vfma(u0, x0, a[r][0][0]);
                a[r][1][0] = vfma(v0, x0, a[r][1][0]);
            }
        }
        if (k < K) {
            const vf u0 = vload_n(w0 + k, K - k), v0 = vload_n(w1 + k, K - k);
            for (int r = 0; r < R; ++r) {
                const vf x0 = vload_n(x + r * K + k, K - k);
                a[r][0][U2 - 1] = vfma(u0, x0, a[r][0][U2 - 1]);
                a[r][1][U2 - 1] = vfma(v0, x0, a[r][1][U2 - 1]);
            }
        }
        for (int r = 0; r < R; ++r) {
            out[r * ldo + n] = vsum_u<U2>(a[r][0]);
            out[r * ldo + n + 1] = vsum_u<U2>(a[r][1]);
        }
    }
    if (n < n1) f32_rows<R>(x, K, w, n, n1, out, ldo, 0);
}

// ---------------------------------------------------------------------------------------------- bf16 weights
// Blocks of B = 2W bf16 (one vector register). Mode 1 reads the inputs in the order the weights split into
// without a shuffle: a vector of 2W bf16 weights is W fp32 lanes, each holding weight 2j in its low and 2j + 1 in
// its high 16 bits, so a left shift by 16 gives the even weights as fp32 and an and with 0xffff0000 the odd ones
// (two one-cycle integer ops per vector, against lane-crossing shuffles for the widening to input order, which
// bounded the bf16 rows below fp32's rate per byte on AVX-512). The inputs are reordered to match once per call.
// Returns x_eo: the inputs of R rows (fp32, row stride K) per block of B: its W even inputs, then its W odd ones,
// zero past K; [R][Kp] (Kp: K rounded up to B), 64-byte aligned (the caller frees it)
static float* split_even_odd(const float* xf, int R, int64_t K, int64_t Kp) {
    float* xs = (float*)aligned_alloc(64, (size_t)(R * Kp * 4));
    for (int r = 0; r < R; ++r)
        for (int64_t k = 0; k < Kp; k += 2 * W)
            for (int j = 0; j < W; ++j) {
                const int64_t e = k + 2 * j, o = e + 1;
                xs[r * Kp + k + j] = e < K ? xf[r * K + e] : 0.0f;
                xs[r * Kp + k + W + j] = o < K ? xf[r * K + o] : 0.0f;
            }
    return xs;
}

// the last K - k (< 2W) bf16 of row p, zero-padded to one vector (vdpbf16ps and the even / odd split need pairs)
static inline vi load_bf16_tail(const uint16_t* p, int64_t n) {
    alignas(64) uint16_t t[2 * W] = {};
    memcpy(t, p, (size_t)n * 2);
    return vload_bf16(t);
}

// mode 0: bf16 x bf16 (vdot_bf16) on x (bf16, row stride K); mode 1: weights widened to fp32 (even / odd halves,
// above), x given in fp32 (xf, row stride K, in input order). Per output row: U accumulators per input row; each
// block of 2W inputs is summed as its even then its odd half (mode 1, and mode 0 without vdpbf16ps; with it, the
// instruction's pairs): another order than the inputs', the same products, in fp32.
template <int R, int MODE>
static void bf16_rows(const uint16_t* x, const float* xf, int64_t K, const uint16_t* w, int64_t n0, int64_t n1,
                      float* out, int64_t ldo, int64_t pf) {
    constexpr int U = unroll(R), B = 2 * W;
    const int64_t KU = K - K % (U * B), KB = K - K % B, Kp = (K + B - 1) / B * B;
    float* xs = MODE == 1 ? split_even_odd(xf, R, K, Kp) : nullptr;
    for (int64_t n = n0; n < n1; ++n) {
        const uint16_t* wr = w + n * K;
        vf a[R][U];
        for (int r = 0; r < R; ++r)
            for (int u = 0; u < U; ++u) a[r][u] = vzero();
        int64_t k = 0;
        for (; k < KU; k += U * B) {
            if (pf) _mm_prefetch((const char*)(wr + k + pf), _MM_HINT_T0);
            vi wv[U];
            for (int u = 0; u < U; ++u) wv[u] = vload_bf16(wr + k + B * u);
            if (MODE == 0) {
                for (int r = 0; r < R; ++r)
                    for (int u = 0; u < U; ++u) a[r][u] = vdot_bf16(a[r][u], vload_bf16(x + r * K + k + B * u), wv[u]);
            } else {
                for (int u = 0; u < U; ++u) {
                    const vf we = veven(wv[u]), wo = vodd(wv[u]);
                    for (int r = 0; r < R; ++r) {
                        const float* xr = xs + r * Kp + k + B * u;
                        a[r][u] = vfma(we, vload(xr), a[r][u]);
                        a[r][u] = vfma(wo, vload(xr + W), a[r][u]);
                    }
                }
            }
        }
        for (; k < Kp; k += B) {        // whole blocks, then the last < 2W inputs zero-padded
            const bool tail = k >= KB;
            const vi wv = tail ? load_bf16_tail(wr + k, K - k) : vload_bf16(wr + k);
            for (int r = 0; r < R; ++r) {
                if (MODE == 0) {
                    const vi xv = tail ? load_bf16_tail(x + r * K + k, K - k) : vload_bf16(x + r * K + k);
                    a[r][0] = vdot_bf16(a[r][0], xv, wv);
                } else {
                    const float* xr = xs + r * Kp + k;
                    a[r][0] = vfma(veven(wv), vload(xr), a[r][0]);
                    a[r][U - 1] = vfma(vodd(wv), vload(xr + W), a[r][U - 1]);
                }
            }
        }
        for (int r = 0; r < R; ++r) out[r * ldo + n] = vsum_u<U>(a[r]);
    }
    free(xs);
}

// two weight rows at a time for R (2..4) input rows, bf16 x bf16 (as f32_rows2: each x vector loaded once for
// both); U2 vectors per weight row in flight (1 with 16 registers)
template <int R>
static void bf16_rows2(const uint16_t* x, int64_t K, const uint16_t* w, int64_t n0, int64_t n1, float* out,
                       int64_t ldo) {
    constexpr int U2 = NREGS >= 32 ? 2 : 1, B = 2 * W;
    const int64_t KU = K - K % (U2 * B), KB = K - K % B, Kp = (K + B - 1) / B * B;
    int64_t n = n0;
    for (; n + 2 <= n1; n += 2) {
        const uint16_t* w0 = w + n * K;
        const uint16_t* w1 = w0 + K;
        vf a[R][2][U2];
        for (int r = 0; r < R; ++r)
            for (int j = 0; j < 2; ++j)
                for (int u = 0; u < U2; ++u) a[r][j][u] = vzero();
        int64_t k = 0;
        for (; k < KU; k += U2 * B) {
            vi u0[U2], v0[U2];
            for (int u = 0; u < U2; ++u) u0[u] = vload_bf16(w0 + k + B * u), v0[u] = vload_bf16(w1 + k + B * u);
            for (int r = 0; r < R; ++r)
                for (int u = 0; u < U2; ++u) {
                    const vi x0 = vload_bf16(x + r * K + k + B * u);
                    a[r][0][u] = vdot_bf16(a[r][0][u], x0, u0[u]);
                    a[r][1][u] = vdot_bf16(a[r][1][u], x0, v0[u]);
                }
        }
        for (; k < Kp; k += B) {
            const bool tail = k >= KB;
            const vi u0 = tail ? load_bf16_tail(w0 + k, K - k) : vload_bf16(w0 + k);
            const vi v0 = tail ? load_bf16_tail(w1 + k, K - k) : vload_bf16(w1 + k);
            for (int r = 0; r < R; ++r) {
                const vi x0 = tail ? load_bf16_tail(x + r * K + k, K - k) : vload_bf16(x + r * K + k);
                a[r][0][0] = vdot_bf16(a[r][0][0], x0, u0);
                a[r][1][0] = vdot_bf16(a[r][1][0], x0, v0);
            }
        }
        for (int r = 0; r < R; ++r) {
            out[r * ldo + n] = vsum_u<U2>(a[r][0]);
            out[r * ldo + n + 1] = vsum_u<U2>(a[r][1]);
        }
    }
    if (n < n1) bf16_rows<R, 0>(x, nullptr, K, w, n, n1, out, ldo, 0);
}

// ------------------------------------------------------------------------------ several weight rows (streams)
// One input row against S weight rows at a time, one accumulator each: S sequential streams at once, S x K apart.
// Read one after the other (f32_rows<1>) the weights are one stream, and the hardware prefetcher, which follows a
// stream within one 4 KB page, starts over at each page; with S streams in flight the core keeps more misses
// outstanding. Measured on the Xeon (AVX-512, one thread, bench/gemv_streams_probe.cpp,
// bench/results/gemv-streams-xeon.md): fp32 rows of 4-11 KB 1.29-1.52x one row at a time, rows of 2.3-3 KB
// 1.08-1.22x, bf16 rows of 2 KB 1.05x, of 1.2 KB 0.88x (slower), so used only from STRIPE_ROW_BYTES. Sums: per output, one accumulator over the row in steps of W (another order
// than f32_rows' U accumulators: results differ in rounding only).
constexpr int STRIPES = 8;
constexpr int64_t STRIPE_ROW_BYTES = 2048;

// R (1..4) input rows against S weight rows at a time, one accumulator per (weight row, input row): S streams, each
// x vector loaded once for the S rows. S = row_stripes(R): as many as the registers hold beside the R x vectors and
// one weight vector (AVX-512: 8, 8, 8, 6; AVX2: 8, 4, 3, 2). Per output the sum is the same as at one row (one
// accumulator over the row in steps of W, then the lanes), so an input row's outputs do not depend on the rows
// beside it (nor on its row count, nor on where a thread's chunk starts).
constexpr int row_stripes(int R) {
    return NREGS >= 32 ? (R <= 3 ? STRIPES : 6) : (R == 1 ? STRIPES : R == 2 ? 4 : R == 3 ? 3 : 2);
}

// S weight rows from n against R input rows: one accumulator per (weight row, input row) over the row in steps of W
template <int R, int S>
static inline void f32_block(const float* x, int64_t K, const float* w, int64_t n, float* out, int64_t ldo) {
    const int64_t KW = K - K % W;
    const float* wn = w + n * K;
    vf a[S][R];
    for (int s = 0; s < S; ++s)
        for (int r = 0; r < R; ++r) a[s][r] = vzero();
    int64_t k = 0;
    for (; k < KW; k += W) {
        vf xv[R];
        for (int r = 0; r < R; ++r) xv[r] = vload(x + r * K + k);
        for (int s = 0; s < S; ++s) {
            const vf wv = vload(wn + s * K + k);
            for (int r = 0; r < R; ++r) a[s][r] = vfma(wv, xv[r], a[s][r]);
        }
    }
    if (k < K) {
        vf xv[R];
        for (int r = 0; r < R; ++r) xv[r] = vload_n(x + r * K + k, K - k);
        for (int s = 0; s < S; ++s) {
            const vf wv = vload_n(wn + s * K + k, K - k);
            for (int r = 0; r < R; ++r) a[s][r] = vfma(wv, xv[r], a[s][r]);
        }
    }
    for (int s = 0; s < S; ++s)
        for (int r = 0; r < R; ++r) out[r * ldo + n + s] = vsum(a[s][r]);
}

// the rows left over (fewer than S) one at a time, in the same order per output
template <int R>
static void f32_stripes(const float* x, int64_t K, const float* w, int64_t n0, int64_t n1, float* out,
                        int64_t ldo) {
    constexpr int S = row_stripes(R);
    int64_t n = n0;
    for (; n + S <= n1; n += S) f32_block<R, S>(x, K, w, n, out, ldo);
    for (; n < n1; ++n) f32_block<R, 1>(x, K, w, n, out, ldo);
}

// bf16 weights, R (1..4) input rows against S weight rows at a time, as f32_stripes: MODE 0 bf16 x bf16 (vdot_bf16
// on x), MODE 1 the weights widened (even / odd halves) against xs (fp32, each block's even then odd inputs, from
// split_even_odd, row stride Kp). S = bf16_stripes_for(MODE, R): MODE 1 holds two x vectors per input row.
constexpr int bf16_stripes_for(int MODE, int R) {
    return MODE == 0 ? row_stripes(R)
                     : NREGS >= 32 ? (R <= 2 ? STRIPES : R == 3 ? 6 : 4) : (R == 1 ? STRIPES : R == 2 ? 4 : R == 3 ? 2 : 1);
}

template <int R, int S, int MODE>
static inline void bf16_block(const uint16_t* x, const float* xs, int64_t K, int64_t Kp, const uint16_t* w, int64_t n,
                              float* out, int64_t ldo) {
    constexpr int B = 2 * W;
    const int64_t KB = K - K % B;
    const uint16_t* wn = w + n * K;
    vf a[S][R];
    for (int s = 0; s < S; ++s)
        for (int r = 0; r < R; ++r) a[s][r] = vzero();
    for (int64_t k = 0; k < Kp; k += B) {
        const bool tail = k >= KB;
        if (MODE == 0) {
            vi xv[R];
            for (int r = 0; r < R; ++r) xv[r] = tail ? load_bf16_tail(x + r * K + k, K - k) : vload_bf16(x + r * K + k);
            for (int s = 0; s < S; ++s) {
                const vi wv = tail ? load_bf16_tail(wn + s * K + k, K - k) : vload_bf16(wn + s * K + k);
                for (int r = 0; r < R; ++r) a[s][r] = vdot_bf16(a[s][r], xv[r], wv);
            }
        } else {
            vf xe[R], xo[R];
            for (int r = 0; r < R; ++r) {
                xe[r] = vload(xs + r * Kp + k);
                xo[r] = vload(xs + r * Kp + k + W);
            }
            for (int s = 0; s < S; ++s) {
                const vi wv = tail ? load_bf16_tail(wn + s * K + k, K - k) : vload_bf16(wn + s * K + k);
                const vf we = veven(wv), wo = vodd(wv);
                for (int r = 0; r < R; ++r) a[s][r] = vfma(wo, xo[r], vfma(we, xe[r], a[s][r]));
            }
        }
    }
    for (int s = 0; s < S; ++s)
        for (int r = 0; r < R; ++r) out[r * ldo + n + s] = vsum(a[s][r]);
}

template <int R, int MODE>
static void bf16_stripes(const uint16_t* x, const float* xf, int64_t K, const uint16_t* w, int64_t n0, int64_t n1,
                         float* out, int64_t ldo) {
    constexpr int S = bf16_stripes_for(MODE, R), B = 2 * W;
    const int64_t Kp = (K + B - 1) / B * B;
    float* xs = MODE == 1 ? split_even_odd(xf, R, K, Kp) : nullptr;
    int64_t n = n0;
    for (; n + S <= n1; n += S) bf16_block<R, S, MODE>(x, xs, K, Kp, w, n, out, ldo);
    for (; n < n1; ++n) bf16_block<R, 1, MODE>(x, xs, K, Kp, w, n, out, ldo);
    free(xs);
}

// ----------------------------------------------------------------------------------- fp32, blocked layout
// The weight reordered once (tensorpar.decode.gemv_kernel.block) from [N, K] into blocks of NB = 32 output rows,
// each block k-major: wb[(n / NB) * K * NB + k * NB + n % NB] = w[n, k] (the last block's rows past N zero). Per
// input k the NB weights of a block are NB / W contiguous vectors: each input value is broadcast and multiplied
// into them (the outer-product form of a GEMM's micro-kernel), so the accumulators are output vectors (no
// horizontal sums) and every block is one sequential stream. Each output is summed in one lane from k = 0 to K - 1 by fma, whatever the
// rows beside it, the kernel variant or the thread split: an input row's outputs are bitwise the same at any row
// count (the batch-invariance the stripes above also keep). Numbers: bench/bench_gemv.py, docs/decode.md.
constexpr int NB = 32;
constexpr int NV = NB / W;                                  // vectors per block and k: 2 (AVX-512), 4 (AVX2)
// the most input rows per micro-kernel call: MR x NV accumulators + NV weight vectors + 1 broadcast in registers
constexpr int MR_MAX = NREGS >= 32 ? 12 : 3;
// rows at most for which two blocks go at once (more streams in flight where the rows are few): 2 x MR x NV
// accumulators
constexpr int MR_PAIR = NREGS >= 32 ? 4 : 1;
// at most this many rows the blocked kernels run four blocks per call (four weight streams, 8 + 8 MR of the 32
// registers; AVX-512 only): at 1 and 2 rows 0.87-0.95x the time of two blocks per call, the same sums
// (bench/results/gemv-quad-epyc{,-b}.md, the 1.1B's tp=2 matrices from memory, one thread)
constexpr int MR_QUAD = NREGS >= 32 ? 2 : 0;
// a block's inputs as stored: K; the bf16 layout pairs them, an odd K padded with a zero input (never read from x)
template <typename WT>
static inline int64_t kpad(int64_t K) { return sizeof(WT) == 4 ? K : K + (K & 1); }

// NBLK blocks' NB weights at input k as NV fp32 vectors each: fp32 (WT float) loaded as they are; bf16 (WT
// uint16_t, the bf16 blocked layout: inputs in pairs, lane j of vector l holding row l W + j at inputs k and k + 1
// for even k) widened by a shift (even k, P 0) or an and (odd k, P 1), exact; P = k % 2 (0 for fp32)
template <int NBLK, typename WT, int P>
static inline void blk_load(const WT* wb, int64_t K, int64_t k, vf (*wv)[NV]) {
    for (int b = 0; b < NBLK; ++b) {
        if constexpr (sizeof(WT) == 4) {
            for (int v = 0; v < NV; ++v) wv[b][v] = vload((const float*)wb + b * K * NB + k * NB + v * W);
        } else {
            for (int v = 0; v < NV; ++v) {
                const vi t = vload_bf16((const uint16_t*)wb + b * kpad<WT>(K) * NB + (k - P) * NB + v * 2 * W);
                wv[b][v] = P ? vodd(t) : veven(t);
            }
        }
    }
}

// MR input rows (row stride K) x NBLK consecutive blocks from wb (block stride K * NB) -> out (row stride ldo)
template <int MR, int NBLK, typename WT>
static inline void blk_micro(const float* x, int64_t K, const WT* wb, float* out, int64_t ldo) {
    vf a[MR][NBLK][NV];
    for (int r = 0; r < MR; ++r)
        for (int b = 0; b < NBLK; ++b)
            for (int v = 0; v < NV; ++v) a[r][b][v] = vzero();
    constexpr int KS = sizeof(WT) == 4 ? 1 : 2;           // bf16: k and k + 1 from one load per vector
    for (int64_t k = 0; k < K; k += KS) {
        vf wv[NBLK][NV];
        blk_load<NBLK, WT, 0>(wb, K, k, wv);
        for (int r = 0; r < MR; ++r) {
            const vf xb = vbroadcast(x + r * K + k);
            for (int b = 0; b < NBLK; ++b)
                for (int v = 0; v < NV; ++v) a[r][b][v] = vfma(wv[b][v], xb, a[r][b][v]);
        }
        if constexpr (KS == 2) {
            if (k + 1 == K) break;                          // an odd K's last input: its pair's low half only
            blk_load<NBLK, WT, 1>(wb, K, k + 1, wv);
            for (int r = 0; r < MR; ++r) {
                const vf xb = vbroadcast(x + r * K + k + 1);
                for (int b = 0; b < NBLK; ++b)
                    for (int v = 0; v < NV; ++v) a[r][b][v] = vfma(wv[b][v], xb, a[r][b][v]);
            }
        }
    }
    for (int r = 0; r < MR; ++r)
        for (int b = 0; b < NBLK; ++b)
            for (int v = 0; v < NV; ++v) vstore(out + r * ldo + b * NB + v * W, a[r][b][v]);
}

// R (1..MR_MAX) input rows against NBLK blocks, R a run-time value
template <int NBLK, typename WT>
static void blk_rows(int R, const float* x, int64_t K, const WT* wb, float* out, int64_t ldo) {
    switch (R) {
#define TP_BLK(RR) case RR: if constexpr (RR <= MR_MAX) blk_micro<RR, NBLK, WT>(x, K, wb, out, ldo); break;
        TP_BLK(1) TP_BLK(2) TP_BLK(3) TP_BLK(4) TP_BLK(5) TP_BLK(6)
        TP_BLK(7) TP_BLK(8) TP_BLK(9) TP_BLK(10) TP_BLK(11) TP_BLK(12)
#undef TP_BLK
        default: break;
    }
}

// NBLK blocks from block b for R input rows into y (row stride N); the last block of a layout whose N is not a
// multiple of NB (its rows zero-padded) goes through a scratch and only its first N % NB outputs are copied
template <int NBLK, typename WT>
static void blk_call(int R, const float* x, int64_t K, const WT* wb, int64_t b, float* y, int64_t N) {
    if ((b + NBLK) * NB <= N) {
        blk_rows<NBLK, WT>(R, x, K, wb + b * kpad<WT>(K) * NB, y + b * NB, N);
        return;
    }
    alignas(64) float tmp[MR_MAX * NBLK * NB];
    blk_rows<NBLK, WT>(R, x, K, wb + b * kpad<WT>(K) * NB, tmp, NBLK * NB);
    const int64_t n = N - b * NB;
    for (int r = 0; r < R; ++r) memcpy(y + r * N + b * NB, tmp + r * NBLK * NB, (size_t)n * sizeof(float));
}

// MR input rows packed k-major (xp[k * MR + r]: the broadcasts one sequential stream, not MR) x one full block;
// each output the same fma chain from k = 0 to K - 1 as in blk_micro, so the same bits
template <int MR, typename WT>
static inline void blk_micro_packed(const float* xp, int64_t K, const WT* wb, float* out, int64_t ldo) {
    vf a[MR][NV];
    for (int r = 0; r < MR; ++r)
        for (int v = 0; v < NV; ++v) a[r][v] = vzero();
    constexpr int KS = sizeof(WT) == 4 ? 1 : 2;
    for (int64_t k = 0; k < K; k += KS) {
        vf wv[1][NV];
        blk_load<1, WT, 0>(wb, K, k, wv);
        for (int r = 0; r < MR; ++r) {
            const vf xb = vbroadcast(xp + k * MR + r);
            for (int v = 0; v < NV; ++v) a[r][v] = vfma(wv[0][v], xb, a[r][v]);
        }
        if constexpr (KS == 2) {
            if (k + 1 == K) break;
            blk_load<1, WT, 1>(wb, K, k + 1, wv);
            for (int r = 0; r < MR; ++r) {
                const vf xb = vbroadcast(xp + (k + 1) * MR + r);
                for (int v = 0; v < NV; ++v) a[r][v] = vfma(wv[0][v], xb, a[r][v]);
            }
        }
    }
    for (int r = 0; r < MR; ++r)
        for (int v = 0; v < NV; ++v) vstore(out + r * ldo + v * W, a[r][v]);
}

template <typename WT>
static void blk_rows_packed(int R, const float* xp, int64_t K, const WT* wb, float* out, int64_t ldo) {
    switch (R) {
#define TP_BLK(RR) case RR: if constexpr (RR <= MR_MAX) blk_micro_packed<RR, WT>(xp, K, wb, out, ldo); break;
        TP_BLK(1) TP_BLK(2) TP_BLK(3) TP_BLK(4) TP_BLK(5) TP_BLK(6)
        TP_BLK(7) TP_BLK(8) TP_BLK(9) TP_BLK(10) TP_BLK(11) TP_BLK(12)
#undef TP_BLK
        default: break;
    }
}

// blocks [b0, b1) for all M input rows. At most MR_PAIR rows: four (at most MR_QUAD rows) or two blocks per call,
// the rows as they are. Else the
// rows in chunks of at most 4 MiB of K values, each chunk packed once into row groups of MR_MAX, k-major
// (blk_micro_packed: 1.1-1.4x the unpacked micro-kernel at 32 rows and 1.6x at 12 on the 1.1B's matrices, AMD
// EPYC Zen 4, bench/results/gemv-packed-trials-epyc.md); each block is read from memory once per chunk by the
// chunk's first row group, from L2 by the others (a decode step's <= 32 rows are one chunk up to K = 32768). The
// zero-padded last block of an N that is not a multiple of NB takes the unpacked path through its scratch.
template <typename WT>
static void blk_range(const float* x, int64_t M, int64_t K, const WT* wb, int64_t b0, int64_t b1, float* y,
                      int64_t N) {
    if (M <= MR_PAIR) {
        int64_t b = b0;
        if (M <= MR_QUAD)
            for (; b + 4 <= b1; b += 4) blk_call<4, WT>((int)M, x, K, wb, b, y, N);
        for (; b + 2 <= b1; b += 2) blk_call<2, WT>((int)M, x, K, wb, b, y, N);
        if (b < b1) blk_call<1, WT>((int)M, x, K, wb, b, y, N);
        return;
    }
    int64_t mc = K > 0 ? (4 * 1024 * 1024) / (K * 4) : MR_MAX;
    mc = mc < MR_MAX ? MR_MAX : mc - mc % MR_MAX;
    float* xp = (float*)malloc((size_t)(mc < M ? mc : M) * K * sizeof(float));   // null: the unpacked path
    for (int64_t m0 = 0; m0 < M; m0 += mc) {
        const int64_t m1 = m0 + mc < M ? m0 + mc : M;
        for (int64_t m = m0; xp && m < m1; m += MR_MAX) {  // pack: row group g at xp + (m - m0) * K, k-major
            const int R = m1 - m < MR_MAX ? (int)(m1 - m) : MR_MAX;
            float* g = xp + (m - m0) * K;
            for (int64_t k = 0; k < K; ++k)
                for (int r = 0; r < R; ++r) g[k * R + r] = x[(m + r) * K + k];
        }
        for (int64_t b = b0; b < b1; ++b) {
            if (!xp || (b + 1) * NB > N) {                // the zero-padded last block: the unpacked path
                for (int64_t m = m0; m < m1; m += MR_MAX) {
                    const int R = m1 - m < MR_MAX ? (int)(m1 - m) : MR_MAX;
                    blk_call<1, WT>(R, x + m * K, K, wb, b, y + m * N, N);
                }
                continue;
            }
            for (int64_t m = m0; m < m1; m += MR_MAX) {
                const int R = m1 - m < MR_MAX ? (int)(m1 - m) : MR_MAX;
                blk_rows_packed<WT>(R, xp + (m - m0) * K, K, wb + b * kpad<WT>(K) * NB, y + m * N + b * NB, N);
            }
        }
    }
    free(xp);
}

// y [M, N] = x [M, K] @ w[N, K]^T + bias, x, y and bias fp32, w in the blocked layout above (fp32), or its bf16
// form (WT uint16_t): ceil(N / NB) blocks, the last one's rows past N zero; threads > 1: OpenMP over ranges of
// blocks (the sums do not depend on the split)
template <typename WT>
static void gemv_blocked(const float* x, int64_t M, int64_t K, const WT* wb, int64_t N, const float* bias, float* y,
                         int threads) {
    const int64_t nb = (N + NB - 1) / NB;
    if (threads <= 1 || nb < 2) {
        blk_range<WT>(x, M, K, wb, 0, nb, y, N);
    } else {
        const int64_t per = (nb + threads - 1) / threads;
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int t = 0; t < threads; ++t) {
            const int64_t b0 = t * per, b1 = b0 + per < nb ? b0 + per : nb;
            if (b0 < b1) blk_range<WT>(x, M, K, wb, b0, b1, y, N);
        }
    }
    if (bias)
        for (int64_t m = 0; m < M; ++m)
            for (int64_t n = 0; n < N; ++n) y[m * N + n] += bias[n];
}

static void tp_gemv_blocked(const float* x, int64_t M, int64_t K, const float* wb, int64_t N, const float* bias,
                            float* y, int threads) {
    gemv_blocked<float>(x, M, K, wb, N, bias, y, threads);
}

// ------------------------------------------------------------------------------------------------ the driver
// one thread's rows [n0, n1): chunks of rows that stay in L2 while each group of <= 4 input rows reads them; rows
// of at least STRIPE_ROW_BYTES several weight rows at a time (f32_stripes, bf16_stripes)
static void run_rows(int dtype, int mode, const void* x, const float* xf, int64_t M, int64_t K, const void* w,
                     int64_t n0, int64_t n1, float* acc, int64_t N, int64_t pf) {
    const int64_t esz = dtype == 0 ? 4 : 2;
    int64_t chunk = M <= 4 ? n1 - n0 : (256 * 1024) / (K * esz);
    if (chunk >= 24) chunk -= chunk % 24;       // a multiple of every stripe count (8, 6, 4, 3, 2)
    if (chunk < 1) chunk = 1;
    for (int64_t c0 = n0; c0 < n1; c0 += chunk) {
        const int64_t c1 = c0 + chunk < n1 ? c0 + chunk : n1;
        for (int64_t m = 0; m < M; m += 4) {
            const int R = M - m < 4 ? (int)(M - m) : 4;
            float* o = acc + m * N;
            if (dtype == 0) {
                const float* xm = (const float*)x + m * K;
                const float* wf = (const float*)w;
                if (K * esz >= STRIPE_ROW_BYTES && (R == 1 || mode != 2)) {
                    switch (R) {
                        case 1: f32_stripes<1>(xm, K, wf, c0, c1, o, N); break;
                        case 2: f32_stripes<2>(xm, K, wf, c0, c1, o, N); break;
                        case 3: f32_stripes<3>(xm, K, wf, c0, c1, o, N); break;
                        default: f32_stripes<4>(xm, K, wf, c0, c1, o, N); break;
                    }
                } else if (mode == 2) {
                    switch (R) {
                        case 1: f32_rows<1>(xm, K, wf, c0, c1, o, N, pf); break;
                        case 2: f32_rows2<2>(xm, K, wf, c0, c1, o, N); break;
                        case 3: f32_rows2<3>(xm, K, wf, c0, c1, o, N); break;
                        default: f32_rows2<4>(xm, K, wf, c0, c1, o, N); break;
                    }
                } else {
                    switch (R) {
                        case 1: f32_rows<1>(xm, K, wf, c0, c1, o, N, pf); break;
                        case 2: f32_rows<2>(xm, K, wf, c0, c1, o, N, pf); break;
                        case 3: f32_rows<3>(xm, K, wf, c0, c1, o, N, pf); break;
                        default: f32_rows<4>(xm, K, wf, c0, c1, o, N, pf); break;
                    }
                }
            } else if (K * esz >= STRIPE_ROW_BYTES && (R == 1 || mode != 2)) {
                const uint16_t* xm = (const uint16_t*)x + m * K;
                const float* xfm = xf ? xf + m * K : nullptr;
                const uint16_t* wb = (const uint16_t*)w;
#define TP_BF16S(RR) (mode == 1 ? bf16_stripes<RR, 1>(xm, xfm, K, wb, c0, c1, o, N) \
                                : bf16_stripes<RR, 0>(xm, xfm, K, wb, c0, c1, o, N))
                switch (R) {
                    case 1: TP_BF16S(1); break;
                    case 2: TP_BF16S(2); break;
                    case 3: TP_BF16S(3); break;
                    default: TP_BF16S(4); break;
                }
#undef TP_BF16S
            } else if (mode == 2 && R > 1) {
                const uint16_t* xm = (const uint16_t*)x + m * K;
                const uint16_t* wb = (const uint16_t*)w;
                switch (R) {
                    case 2: bf16_rows2<2>(xm, K, wb, c0, c1, o, N); break;
                    case 3: bf16_rows2<3>(xm, K, wb, c0, c1, o, N); break;
                    default: bf16_rows2<4>(xm, K, wb, c0, c1, o, N); break;
                }
            } else {
                const uint16_t* xm = (const uint16_t*)x + m * K;
                const float* xfm = xf ? xf + m * K : nullptr;
                const uint16_t* wb = (const uint16_t*)w;
                const int bmode = mode == 2 ? 0 : mode;
#define TP_BF16(RR) (bmode == 0 ? bf16_rows<RR, 0>(xm, xfm, K, wb, c0, c1, o, N, pf) \
                               : bf16_rows<RR, 1>(xm, xfm, K, wb, c0, c1, o, N, pf))
                switch (R) {
                    case 1: TP_BF16(1); break;
                    case 2: TP_BF16(2); break;
                    case 3: TP_BF16(3); break;
                    default: TP_BF16(4); break;
                }
#undef TP_BF16
            }
        }
    }
}

// y [M, N] = x [M, K] @ w[N, K]^T + bias. dtype 0: x, w, bias, y fp32; dtype 1: x, w, bias, y bf16 (bias may be
// null), sums in fp32, mode 0 bf16 x bf16 (vdpbf16ps, or both widened without it) / 1 the weights widened and fma
// with x in fp32; mode 2: 2..4 input rows two weight rows at a time (one row: as mode 0); mode 3 (fp32 only):
// w in the blocked layout (tp_gemv_blocked). pf: software prefetch
// distance in elements (0: none). threads > 1: OpenMP over chunks of 64 output rows.
extern "C" void tp_gemv(int dtype, int mode, const void* x, int64_t M, int64_t K, const void* w, int64_t N,
                        const void* bias, void* y, int threads, int64_t pf) {
    if (mode == 3) {                // fp32 on the blocked layout (dtype 0 only: the caller checks)
        tp_gemv_blocked((const float*)x, M, K, (const float*)w, N, (const float*)bias, (float*)y, threads);
        return;
    }
    float* xf = nullptr;
    if (dtype == 1 && mode == 1) {
        xf = (float*)aligned_alloc(64, (size_t)((M * K * 4 + 63) / 64 * 64));
        const uint16_t* xb = (const uint16_t*)x;
        for (int64_t i = 0; i < M * K; ++i) xf[i] = bf16_to_f32(xb[i]);
    }
    float* acc = dtype == 0 ? (float*)y : (float*)aligned_alloc(64, (size_t)((M * N * 4 + 63) / 64 * 64));
    if (threads <= 1) {
        run_rows(dtype, mode, x, xf, M, K, w, 0, N, acc, N, pf);
    } else {
        const int64_t chunk = 64, nchunks = (N + chunk - 1) / chunk;
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t c = 0; c < nchunks; ++c) {
            const int64_t n0 = c * chunk, n1 = n0 + chunk < N ? n0 + chunk : N;
            run_rows(dtype, mode, x, xf, M, K, w, n0, n1, acc, N, pf);
        }
    }
    if (dtype == 0) {
        if (bias) {
            const float* b = (const float*)bias;
            float* yf = (float*)y;
            for (int64_t m = 0; m < M; ++m)
                for (int64_t n = 0; n < N; ++n) yf[m * N + n] += b[n];
        }
    } else {
        const uint16_t* b = (const uint16_t*)bias;
        uint16_t* yb = (uint16_t*)y;
        for (int64_t m = 0; m < M; ++m)
            for (int64_t n = 0; n < N; ++n)
                yb[m * N + n] = f32_to_bf16(acc[m * N + n] + (b ? bf16_to_f32(b[n]) : 0.0f));
        free(acc);
    }
    free(xf);
}

// bf16 weights computing in fp32 (--quantize bf16, tensorpar.decode.bf16_weights): y [M, N] fp32 = x [M, K] fp32
// @ w[N, K]^T (w bf16, widened to fp32 as mode 1 does, x read as given) + bias (fp32, may be null); y is not
// rounded to bf16. threads > 1: OpenMP over chunks of 64 output rows, as tp_gemv.
extern "C" void tp_gemv_bf16w(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t N,
                              const float* bias, float* y, int threads, int64_t pf) {
    if (threads <= 1) {
        run_rows(1, 1, x, x, M, K, w, 0, N, y, N, pf);
    } else {
        const int64_t chunk = 64, nchunks = (N + chunk - 1) / chunk;
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t c = 0; c < nchunks; ++c) {
            const int64_t n0 = c * chunk, n1 = n0 + chunk < N ? n0 + chunk : N;
            run_rows(1, 1, x, x, M, K, w, n0, n1, y, N, pf);
        }
    }
    if (bias)
        for (int64_t m = 0; m < M; ++m)
            for (int64_t n = 0; n < N; ++n) y[m * N + n] += bias[n];
}

// bf16 weights computing in fp32 on the bf16 blocked layout (tensorpar.decode.bf16_weights.block_bf16: as the fp32
// blocked layout with the inputs in pairs, per pair of inputs k, k + 1 (k even) a block's rows j at positions 2j and
// 2j + 1; an odd K padded to K + 1 with zeros): y [M, N] fp32 = x [M, K] fp32 @ w^T + bias (fp32, may be null).
// The same arguments as tp_gemv_bf16w (pf unused), so a step program calls either. Each output is summed as tp_gemv_blocked sums it:
// bitwise its result on the weights widened to fp32.
extern "C" void tp_gemv_bf16w_blocked(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t N,
                                      const float* bias, float* y, int threads, int64_t pf) {
    (void)pf;
    gemv_blocked<uint16_t>(x, M, K, w, N, bias, y, threads);
}

// ------------------------------------------------------------------ bf16 activations on the bf16 blocked layout
// The inputs of R rows as bf16 pairs (uint32: input 2i in the low, 2i + 1 in the high half), packed pair-major
// (xp[i * R + r]), each pair broadcast and multiplied into the pairs of a block's NB rows by vdot_bf16 (vdpbf16ps:
// acc + w[2i] x[2i] + w[2i + 1] x[2i + 1] per lane, the products exact in fp32; denormal inputs and results read as
// zero. Without AVX512_BF16 two fma in input order: then bitwise the fp32 chain of tp_gemv_bf16w_blocked). Each
// output summed in one lane over the pairs from i = 0 to K / 2 - 1, whatever the rows beside it or the thread split.
template <int MR, int NBLK>
static inline void dp_micro(const uint32_t* xp, int64_t K, const uint16_t* wb, float* out, int64_t ldo) {
    vf a[MR][NBLK][NV];
    for (int r = 0; r < MR; ++r)
        for (int b = 0; b < NBLK; ++b)
            for (int v = 0; v < NV; ++v) a[r][b][v] = vzero();
    const int64_t Kp = kpad<uint16_t>(K);
    for (int64_t i = 0; i < Kp / 2; ++i) {
        vi t[NBLK][NV];
        for (int b = 0; b < NBLK; ++b)
            for (int v = 0; v < NV; ++v) t[b][v] = vload_bf16(wb + b * Kp * NB + i * 2 * NB + v * 2 * W);
        for (int r = 0; r < MR; ++r) {
            const vi xb = vbroadcast32(xp + i * MR + r);
            for (int b = 0; b < NBLK; ++b)
                for (int v = 0; v < NV; ++v) a[r][b][v] = vdot_bf16(a[r][b][v], xb, t[b][v]);
        }
    }
    for (int r = 0; r < MR; ++r)
        for (int b = 0; b < NBLK; ++b)
            for (int v = 0; v < NV; ++v) vstore(out + r * ldo + b * NB + v * W, a[r][b][v]);
}

// R (1..MR_MAX) packed input rows against NBLK blocks from block b into y (row stride N); the zero-padded last
// block through a scratch (as blk_call)
template <int NBLK>
static void dp_call(int R, const uint32_t* xp, int64_t K, const uint16_t* wb, int64_t b, float* y, int64_t N) {
    alignas(64) float tmp[MR_MAX * NBLK * NB];
    const bool whole = (b + NBLK) * NB <= N;
    float* out = whole ? y + b * NB : tmp;
    const int64_t ldo = whole ? N : NBLK * NB;
    wb += b * kpad<uint16_t>(K) * NB;
    switch (R) {
#define TP_DP(RR) case RR: if constexpr (RR <= MR_MAX) dp_micro<RR, NBLK>(xp, K, wb, out, ldo); break;
        TP_DP(1) TP_DP(2) TP_DP(3) TP_DP(4) TP_DP(5) TP_DP(6)
        TP_DP(7) TP_DP(8) TP_DP(9) TP_DP(10) TP_DP(11) TP_DP(12)
#undef TP_DP
        default: break;
    }
    if (!whole)
        for (int r = 0; r < R; ++r)
            memcpy(y + r * N + b * NB, tmp + r * NBLK * NB, (size_t)(N - b * NB) * sizeof(float));
}

// y [M, N] fp32 = x [M, K] @ w^T + bias (fp32, may be null) for x fp32 holding bf16 values (a bf16 model's
// activations widened: read as their upper 16 bits, exact for such values) and w in the bf16 blocked layout;
// y not rounded (the caller rounds to bf16). The rows packed once as bf16 pairs into groups of MR_MAX rows (at most
// MR_PAIR rows: one group, two blocks per call); per chunk of groups of at most 4 MiB each block is read from memory
// once, from L2 by the chunk's other groups (as blk_range). threads > 1: OpenMP over ranges of blocks.
extern "C" void tp_gemv_bf16_blocked(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t N,
                                     const float* bias, float* y, int threads, int64_t pf) {
    (void)pf;
    if (M <= 0 || N <= 0) return;
    const int64_t K2 = (K + 1) / 2, nb = (N + NB - 1) / NB;
    const int G = M <= MR_PAIR ? (int)M : MR_MAX;               // rows per group
    // the packed rows: on the stack up to 64 KiB (a decode step's few rows), else the heap; a failed allocation
    // stops the process with one line (no output would be written: never a silently unwritten y)
    alignas(64) uint32_t small[16384];
    const size_t words = (size_t)(M * K2 > 0 ? M * K2 : 1);
    uint32_t* xp = words <= 16384 ? small : (uint32_t*)malloc(words * sizeof(uint32_t));
    if (!xp) {
        fprintf(stderr, "tp_gemv_bf16_blocked: out of memory packing %lld x %lld inputs\n", (long long)M, (long long)K);
        abort();
    }
    for (int64_t m = 0; m < M; m += G) {                        // group at xp + m * K2: pair i of row r at i * R + r
        const int R = M - m < G ? (int)(M - m) : G;
        const uint32_t* xr = (const uint32_t*)(x + m * K);
        for (int r = 0; r < R; ++r) {
            for (int64_t i = 0; i < K / 2; ++i)
                xp[m * K2 + i * R + r] = (xr[r * K + 2 * i] >> 16) | (xr[r * K + 2 * i + 1] & 0xffff0000u);
            if (K & 1) xp[m * K2 + (K2 - 1) * R + r] = xr[r * K + K - 1] >> 16;    // the padding input: zero
        }
    }
    int64_t mc = K2 > 0 ? (4 * 1024 * 1024) / (K2 * 4) : G;     // rows per chunk, whole groups
    mc = mc < G ? G : mc - mc % G;
    const int T = threads > 1 && nb >= 2 ? threads : 1;
    const int64_t per = (nb + T - 1) / T;
#pragma omp parallel for num_threads(T) schedule(static) if (T > 1)
    for (int t = 0; t < T; ++t) {
        const int64_t b0 = t * per, b1 = b0 + per < nb ? b0 + per : nb;
        for (int64_t m0 = 0; m0 < M; m0 += mc) {
            const int64_t m1 = m0 + mc < M ? m0 + mc : M;
            for (int64_t b = b0; b < b1;) {
                const int nblk = M <= MR_QUAD && b + 4 <= b1 ? 4 : M <= MR_PAIR && b + 2 <= b1 ? 2 : 1;
                for (int64_t m = m0; m < m1; m += G) {
                    const int R = m1 - m < G ? (int)(m1 - m) : G;
                    if (nblk == 4) dp_call<4>(R, xp + m * K2, K, w, b, y + m * N, N);
                    else if (nblk == 2) dp_call<2>(R, xp + m * K2, K, w, b, y + m * N, N);
                    else dp_call<1>(R, xp + m * K2, K, w, b, y + m * N, N);
                }
                b += nblk;
            }
        }
    }
    if (xp != small) free(xp);
    if (bias)
        for (int64_t m = 0; m < M; ++m)
            for (int64_t n = 0; n < N; ++n) y[m * N + n] += bias[n];
}

#ifdef __AVX512F__
// 16 x 16 32-bit values transposed: c[h] lane q = r[q] lane h (unpack 32, unpack 64, two 128-bit lane shuffles)
static inline void transpose16(const __m512i* r, __m512i* c) {
    __m512i t[16], u[16];
    for (int g = 0; g < 4; ++g) {
        const int a = 4 * g;
        t[a] = _mm512_unpacklo_epi32(r[a], r[a + 1]);
        t[a + 1] = _mm512_unpackhi_epi32(r[a], r[a + 1]);
        t[a + 2] = _mm512_unpacklo_epi32(r[a + 2], r[a + 3]);
        t[a + 3] = _mm512_unpackhi_epi32(r[a + 2], r[a + 3]);
        u[a] = _mm512_unpacklo_epi64(t[a], t[a + 2]);
        u[a + 1] = _mm512_unpackhi_epi64(t[a], t[a + 2]);
        u[a + 2] = _mm512_unpacklo_epi64(t[a + 1], t[a + 3]);
        u[a + 3] = _mm512_unpackhi_epi64(t[a + 1], t[a + 3]);
    }
    for (int o = 0; o < 4; ++o) {
        const __m512i v0 = _mm512_shuffle_i32x4(u[o], u[4 + o], 0x88), v1 = _mm512_shuffle_i32x4(u[o], u[4 + o], 0xDD);
        const __m512i w0 = _mm512_shuffle_i32x4(u[8 + o], u[12 + o], 0x88);
        const __m512i w1 = _mm512_shuffle_i32x4(u[8 + o], u[12 + o], 0xDD);
        c[o] = _mm512_shuffle_i32x4(v0, w0, 0x88);
        c[8 + o] = _mm512_shuffle_i32x4(v0, w0, 0xDD);
        c[4 + o] = _mm512_shuffle_i32x4(v1, w1, 0x88);
        c[12 + o] = _mm512_shuffle_i32x4(v1, w1, 0xDD);
    }
}
#endif

// Rows [start, stop) of a bf16 weight of K inputs held in the bf16 blocked layout p [ceil(n / 32), K + K % 2, 32]
// (block_bf16: in a block, inputs in pairs: pair i's 32 rows j at 64 i + 2 j and 64 i + 2 j + 1) written plain into dst
// [stop - start, K] (bf16 bits, exact), block by block in tiles of 256 inputs: the block's 32 x 256 values gathered
// into a tile (rows 512 bytes apart; AVX-512: 16 pairs of 16 rows at a time as a 16 x 16 transpose of the 32-bit
// pairs; else pair by pair), then each row's 512 bytes copied out (writing the 32 rows, K apart, pair by pair put
// them all in one cache set: 12x slower than the strided torch copy this replaces). What a chunk of a bf16 model's
// prefill converts (bf16_weights.Bf16Weight.copy_rows).
extern "C" void tp_unblock_bf16(const uint16_t* p, int64_t K, int64_t start, int64_t stop, uint16_t* dst) {
    constexpr int64_t TK = 256;
    alignas(64) uint32_t tile[NB][TK / 2];
    for (int64_t b = start / NB; b * NB < stop; ++b) {
        const uint32_t* pb = (const uint32_t*)(p + b * kpad<uint16_t>(K) * NB);    // pair i of row j: pb[i * NB + j]
        const int64_t j0 = start > b * NB ? start - b * NB : 0;
        const int64_t j1 = stop < (b + 1) * NB ? stop - b * NB : NB;
        for (int64_t k0 = 0; k0 < K; k0 += TK) {
            const int64_t kn = K - k0 < TK ? K - k0 : TK, i0 = k0 / 2, in = (kn + 1) / 2;
            int64_t ii = 0;
#ifdef __AVX512F__
            for (; ii + 16 <= in; ii += 16)
                for (int h = 0; h < 2; ++h) {
                    __m512i r[16], c[16];
                    for (int q = 0; q < 16; ++q)
                        r[q] = _mm512_loadu_si512((const void*)(pb + (i0 + ii + q) * NB + 16 * h));
                    transpose16(r, c);
                    for (int j = 0; j < 16; ++j) _mm512_store_si512((void*)(tile[16 * h + j] + ii), c[j]);
                }
#endif
            for (; ii < in; ++ii)
                for (int j = 0; j < NB; ++j) tile[j][ii] = pb[(i0 + ii) * NB + j];
            for (int64_t j = j0; j < j1; ++j)
                memcpy(dst + (b * NB + j - start) * K + k0, tile[j], (size_t)kn * sizeof(uint16_t));
        }
    }
}
