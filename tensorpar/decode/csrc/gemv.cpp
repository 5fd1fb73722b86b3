// fp32 / bf16 GEMV (and small GEMM) on the plain row-major weight [N, K], for the lean decode path's matmuls at a
// few rows (tensorpar.decode.gemv_kernel): y[m, n] = bias[n] + sum_k x[m, k] * w[n, k], summed in fp32.
// Layout: the weight as it is ([out, in], what F.linear takes): read one output row after the other, the whole
// matrix is one sequential stream of cache lines that the hardware prefetcher follows; per row U independent
// accumulators per input row (4 x 64 bytes of weights in flight), reduced once per output.
// bf16: weights and activations bf16, products summed in fp32 with vdpbf16ps (AVX512_BF16: pairs of bf16 products
// into one fp32 lane) or by widening the weights to fp32 (a shift / an and: even and odd halves, below) and fma
// with x in fp32 (`mode`), the output rounded to bf16 (round to nearest even) after the bias. More than 4 rows: the
// weight rows in chunks that stay in L2 while every group of 4 input rows reads them (one pass over memory).
// Built by tensorpar/decode/gemv_kernel.py with -O3 -mavx512f -mavx512bw -mavx512vl -mavx512bf16 -fopenmp; called
// only where the CPU has those features. Plain C ABI (ctypes): no torch headers.
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

extern "C" int tp_gemv_abi(void) { return 1; }

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
    const int64_t K64 = K & ~(int64_t)63, K16 = K & ~(int64_t)15;
    const __mmask16 tail = (__mmask16)((1u << (K - K16)) - 1);
    for (int64_t n = n0; n < n1; ++n) {
        const float* wr = w + n * K;
        __m512 a[R][4];
        for (int r = 0; r < R; ++r)
            for (int u = 0; u < 4; ++u) a[r][u] = _mm512_setzero_ps();
        int64_t k = 0;
        for (; k < K64; k += 64) {
            if (pf) _mm_prefetch((const char*)(wr + k + pf), _MM_HINT_T0);
            __m512 w0 = _mm512_loadu_ps(wr + k), w1 = _mm512_loadu_ps(wr + k + 16);
            __m512 w2 = _mm512_loadu_ps(wr + k + 32), w3 = _mm512_loadu_ps(wr + k + 48);
            for (int r = 0; r < R; ++r) {
                const float* xr = x + r * K + k;
                a[r][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr), a[r][0]);
                a[r][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), a[r][1]);
                a[r][2] = _mm512_fmadd_ps(w2, _mm512_loadu_ps(xr + 32), a[r][2]);
                a[r][3] = _mm512_fmadd_ps(w3, _mm512_loadu_ps(xr + 48), a[r][3]);
            }
        }
        for (; k < K16; k += 16) {
            __m512 w0 = _mm512_loadu_ps(wr + k);
            for (int r = 0; r < R; ++r) a[r][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + r * K + k), a[r][0]);
        }
        if (tail) {
            __m512 w0 = _mm512_maskz_loadu_ps(tail, wr + k);
            for (int r = 0; r < R; ++r)
                a[r][1] = _mm512_fmadd_ps(w0, _mm512_maskz_loadu_ps(tail, x + r * K + k), a[r][1]);
        }
        for (int r = 0; r < R; ++r)
            out[r * ldo + n] = _mm512_reduce_add_ps(
                _mm512_add_ps(_mm512_add_ps(a[r][0], a[r][1]), _mm512_add_ps(a[r][2], a[r][3])));
    }
}

// two weight rows at a time for R (2..4) input rows: each x vector loaded once for both rows (at 4 input rows the
// loads of x, not the weights' stream, bound f32_rows)
template <int R>
static void f32_rows2(const float* x, int64_t K, const float* w, int64_t n0, int64_t n1, float* out, int64_t ldo) {
    const int64_t K32 = K & ~(int64_t)31, K16 = K & ~(int64_t)15;
    const __mmask16 tail = (__mmask16)((1u << (K - K16)) - 1);
    int64_t n = n0;
    for (; n + 2 <= n1; n += 2) {
        const float* w0 = w + n * K;
        const float* w1 = w0 + K;
        __m512 a[R][2][2];
        for (int r = 0; r < R; ++r)
            for (int j = 0; j < 2; ++j) a[r][j][0] = a[r][j][1] = _mm512_setzero_ps();
        int64_t k = 0;
        for (; k < K32; k += 32) {
            const __m512 u0 = _mm512_loadu_ps(w0 + k), u1 = _mm512_loadu_ps(w0 + k + 16);
            const __m512 v0 = _mm512_loadu_ps(w1 + k), v1 = _mm512_loadu_ps(w1 + k + 16);
            for (int r = 0; r < R; ++r) {
                const __m512 x0 = _mm512_loadu_ps(x + r * K + k), x1 = _mm512_loadu_ps(x + r * K + k + 16);
                a[r][0][0] = _mm512_fmadd_ps(u0, x0, a[r][0][0]);
                a[r][0][1] = _mm512_fmadd_ps(u1, x1, a[r][0][1]);
                a[r][1][0] = _mm512_fmadd_ps(v0, x0, a[r][1][0]);
                a[r][1][1] = _mm512_fmadd_ps(v1, x1, a[r][1][1]);
            }
        }
        for (; k < K16; k += 16) {
            const __m512 u0 = _mm512_loadu_ps(w0 + k), v0 = _mm512_loadu_ps(w1 + k);
            for (int r = 0; r < R; ++r) {
                const __m512 x0 = _mm512_loadu_ps(x + r * K + k);
                a[r][0][0] = _mm512_fmadd_ps(u0, x0, a[r][0][0]);
                a[r][1][0] = _mm512_fmadd_ps(v0, x0, a[r][1][0]);
            }
        }
        if (tail) {
            const __m512 u0 = _mm512_maskz_loadu_ps(tail, w0 + k), v0 = _mm512_maskz_loadu_ps(tail, w1 + k);
            for (int r = 0; r < R; ++r) {
                const __m512 x0 = _mm512_maskz_loadu_ps(tail, x + r * K + k);
                a[r][0][1] = _mm512_fmadd_ps(u0, x0, a[r][0][1]);
                a[r][1][1] = _mm512_fmadd_ps(v0, x0, a[r][1][1]);
            }
        }
        for (int r = 0; r < R; ++r) {
            out[r * ldo + n] = _mm512_reduce_add_ps(_mm512_add_ps(a[r][0][0], a[r][0][1]));
            out[r * ldo + n + 1] = _mm512_reduce_add_ps(_mm512_add_ps(a[r][1][0], a[r][1][1]));
        }
    }
    if (n < n1) f32_rows<R>(x, K, w, n, n1, out, ldo, 0);
}

// ---------------------------------------------------------------------------------------------- bf16 weights
// Mode 1 reads the inputs in the order the weights split into without a shuffle: a 64-byte vector of 32 bf16
// weights is 16 fp32 lanes, each holding weight 2j in its low and 2j + 1 in its high 16 bits, so a left shift by 16
// gives the even weights as fp32 and an and with 0xffff0000 the odd ones (two one-cycle integer ops per 64 bytes,
// against two vpmovzxwd lane-crossing shuffles, a vextracti64x4 and two shifts for the widening to input order,
// which bounded the bf16 rows below fp32's rate per byte). The inputs are reordered to match once per call.
// x_eo: the first K32 (multiple of 32) inputs of R rows (fp32, row stride K) per block of 32: its 16 even inputs,
// then its 16 odd ones; [R][K32], 64-byte aligned (the caller frees it)
static float* split_even_odd(const float* xf, int R, int64_t K, int64_t K32) {
    float* xs = (float*)aligned_alloc(64, (size_t)(R * K32 * 4));
    const __m512i ie = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i io = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    for (int r = 0; r < R; ++r)
        for (int64_t k = 0; k < K32; k += 32) {
            const __m512 x0 = _mm512_loadu_ps(xf + r * K + k), x1 = _mm512_loadu_ps(xf + r * K + k + 16);
            _mm512_store_ps(xs + r * K32 + k, _mm512_permutex2var_ps(x0, ie, x1));
            _mm512_store_ps(xs + r * K32 + k + 16, _mm512_permutex2var_ps(x0, io, x1));
        }
    return xs;
}

// mode 0: vdpbf16ps on x (bf16, row stride K); mode 1: weights widened to fp32 (even / odd halves, above), x given
// in fp32 (xf, row stride K, in input order). Per output row: 4 accumulators per input row; mode 1 sums each
// block of 32 inputs as its even then its odd half (another order than the inputs', the same products, in fp32).
template <int R, int MODE>
static void bf16_rows(const uint16_t* x, const float* xf, int64_t K, const uint16_t* w, int64_t n0, int64_t n1,
                      float* out, int64_t ldo, int64_t pf) {
    const int64_t K128 = K & ~(int64_t)127, K32 = K & ~(int64_t)31;
    const __mmask32 tail = (__mmask32)((K - K32) ? ((1ull << (K - K32)) - 1) : 0);
    float* xs = MODE == 1 && K32 ? split_even_odd(xf, R, K, K32) : nullptr;
    const __m512i odd = _mm512_set1_epi32((int)0xffff0000u);
    for (int64_t n = n0; n < n1; ++n) {
        const uint16_t* wr = w + n * K;
        __m512 a[R][4];
        for (int r = 0; r < R; ++r)
            for (int u = 0; u < 4; ++u) a[r][u] = _mm512_setzero_ps();
        int64_t k = 0;
        for (; k < K128; k += 128) {
            if (pf) _mm_prefetch((const char*)(wr + k + pf), _MM_HINT_T0);
            __m512i wv[4];
            for (int u = 0; u < 4; ++u) wv[u] = _mm512_loadu_si512(wr + k + 32 * u);
            if (MODE == 0) {
                for (int r = 0; r < R; ++r) {
                    const uint16_t* xr = x + r * K + k;
                    for (int u = 0; u < 4; ++u)
                        a[r][u] = _mm512_dpbf16_ps(a[r][u], (__m512bh)_mm512_loadu_si512(xr + 32 * u),
                                                   (__m512bh)wv[u]);
                }
            } else {
                __m512 we[4], wo[4];
                for (int u = 0; u < 4; ++u) {
                    we[u] = _mm512_castsi512_ps(_mm512_slli_epi32(wv[u], 16));
                    wo[u] = _mm512_castsi512_ps(_mm512_and_si512(wv[u], odd));
                }
                for (int r = 0; r < R; ++r) {
                    const float* xr = xs + r * K32 + k;
                    for (int u = 0; u < 4; ++u) {
                        a[r][u] = _mm512_fmadd_ps(we[u], _mm512_load_ps(xr + 32 * u), a[r][u]);
                        a[r][u] = _mm512_fmadd_ps(wo[u], _mm512_load_ps(xr + 32 * u + 16), a[r][u]);
                    }
                }
            }
        }
        for (; k < K32; k += 32) {
            __m512i wv = _mm512_loadu_si512(wr + k);
            for (int r = 0; r < R; ++r) {
                if (MODE == 0) {
                    a[r][0] = _mm512_dpbf16_ps(a[r][0], (__m512bh)_mm512_loadu_si512(x + r * K + k), (__m512bh)wv);
                } else {
                    const float* xr = xs + r * K32 + k;
                    a[r][0] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(wv, 16)), _mm512_load_ps(xr),
                                              a[r][0]);
                    a[r][1] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(wv, odd)),
                                              _mm512_load_ps(xr + 16), a[r][1]);
                }
            }
        }
        if (tail) {     // widen the last < 32 weights in input order (both modes: vdpbf16ps needs pairs)
            __m512i wv = _mm512_maskz_loadu_epi16(tail, wr + k);
            __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(wv)), 16));
            __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(wv, 1)), 16));
            for (int r = 0; r < R; ++r) {
                __m512 xl, xh;
                if (MODE == 0) {
                    __m512i xv = _mm512_maskz_loadu_epi16(tail, x + r * K + k);
                    xl = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(xv)), 16));
                    xh = _mm512_castsi512_ps(_mm512_slli_epi32(
                        _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(xv, 1)), 16));
                } else {
                    const __mmask16 ml = (__mmask16)(tail & 0xffff), mh = (__mmask16)(tail >> 16);
                    xl = _mm512_maskz_loadu_ps(ml, xf + r * K + k);
                    xh = _mm512_maskz_loadu_ps(mh, xf + r * K + k + 16);
                }
                a[r][1] = _mm512_fmadd_ps(lo, xl, a[r][1]);
                a[r][2] = _mm512_fmadd_ps(hi, xh, a[r][2]);
            }
        }
        for (int r = 0; r < R; ++r)
            out[r * ldo + n] = _mm512_reduce_add_ps(
                _mm512_add_ps(_mm512_add_ps(a[r][0], a[r][1]), _mm512_add_ps(a[r][2], a[r][3])));
    }
    free(xs);
}

// two weight rows at a time for R (2..4) input rows, vdpbf16ps (as f32_rows2: each x vector loaded once for both)
template <int R>
static void bf16_rows2(const uint16_t* x, int64_t K, const uint16_t* w, int64_t n0, int64_t n1, float* out,
                       int64_t ldo) {
    const int64_t K64 = K & ~(int64_t)63;
    int64_t n = n0;
    for (; n + 2 <= n1; n += 2) {
        const uint16_t* w0 = w + n * K;
        const uint16_t* w1 = w0 + K;
        __m512 a[R][2][2];
        for (int r = 0; r < R; ++r)
            for (int j = 0; j < 2; ++j) a[r][j][0] = a[r][j][1] = _mm512_setzero_ps();
        int64_t k = 0;
        for (; k < K64; k += 64) {
            const __m512i u0 = _mm512_loadu_si512(w0 + k), u1 = _mm512_loadu_si512(w0 + k + 32);
            const __m512i v0 = _mm512_loadu_si512(w1 + k), v1 = _mm512_loadu_si512(w1 + k + 32);
            for (int r = 0; r < R; ++r) {
                const __m512i x0 = _mm512_loadu_si512(x + r * K + k), x1 = _mm512_loadu_si512(x + r * K + k + 32);
                a[r][0][0] = _mm512_dpbf16_ps(a[r][0][0], (__m512bh)x0, (__m512bh)u0);
                a[r][0][1] = _mm512_dpbf16_ps(a[r][0][1], (__m512bh)x1, (__m512bh)u1);
                a[r][1][0] = _mm512_dpbf16_ps(a[r][1][0], (__m512bh)x0, (__m512bh)v0);
                a[r][1][1] = _mm512_dpbf16_ps(a[r][1][1], (__m512bh)x1, (__m512bh)v1);
            }
        }
        if (k < K) {    // the last < 64 inputs (K % 64): scalar fp32 products
            float part[4][2];
            for (int j = 0; j < 2; ++j) {
                for (int r = 0; r < R; ++r) {
                    float s = 0.0f;
                    for (int64_t kk = k; kk < K; ++kk)
                        s += bf16_to_f32(x[r * K + kk]) * bf16_to_f32(w[(n + j) * K + kk]);
                    part[r][j] = s;
                }
            }
            for (int r = 0; r < R; ++r) {
                out[r * ldo + n] = _mm512_reduce_add_ps(_mm512_add_ps(a[r][0][0], a[r][0][1])) + part[r][0];
                out[r * ldo + n + 1] = _mm512_reduce_add_ps(_mm512_add_ps(a[r][1][0], a[r][1][1])) + part[r][1];
            }
        } else {
            for (int r = 0; r < R; ++r) {
                out[r * ldo + n] = _mm512_reduce_add_ps(_mm512_add_ps(a[r][0][0], a[r][0][1]));
                out[r * ldo + n + 1] = _mm512_reduce_add_ps(_mm512_add_ps(a[r][1][0], a[r][1][1]));
            }
        }
    }
    if (n < n1) bf16_rows<R, 0>(x, nullptr, K, w, n, n1, out, ldo, 0);
}

// ------------------------------------------------------------------------------------------------ the driver
// one thread's rows [n0, n1): chunks of rows that stay in L2 while each group of <= 4 input rows reads them
static void run_rows(int dtype, int mode, const void* x, const float* xf, int64_t M, int64_t K, const void* w,
                     int64_t n0, int64_t n1, float* acc, int64_t N, int64_t pf) {
    const int64_t esz = dtype == 0 ? 4 : 2;
    int64_t chunk = M <= 4 ? n1 - n0 : (256 * 1024) / (K * esz);
    if (chunk < 1) chunk = 1;
    for (int64_t c0 = n0; c0 < n1; c0 += chunk) {
        const int64_t c1 = c0 + chunk < n1 ? c0 + chunk : n1;
        for (int64_t m = 0; m < M; m += 4) {
            const int R = M - m < 4 ? (int)(M - m) : 4;
            float* o = acc + m * N;
            if (dtype == 0) {
                const float* xm = (const float*)x + m * K;
                const float* wf = (const float*)w;
                if (mode == 2) {
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
// null), sums in fp32, mode 0 vdpbf16ps / 1 widen-and-fma; mode 2: 2..4 input rows two weight rows at a time
// (one row: as mode 0). pf: software prefetch distance in elements (0: none).
// threads > 1: OpenMP over chunks of 64 output rows.
extern "C" void tp_gemv(int dtype, int mode, const void* x, int64_t M, int64_t K, const void* w, int64_t N,
                        const void* bias, void* y, int threads, int64_t pf) {
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
