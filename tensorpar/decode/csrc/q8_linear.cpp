// int8 x int8 GEMV/GEMM with blockwise scales (tensorpar.decode.int8; the scheme of llama.cpp's Q8_0 x Q8_0,
// ggml_vec_dot_q8_0_q8_0): y[m, n] = bias[n] + sum_b xs[m, b] * ws[n, b] * sum_{k in block b} xq[m, k] * wq[n, k]
// with blocks of 32 along K. Weights: wq int8 [N, K] row-major, ws fp16 [N, K/32]. Activations: fp32 [M, K],
// quantized here per row and block: d = max|x| / 127, xq = round_half_even(x * (1/d)) (0 where d == 0), as the
// plain-PyTorch reference (tensorpar.decode.int8.quantize_blocks) computes it, bit for bit.
//
// One source, two targets (tensorpar/decode/q8_kernel.py picks one from /proc/cpuinfo and builds it):
// * AVX512-VNNI (-mavx512f -mavx512bw -mavx512vl -mavx512vnni -mf16c): the int8 dot products on vpdpbusd
//   (unsigned x signed): |xq| as the unsigned operand and wq with xq's sign moved onto it (a masked 0 - w), each
//   64-byte load covering two blocks;
// * AVX2 (-mavx2 -mfma -mf16c): the same products on vpsignb (xq's sign onto wq), vpmaddubsw (|xq| x signed, pairs
//   summed in int16: |sum| <= 2 * 127 * 127 < 2^15, never saturating as the weights are in [-127, 127]) and
//   vpmaddwd by 1 (pairs of pairs in int32): one 32-byte load per block, as ggml's AVX2 Q8_0 dot product.
// Both produce per block the same eight int32 lane sums (lane i: the block's products 4i .. 4i + 3, exact
// integers), and sum them in the same fp32 order: each lane sum times the block's fp32 scale xs * ws, fused
// multiply-added into 16 fp32 lanes (lanes 0-7: the even blocks, lanes 8-15: the odd blocks; the AVX2 target keeps
// them in two 256-bit accumulators), block after block; the 16 lanes reduced in one fixed tree (hsum16); an odd last
// block summed in int32 and added in fp32; then the bias. So the two targets give bitwise the same y.
// Plus -ffp-contract=off -fopenmp -shared. Plain C ABI (ctypes): no torch headers.
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#include <math.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && \
    defined(__F16C__)
#define TP_Q8_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TP_Q8_AVX512 0
#else
#error "q8_linear.cpp: build with -mavx512f -mavx512bw -mavx512vl -mavx512vnni -mf16c, or -mavx2 -mfma -mf16c"
#endif

#define QK 32

extern "C" int tp_q8_abi(void) { return 1; }

// the target this library was built for
extern "C" const char* tp_q8_target(void) { return TP_Q8_AVX512 ? "avx512vnni" : "avx2"; }

// the fp32 sum of 16 lanes, lo = lanes 0-7, hi = lanes 8-15, in one fixed order (that of GCC's
// _mm512_reduce_add_ps): t = hi + lo (8 lanes), u = t[4:8] + t[0:4], then (u0 + u2) + (u1 + u3)
static inline float hsum16(__m256 lo, __m256 hi) {
    const __m256 t = _mm256_add_ps(hi, lo);
    const __m128 u = _mm_add_ps(_mm256_extractf128_ps(t, 1), _mm256_castps256_ps128(t));
    const __m128 v = _mm_add_ps(u, _mm_shuffle_ps(u, u, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(_mm_add_ss(v, _mm_shuffle_ps(v, v, _MM_SHUFFLE(3, 2, 0, 1))));
}

// the int32 sum of 8 lanes (exact)
static inline int32_t hsum8_epi32(__m256i v) {
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
    return _mm_cvtsi128_si32(t);
}

// The target's primitives over one activation row, quantized into xa (|xq|, uint8, K bytes), sg (xq's signs: per
// target, sign_bytes(K) bytes) and xs (K/32 fp32 scales):
//   sign_bytes(K), quantize_row(x, K, xa, sg, xs), row_dot(xa, sg, xs, K, w, s, pf) = the row's sum without bias
//   for one weight row w [K] with scales s [K/32], prefetching the next weight row (w + K) if pf.
#if TP_Q8_AVX512

// per 64 values one mask of negative lanes (and a 32-bit one for an odd last block)
static inline int64_t sign_bytes(int64_t K) { return (K / QK / 2 + 1) * 8; }

static void quantize_row(const float* x, int64_t K, uint8_t* xa, uint8_t* sg, float* xs) {
    const int64_t nb = K / QK;
    uint32_t* n32 = (uint32_t*)sg;
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
        n32[b] = (uint32_t)m;
    }
}

// pairs [p0, p0 + cnt) (cnt <= 8) of R weight rows (w[r], scales s[r]) into acc[r]: the 2 cnt block scales of each
// row are loaded at once (fp16 -> fp32) and multiplied by x's, then spread per pair with one permute; x's bytes and
// signs loaded once for the R rows. Each row's sum is the same ops in the same order whatever R.
template <int R>
static inline void row_pairs(const uint8_t* xa, const uint64_t* neg, const float* xs, int64_t K,
                             const int8_t* const* w, const uint16_t* const* s, int64_t p0, int cnt, int pf,
                             __m512* acc) {
    const __m512i zero = _mm512_setzero_si512();
    const __mmask16 bm = (__mmask16)((1u << (2 * cnt)) - 1);
    const __m512 xsv = _mm512_maskz_loadu_ps(bm, xs + 2 * p0);
    __m512 d[R];
    for (int r = 0; r < R; ++r) d[r] = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(bm, s[r] + 2 * p0)), xsv);
    for (int j = 0; j < cnt; ++j) {
        const int64_t p = p0 + j;
        const __m512i xv = _mm512_loadu_si512(xa + p * 64);
        const __mmask64 m = neg[p];
        // lanes 0-7: block 2j, lanes 8-15: block 2j + 1
        const __m512i idx = _mm512_set_epi32(2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1,
                                             2 * j + 1, 2 * j + 1, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j,
                                             2 * j);
        for (int r = 0; r < R; ++r) {
            __m512i wv = _mm512_loadu_si512(w[r] + p * 64);
            if (pf) _mm_prefetch((const char*)(w[r] + K + p * 64), _MM_HINT_T0);
            wv = _mm512_mask_sub_epi8(wv, m, zero, wv);
            const __m512i dot = _mm512_dpbusd_epi32(zero, xv, wv);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(idx, d[r]), acc[r]);
        }
    }
}

// out[r] = the sum without bias of weight row w[r] (scales s[r]) for r < R, prefetching each row's next row if pf
template <int R>
static inline void row_dot(const uint8_t* xa, const uint8_t* sg, const float* xs, int64_t K,
                           const int8_t* const* w, const uint16_t* const* s, int pf, float* out) {
    const int64_t nb = K / QK, np = nb / 2;
    const uint64_t* neg = (const uint64_t*)sg;
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    int64_t p0 = 0;
    for (; p0 + 8 <= np; p0 += 8) row_pairs<R>(xa, neg, xs, K, w, s, p0, 8, pf, acc);
    if (p0 < np) row_pairs<R>(xa, neg, xs, K, w, s, p0, (int)(np - p0), pf, acc);
    for (int r = 0; r < R; ++r) {
        float v = hsum16(_mm512_castps512_ps256(acc[r]),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r]), 1)));
        if (nb & 1) {           // the last, odd block of 32 with 256-bit vectors
            const int64_t b = nb - 1;
            const __m256i xv = _mm256_loadu_si256((const __m256i*)(xa + b * QK));
            const __mmask32 m = ((const uint32_t*)sg)[b];
            __m256i wv = _mm256_loadu_si256((const __m256i*)(w[r] + b * QK));
            wv = _mm256_mask_sub_epi8(wv, m, _mm256_setzero_si256(), wv);
            const int32_t dot = hsum8_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), xv, wv));
            v += (float)dot * (_cvtsh_ss(s[r][b]) * xs[b]);
        }
        out[r] = v;
    }
}

#define TILE_R 1
#define TILE_M 1

// the AVX2 target's tile interface, one weight row and one activation row
template <int R, int MR>
static inline void tile(const uint8_t* const* xa, const uint8_t* const* sg, const float* const* xs, int64_t K,
                        const int8_t* w0, const uint16_t* s0, int pf, float* out) {
    static_assert(R == 1 && MR == 1, "the AVX512-VNNI target's tiles are one row; gemv_one groups rows");
    row_dot<1>(xa[0], sg[0], xs[0], K, &w0, &s0, pf, out);
}

// y [N] for one activation row, one thread: weight rows n, n + h, n + 2h, n + 3h (h = ceil(N / 4)) together, four
// sequential streams from the four quarters of the matrix that share x's loads. On the Xeon of 2026-12-03
// (bench/results/q8-streams-xeon.md: bench/q8_probe.cpp, 1 thread, 1.1B and SmolLM2 shapes, 3 rounds) 14.2-18.0 GB/s
// from memory against 9.1-12.2 one row at a time, 27.9-42.7 in L2 against 22.5-36.6 (two and eight streams were
// tried in unrecorded probes and were not faster). Each y[n] is summed exactly as alone (row_dot's per-row order),
// so the output does not depend on the grouping.
static constexpr int STREAMS = 4;

static void gemv_one(const uint8_t* xa, const uint8_t* sg, const float* xs, int64_t K, const int8_t* wq,
                     const uint16_t* ws, const float* bias, float* y, int64_t N) {
    const int64_t nb = K / QK, h = (N + STREAMS - 1) / STREAMS;
    for (int64_t n = 0; n < h; ++n) {
        if (n + (STREAMS - 1) * h < N) {
            float out[STREAMS];
            const int8_t* w[STREAMS];
            const uint16_t* s[STREAMS];
            for (int r = 0; r < STREAMS; ++r) w[r] = wq + (n + r * h) * K, s[r] = ws + (n + r * h) * nb;
            row_dot<STREAMS>(xa, sg, xs, K, w, s, 1, out);
            for (int r = 0; r < STREAMS; ++r) y[n + r * h] = out[r] + (bias ? bias[n + r * h] : 0.0f);
            continue;
        }
        for (int r = 0; r < STREAMS && n + r * h < N; ++r) {        // the last rows of a quarter: one at a time
            const int64_t q = n + r * h;
            const int8_t* w = wq + q * K;
            const uint16_t* s = ws + q * nb;
            float out;
            row_dot<1>(xa, sg, xs, K, &w, &s, 0, &out);
            y[q] = out + (bias ? bias[q] : 0.0f);
        }
    }
}

#else  // AVX2 + FMA + F16C

// xq itself (int8, K bytes): vpsignb takes the sign from it
static inline int64_t sign_bytes(int64_t K) { return K; }

static void quantize_row(const float* x, int64_t K, uint8_t* xa, uint8_t* sg, float* xs) {
    const int64_t nb = K / QK;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t b = 0; b < nb; ++b) {
        const float* xb = x + b * QK;
        __m256 v0 = _mm256_loadu_ps(xb), v1 = _mm256_loadu_ps(xb + 8), v2 = _mm256_loadu_ps(xb + 16),
               v3 = _mm256_loadu_ps(xb + 24);
        __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                                 _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
        float amax = _mm_cvtss_f32(m);
        float d = amax / 127.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        xs[b] = d;
        __m256 vid = _mm256_set1_ps(id);
        // round half to even (the default MXCSR mode), as torch.round; int32 -> int16 -> int8 with saturation
        __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, vid)), q1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, vid)),
                q2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, vid)), q3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, vid));
        // packs work per 128-bit half: dwords come out as q0[0:4] q1[0:4] q2[0:4] q3[0:4] | q0[4:8] ... q3[4:8]
        __m256i q = _mm256_packs_epi16(_mm256_packs_epi32(q0, q1), _mm256_packs_epi32(q2, q3));
        q = _mm256_permutevar8x32_epi32(q, order);
        _mm256_storeu_si256((__m256i*)(sg + b * QK), q);
        _mm256_storeu_si256((__m256i*)(xa + b * QK), _mm256_abs_epi8(q));
    }
}

// the eight int32 lane sums of one block: lane i = sum_{k < 4} |xq[4i + k]| * (sign(xq) w)[4i + k]
static inline __m256i block_dot(const uint8_t* xa, const uint8_t* sg, __m256i w) {
    const __m256i sw = _mm256_sign_epi8(w, _mm256_loadu_si256((const __m256i*)sg));
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_loadu_si256((const __m256i*)xa), sw), _mm256_set1_epi16(1));
}

// Tiles (bench/q8_probe.cpp -DTILE_R= -DTILE_M=, Zen 3, 1 thread, weights from memory, thread CPU time, load ~13):
// 2 activation rows per weight load: 2 rows of 2048 x 2048 in 371-383 us against 456-459 one row at a time, 576 x 576
// 36-37 against 38-40; 2 weight rows per tile (2 streams): 25-40% slower at 1 to 4 rows (as on AVX512)
#ifndef TILE_R
#define TILE_R 1
#endif
#ifndef TILE_M
#define TILE_M 2
#endif

// R weight rows (w0 + r K, scales s0 + r nb) x MR activation rows (xa[m], sg[m], xs[m]) -> out[m R + r]: each weight
// block loaded once for the MR rows; 2 R MR independent accumulators (each output summed exactly as alone)
template <int R, int MR>
static inline void tile(const uint8_t* const* xa, const uint8_t* const* sg, const float* const* xs, int64_t K,
                        const int8_t* w0, const uint16_t* s0, int pf, float* out) {
    const int64_t nb = K / QK, np = nb / 2;
    __m256 acc[MR][R][2];                                  // [.][.][0]: even blocks, [1]: odd blocks
    for (int m = 0; m < MR; ++m)
        for (int r = 0; r < R; ++r) acc[m][r][0] = acc[m][r][1] = _mm256_setzero_ps();
    float d[MR][R][16];
    for (int64_t p0 = 0; p0 < np; p0 += 8) {
        const int cnt = np - p0 < 8 ? (int)(np - p0) : 8;
        const int64_t b0 = 2 * p0;
        // the blocks' fp32 scales xs * ws, 16 at a time (fewer at the end: no read past the row's scales)
        for (int m = 0; m < MR; ++m)
            for (int r = 0; r < R; ++r) {
                const uint16_t* sr = s0 + r * nb + b0;
                if (cnt == 8) {
                    _mm256_storeu_ps(d[m][r], _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)sr)),
                                                            _mm256_loadu_ps(xs[m] + b0)));
                    _mm256_storeu_ps(d[m][r] + 8,
                                     _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(sr + 8))),
                                                   _mm256_loadu_ps(xs[m] + b0 + 8)));
                } else {
                    for (int i = 0; i < 2 * cnt; ++i) d[m][r][i] = _cvtsh_ss(sr[i]) * xs[m][b0 + i];
                }
            }
        for (int j = 0; j < cnt; ++j) {
            const int64_t b = 2 * (p0 + j);
            for (int r = 0; r < R; ++r) {
                const int8_t* wr = w0 + r * K + b * QK;
                if (pf) _mm_prefetch((const char*)(wr + R * K), _MM_HINT_T0);
                const __m256i we = _mm256_loadu_si256((const __m256i*)wr);
                const __m256i wo = _mm256_loadu_si256((const __m256i*)(wr + QK));
                for (int m = 0; m < MR; ++m) {
                    const __m256i e = block_dot(xa[m] + b * QK, sg[m] + b * QK, we);
                    const __m256i o = block_dot(xa[m] + (b + 1) * QK, sg[m] + (b + 1) * QK, wo);
                    acc[m][r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(e), _mm256_broadcast_ss(&d[m][r][2 * j]),
                                                   acc[m][r][0]);
                    acc[m][r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(o), _mm256_broadcast_ss(&d[m][r][2 * j + 1]),
                                                   acc[m][r][1]);
                }
            }
        }
    }
    for (int m = 0; m < MR; ++m)
        for (int r = 0; r < R; ++r) {
            float v = hsum16(acc[m][r][0], acc[m][r][1]);
            if (nb & 1) {           // the last, odd block
                const int64_t b = nb - 1;
                const __m256i w = _mm256_loadu_si256((const __m256i*)(w0 + r * K + b * QK));
                const int32_t dot = hsum8_epi32(block_dot(xa[m] + b * QK, sg[m] + b * QK, w));
                v += (float)dot * (_cvtsh_ss(s0[r * nb + b]) * xs[m][b]);
            }
            out[m * R + r] = v;
        }
}

#endif

// y[m, n] for all M activation rows and weight rows n in [n0, n1): per TILE_M activation rows, the weight rows one
// tile of TILE_R after the other, so the weights are read as one sequential stream (q row-major), prefetching one
// tile ahead. Measured (bench/results/decode_int8.md, AVX512 on the Zen 4): tiles of 4 or 8 adjacent weight rows
// read together (4 or 8 streams, x loaded once per tile) streamed 25-40% slower from memory; on the Xeon, four rows
// a quarter of the matrix apart stream faster (gemv_one, the AVX512 target's one-row, one-thread case). Each output
// is summed the same way whatever the tile (its own accumulators), so y does not depend on TILE_R, TILE_M, N's
// chunks, the grouping of gemv_one or the thread count.
template <int R, int MR>
static inline void tile_out(const uint8_t* const* xa, const uint8_t* const* sg, const float* const* xs, int64_t K,
                            const int8_t* wq, const uint16_t* ws, const float* bias, float* y, int64_t N, int64_t n,
                            int pf) {
    float out[MR * R];
    tile<R, MR>(xa, sg, xs, K, wq + n * K, ws + n * (K / QK), pf, out);
    for (int m = 0; m < MR; ++m)
        for (int r = 0; r < R; ++r) y[m * N + n + r] = out[m * R + r] + (bias ? bias[n + r] : 0.0f);
}

template <int MR>
static void gemv_rows(const uint8_t* const* xa, const uint8_t* const* sg, const float* const* xs, int64_t K,
                      const int8_t* wq, const uint16_t* ws, const float* bias, float* y, int64_t N, int64_t n0,
                      int64_t n1) {
    int64_t n = n0;
    for (; n + TILE_R <= n1; n += TILE_R)
        tile_out<TILE_R, MR>(xa, sg, xs, K, wq, ws, bias, y, N, n, n + TILE_R < n1 ? 1 : 0);
    for (; n < n1; ++n) tile_out<1, MR>(xa, sg, xs, K, wq, ws, bias, y, N, n, n + 1 < n1 ? 1 : 0);
}

static void gemv_all(const uint8_t* xa, const uint8_t* sg, const float* xs, int64_t M, int64_t K, const int8_t* wq,
                     const uint16_t* ws, const float* bias, float* y, int64_t N, int64_t n0, int64_t n1) {
    const int64_t nb = K / QK, sb = sign_bytes(K);
    int64_t m = 0;
    const uint8_t* pa[TILE_M];
    const uint8_t* ps[TILE_M];
    const float* px[TILE_M];
    for (; m + TILE_M <= M; m += TILE_M) {
        for (int i = 0; i < TILE_M; ++i) pa[i] = xa + (m + i) * K, ps[i] = sg + (m + i) * sb, px[i] = xs + (m + i) * nb;
        gemv_rows<TILE_M>(pa, ps, px, K, wq, ws, bias, y + m * N, N, n0, n1);
    }
    for (; m < M; ++m) {
        pa[0] = xa + m * K, ps[0] = sg + m * sb, px[0] = xs + m * nb;
        gemv_rows<1>(pa, ps, px, K, wq, ws, bias, y + m * N, N, n0, n1);
    }
}

// the scratch of M activation rows of K: |xq| (M K bytes), the signs (M sign_bytes(K)) and the scales (M K/32
// floats), each part starting on a 64-byte boundary
static inline int64_t up64(int64_t n) { return (n + 63) / 64 * 64; }

extern "C" int64_t tp_q8_scratch_bytes(int64_t M, int64_t K) {
    return up64(M * K) + up64(M * sign_bytes(K)) + up64(M * (K / QK) * 4);
}

// y [M, N] = blockwise-int8(x [M, K]) @ (wq * ws)^T + bias; K % 32 == 0; threads > 1: OpenMP over chunks of 16
// output rows; scratch: tp_q8_scratch_bytes(M, K) bytes (x's quantized rows). M > 1: per chunk of 16 weight rows
// all M activation rows (the chunk read from memory once, then from cache)
extern "C" void tp_q8_linear_into(const float* x, int64_t M, int64_t K, const int8_t* wq, const uint16_t* ws,
                                  int64_t N, const float* bias, float* y, int threads, void* scratch) {
    const int64_t nb = K / QK, sb = sign_bytes(K);
    uint8_t* xa = (uint8_t*)scratch;
    uint8_t* sg = xa + up64(M * K);
    float* xs = (float*)(sg + up64(M * sb));
    for (int64_t m = 0; m < M; ++m) quantize_row(x + m * K, K, xa + m * K, sg + m * sb, xs + m * nb);
    if (M == 1 && threads <= 1) {
#if TP_Q8_AVX512
        gemv_one(xa, sg, xs, K, wq, ws, bias, y, N);
#else
        gemv_all(xa, sg, xs, M, K, wq, ws, bias, y, N, 0, N);
#endif
        return;
    }
    const int64_t chunk = 16, nchunks = (N + chunk - 1) / chunk;
#pragma omp parallel for num_threads(threads > 1 ? threads : 1) schedule(static) if (threads > 1)
    for (int64_t c = 0; c < nchunks; ++c) {
        const int64_t n0 = c * chunk, n1 = n0 + chunk < N ? n0 + chunk : N;
        gemv_all(xa, sg, xs, M, K, wq, ws, bias, y, N, n0, n1);
    }
}

// tp_q8_linear_into with its scratch allocated for the call
extern "C" void tp_q8_linear(const float* x, int64_t M, int64_t K, const int8_t* wq, const uint16_t* ws,
                             int64_t N, const float* bias, float* y, int threads) {
    void* scratch = aligned_alloc(64, (size_t)tp_q8_scratch_bytes(M, K));
    tp_q8_linear_into(x, M, K, wq, ws, N, bias, y, threads, scratch);
    free(scratch);
}
