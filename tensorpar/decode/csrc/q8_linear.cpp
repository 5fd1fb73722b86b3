// int8 x int8 GEMV/GEMM with blockwise scales (tensorpar.decode.int8; the scheme of llama.cpp's Q8_0 x Q8_0,
// ggml_vec_dot_q8_0_q8_0): y[m, n] = bias[n] + sum_b xs[m, b] * ws[n, b] * sum_{k in block b} xq[m, k] * wq[n, k]
// with blocks of 32 along K. Weights: wq int8 [N, K] row-major, ws fp16 [N, K/32]. Activations: fp32 [M, K],
// quantized here per row and block: d = max|x| / 127, xq = round_half_even(x * (1/d)) (0 where d == 0), as the
// plain-PyTorch reference (tensorpar.decode.int8.quantize_blocks) computes it, bit for bit.
// The int8 dot products run on AVX512-VNNI (vpdpbusd, unsigned x signed): |xq| as the unsigned operand and wq
// with xq's sign moved onto it (a masked 0 - w), so each 64-byte load covers two blocks; the int32 lane sums
// are scaled per lane by xs * ws and accumulated in fp32, reduced once per output.
// Built by tensorpar/decode/q8_kernel.py with -O3 -mavx512f -mavx512bw -mavx512vl -mavx512vnni -mf16c and
// -fopenmp; called only where the CPU has those features. Plain C ABI (ctypes): no torch headers.
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#include <math.h>

#define QK 32

extern "C" int tp_q8_abi(void) { return 1; }

// quantize x [K] (K % 32 == 0) into xa (|xq|, uint8, K), neg (per 64 values one mask of negative lanes, and a
// 32-bit one for an odd last block), xs (K/32 scales)
static void quantize_row(const float* x, int64_t K, uint8_t* xa, uint64_t* neg, float* xs) {
    const int64_t nb = K / QK;
    for (int64_t b = 0; b < nb; ++b) {
        __m512 v0 = _mm512_loadu_ps(x + b * QK), v1 = _mm512_loadu_ps(x + b * QK + 16);
        __m512 a = _mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1));
        float amax = _mm512_reduce_max_ps(a);
        float d = amax / 127.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        xs[b] = d;
        __m512 vid = _mm512_set1_ps(id);
        // round half to even (the default MXCSR mode), as torch.round
        __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, vid));
        __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, vid));
        __m128i p0 = _mm512_cvtsepi32_epi8(q0), p1 = _mm512_cvtsepi32_epi8(q1);
        __m256i q = _mm256_set_m128i(p1, p0);
        __mmask32 m = _mm256_movepi8_mask(q);
        _mm256_storeu_si256((__m256i*)(xa + b * QK), _mm256_abs_epi8(q));
        uint32_t* n32 = (uint32_t*)neg;
        n32[b] = (uint32_t)m;
    }
}

// the fp32 sum of one row tile's pairs [p0, p0 + cnt) (cnt <= 8), R rows: per row the 2 cnt block scales are
// loaded at once (fp16 -> fp32) and multiplied by x's, then spread per pair with one permute
template <int R>
static inline void tile_pairs(const uint8_t* xa, const uint64_t* neg, const float* xs, int64_t K, int64_t nb,
                              const int8_t* w0, const uint16_t* s0, int64_t p0, int cnt, int64_t pf, __m512* acc) {
    const __m512i zero = _mm512_setzero_si512();
    const __mmask16 bm = (__mmask16)((1u << (2 * cnt)) - 1);
    const __m512 sx = _mm512_maskz_loadu_ps(bm, xs + 2 * p0);
    __m512 d[R];
    for (int r = 0; r < R; ++r)
        d[r] = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(bm, s0 + r * nb + 2 * p0)), sx);
    for (int j = 0; j < cnt; ++j) {
        const int64_t p = p0 + j;
        const __m512i xv = _mm512_loadu_si512(xa + p * 64);
        const __mmask64 m = neg[p];
        // lanes 0-7: block 2j, lanes 8-15: block 2j + 1
        const __m512i idx = _mm512_set_epi32(2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1,
                                             2 * j + 1, 2 * j + 1, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j,
                                             2 * j);
        for (int r = 0; r < R; ++r) {
            __m512i w = _mm512_loadu_si512(w0 + r * K + p * 64);
            if (pf) _mm_prefetch((const char*)(w0 + (r + pf) * K + p * 64), _MM_HINT_T0);
            w = _mm512_mask_sub_epi8(w, m, zero, w);
            const __m512i dot = _mm512_dpbusd_epi32(zero, xv, w);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(idx, d[r]), acc[r]);
        }
    }
}

// rows [n, n + R) (R > 1: the rows read together, x loaded once for all): y = bias + sum over blocks (the last, odd block of 32 with 256-bit vectors)
template <int R>
static inline void tile(const uint8_t* xa, const uint64_t* neg, const float* xs, int64_t K, const int8_t* wq,
                        const uint16_t* ws, const float* bias, float* y, int64_t n, int64_t pf) {
    const int64_t nb = K / QK, np = nb / 2;
    const int8_t* w0 = wq + n * K;
    const uint16_t* s0 = ws + n * nb;
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    int64_t p0 = 0;
    for (; p0 + 8 <= np; p0 += 8) tile_pairs<R>(xa, neg, xs, K, nb, w0, s0, p0, 8, pf, acc);
    if (p0 < np) tile_pairs<R>(xa, neg, xs, K, nb, w0, s0, p0, (int)(np - p0), pf, acc);
    for (int r = 0; r < R; ++r) {
        float v = _mm512_reduce_add_ps(acc[r]);
        if (nb & 1) {
            const int64_t b = nb - 1;
            const __m256i xv = _mm256_loadu_si256((const __m256i*)(xa + b * QK));
            const __mmask32 m = ((const uint32_t*)neg)[b];
            __m256i w = _mm256_loadu_si256((const __m256i*)(w0 + r * K + b * QK));
            w = _mm256_mask_sub_epi8(w, m, _mm256_setzero_si256(), w);
            const __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), xv, w);
            __m128i t = _mm_add_epi32(_mm256_castsi256_si128(dot), _mm256_extracti128_si256(dot, 1));
            t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
            t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
            v += (float)_mm_cvtsi128_si32(t) * (_cvtsh_ss(s0[r * nb + b]) * xs[b]);
        }
        y[n + r] = v + (bias ? bias[n + r] : 0.0f);
    }
}

// y[n] for rows n in [n0, n1) of one activation row, one row after the other: the weights are read as one
// sequential stream (q row-major), prefetching one row ahead. Measured (bench/results/decode_int8.md): tiles of
// 4 or 8 rows read together (4 or 8 streams, x loaded once per tile) streamed 25-40% slower from memory.
static void gemv_rows(const uint8_t* xa, const uint64_t* neg, const float* xs, int64_t K, const int8_t* wq,
                      const uint16_t* ws, const float* bias, float* y, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) tile<1>(xa, neg, xs, K, wq, ws, bias, y, n, n + 1 < n1 ? 1 : 0);
}

// the scratch of M activation rows of K: |xq| (M K bytes), the sign masks (M (K/64 + 1) 8 bytes) and the scales (M K/32
// floats), each part starting on a 64-byte boundary
static inline int64_t up64(int64_t n) { return (n + 63) / 64 * 64; }

extern "C" int64_t tp_q8_scratch_bytes(int64_t M, int64_t K) {
    const int64_t nb = K / QK;
    return up64(M * K) + up64(M * (nb / 2 + 1) * 8) + up64(M * nb * 4);
}

// y [M, N] = blockwise-int8(x [M, K]) @ (wq * ws)^T + bias; K % 32 == 0; threads > 1: OpenMP over row chunks;
// scratch: tp_q8_scratch_bytes(M, K) bytes (x's quantized rows)
extern "C" void tp_q8_linear_into(const float* x, int64_t M, int64_t K, const int8_t* wq, const uint16_t* ws,
                                  int64_t N, const float* bias, float* y, int threads, void* scratch) {
    const int64_t nb = K / QK;
    uint8_t* xa = (uint8_t*)scratch;
    uint64_t* neg = (uint64_t*)(xa + up64(M * K));
    float* xs = (float*)((uint8_t*)neg + up64(M * (nb / 2 + 1) * 8));
    const int64_t nstride = nb / 2 + 1;
    for (int64_t m = 0; m < M; ++m) quantize_row(x + m * K, K, xa + m * K, neg + m * nstride, xs + m * nb);
    // chunks of 16 output rows: the unit of the parallel loop
    const int64_t chunk = 16, nchunks = (N + chunk - 1) / chunk;
    if (threads <= 1) {
        for (int64_t m = 0; m < M; ++m)
            gemv_rows(xa + m * K, neg + m * nstride, xs + m * nb, K, wq, ws, bias, y + m * N, 0, N);
    } else {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t c = 0; c < nchunks; ++c) {
            const int64_t n0 = c * chunk, n1 = n0 + chunk < N ? n0 + chunk : N;
            for (int64_t m = 0; m < M; ++m)
                gemv_rows(xa + m * K, neg + m * nstride, xs + m * nb, K, wq, ws, bias, y + m * N, n0, n1);
        }
    }
}

// tp_q8_linear_into with its scratch allocated for the call
extern "C" void tp_q8_linear(const float* x, int64_t M, int64_t K, const int8_t* wq, const uint16_t* ws,
                             int64_t N, const float* bias, float* y, int threads) {
    void* scratch = aligned_alloc(64, (size_t)tp_q8_scratch_bytes(M, K));
    tp_q8_linear_into(x, M, K, wq, ws, N, bias, y, threads, scratch);
    free(scratch);
}
