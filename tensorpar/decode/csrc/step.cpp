// The element-wise pieces of a one-row decode step of the lean path (tensorpar/decode/row_step.py), each fused into
// one call so that a layer costs a few calls instead of dozens of framework ops (tensorpar.decode.fused):
//
// * tp_add_rms_norm: the residual add of an all-reduce's result and the next RMSNorm in one pass:
//   x += ((p0 + p1) + p2 ...) (the ranks' partial sums in rank order, as the shared-memory all-reduce adds them),
//   h = w * (x * rsqrt(sum(x^2) / H + eps)). Every add and product is rounded as torch's element-wise kernels round
//   it (built with -ffp-contract=off: no fused multiply-add), so x is bitwise what `x.add_(all_reduce(p))` gives;
//   only the sum of squares is added in another order than torch's `mean` (fp32, 16 lanes then the lanes in order).
// * tp_rope_store: the rotary embedding of the q and k heads of a fused QKV row, the families' formula
//   q * cos + rotate_half(q) * sin computed as q * cos + q[perm] * sin_sign (bitwise the lean path's torch ops), the
//   rotated q written to q_out and the rotated k and the v written straight into the KV cache at the row's position.
// * tp_run_at: a decode step's calls from one call: a program of int64 words built once per row count, per layer the
//   QKV matmul, rotary and cache write, attention, output matmul, the all-reduce's exchange, then the gate-up matmul,
//   SiLU, down matmul and the exchange; the matmuls called through the address of the kernel the step runs (our
//   GEMV, the bf16 weights' GEMV, the Q8_0 kernel, in their own libraries). The exchange (OP_EXCHANGE) runs here on
//   tensorpar's shared-memory communicator (tensorpar/shm/protocol.py's step in C: the partial sums copied into this
//   rank's slot, the step's metadata and arrival count stored, a short spin for the peers); a longer wait, a
//   metadata mismatch and every other kind of group go back to Python (tensorpar/decode/step_exchange.py).
//
// bf16 models (--dtype bfloat16): the same ops on fp32 buffers that hold bf16 values, each result rounded to bf16
// (round to nearest even, torch's c10::BFloat16 rounding) where torch's bf16 element-wise kernels round it (they
// compute each op in fp32 and round its result), and the KV cache in bf16 (the *_bf16 ops, OP_ROUND after a matmul).
//
// Plain C ABI (ctypes), no torch headers; built by tensorpar/decode/fused.py.
#include <immintrin.h>
#include <math.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

extern "C" int tp_step_abi(void) { return 2; }

// f rounded to bf16 (nearest even; NaN stays NaN), as an fp32 value
static inline float rb(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return f;
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&f, &u, sizeof f);
    return f;
}
// BF: rb, else f itself
template <bool BF> static inline float rnd(float f) {
    if constexpr (BF) return rb(f);
    else return f;
}
// a cache element: fp32, or bf16 bits (uint16_t) widened / narrowed exactly (the values written are bf16 already)
static inline float load(float v) { return v; }
static inline float load(uint16_t v) {
    const uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
static inline void store(float* p, float f) { *p = f; }
static inline void store(uint16_t* p, float f) {
    const float r = rb(f);
    uint32_t u;
    memcpy(&u, &r, sizeof u);
    *p = (uint16_t)(u >> 16);
}

// x [rows, H] += sum of parts[0..nparts) [rows, H] (rank order; nparts 0: no add); h [rows, H] (if not null) =
// w * (x * rsqrt(mean(x^2) + eps)); BF: every add and product rounded to bf16 as torch's bf16 ops round them
// (x.add_(p) in bf16, the partials added in bf16; the normalised x rounded, then times the bf16 weight, rounded)
template <bool BF>
static void add_rms_norm_t(float* x, const float* const* parts, int nparts, int64_t rows, int64_t H, const float* w,
                           float eps, float* h) {
    for (int64_t m = 0; m < rows; ++m) {
        float* xr = x + m * H;
        const int64_t o = m * H;
        if (nparts == 1) {
            const float* p0 = parts[0] + o;
            for (int64_t i = 0; i < H; ++i) xr[i] = rnd<BF>(xr[i] + rnd<BF>(p0[i]));
        } else if (nparts >= 2) {
            const float* p0 = parts[0] + o;
            const float* p1 = parts[1] + o;
            for (int64_t i = 0; i < H; ++i) {
                float s = rnd<BF>(p0[i] + p1[i]);
                for (int r = 2; r < nparts; ++r) s = rnd<BF>(s + parts[r][o + i]);
                xr[i] = rnd<BF>(xr[i] + s);
            }
        }
        if (h == nullptr) continue;
        float acc[16] = {0};
        const int64_t H16 = H & ~(int64_t)15;
        for (int64_t i = 0; i < H16; i += 16)
            for (int j = 0; j < 16; ++j) acc[j] = acc[j] + xr[i + j] * xr[i + j];
        for (int64_t i = H16; i < H; ++i) acc[i - H16] = acc[i - H16] + xr[i] * xr[i];
        float ss = 0.0f;
        for (int j = 0; j < 16; ++j) ss = ss + acc[j];
        const float r = 1.0f / sqrtf(ss / (float)H + eps);
        float* hr = h + m * H;
        for (int64_t i = 0; i < H; ++i) hr[i] = rnd<BF>(rnd<BF>(xr[i] * r) * w[i]);
    }
}

extern "C" void tp_add_rms_norm(float* x, const float* const* parts, int nparts, int64_t rows, int64_t H,
                                const float* w, float eps, float* h) {
    add_rms_norm_t<false>(x, parts, nparts, rows, H, w, eps, h);
}

// one head: y[j] = x[j] * c[j] + x[perm(j)] * s[j] for j < rd (perm swaps the halves of [0, rd)), y[j] = x[j] after;
// BF: each product and the sum rounded to bf16 (torch: mul(q, cos).add_(q[perm].mul_(sin_sign)) in bf16)
template <bool BF, typename C>
static inline void rope_head(const float* x, const float* c, const float* s, int64_t d, int64_t rd, C* y) {
    const int64_t half = rd / 2;
    for (int64_t j = 0; j < rd; ++j) {
        const int64_t pj = j < half ? j + half : j - half;
        store(y + j, rnd<BF>(rnd<BF>(x[j] * c[j]) + rnd<BF>(x[pj] * s[j])));
    }
    for (int64_t j = rd; j < d; ++j) store(y + j, x[j]);
}

// qkv [rows, (nq + 2 nkv) * d] (q heads, k heads, v heads), cos / sin_sign [rows, rd]:
// q_out [rows, nq, d] = rotated q; cache position of row m, head j: k_layer / v_layer + j * head_stride + row_off[m]
template <bool BF, typename C>
static void rope_store_t(const float* qkv, int64_t rows, int64_t nq, int64_t nkv, int64_t d, int64_t rd,
                         const float* cos, const float* sin_sign, float* q_out, C* k_layer, C* v_layer,
                         int64_t head_stride, const int64_t* row_off) {
    const int64_t width = (nq + 2 * nkv) * d;
    for (int64_t m = 0; m < rows; ++m) {
        const float* r = qkv + m * width;
        const float* c = cos + m * rd;
        const float* s = sin_sign + m * rd;
        for (int64_t j = 0; j < nq; ++j) rope_head<BF>(r + j * d, c, s, d, rd, q_out + (m * nq + j) * d);
        for (int64_t j = 0; j < nkv; ++j) {
            rope_head<BF>(r + (nq + j) * d, c, s, d, rd, k_layer + j * head_stride + row_off[m]);
            C* vo = v_layer + j * head_stride + row_off[m];
            const float* vi = r + (nq + nkv + j) * d;
            for (int64_t i = 0; i < d; ++i) store(vo + i, vi[i]);
        }
    }
}

extern "C" void tp_rope_store(const float* qkv, int64_t rows, int64_t nq, int64_t nkv, int64_t d, int64_t rd,
                              const float* cos, const float* sin_sign, float* q_out, float* k_layer, float* v_layer,
                              int64_t head_stride, const int64_t* row_off) {
    rope_store_t<false>(qkv, rows, nq, nkv, d, rd, cos, sin_sign, q_out, k_layer, v_layer, head_stride, row_off);
}

// Decode attention, one query per row, over a paged KV cache: position t of row m lives in block
// blocks[m * blocks_stride + t / bs] at offset t % bs, i.e. for query head h (its KV head kv_of[h]) the key at
// k_layer + kv_of[h] * head_stride + (block * bs + t % bs) * d (the pool [kv_local, num_blocks, bs, d] of one layer;
// a static cache is one block of bs >= L positions per row). Positions t in [0, L) where mask[m * mask_stride + t]
// is 0 are left out (mask null: all); scores q.k * scale, softmax (the maximum subtracted, expf),
// out[m, h * d : (h + 1) * d] = sum_t p_t v_t / sum_t p_t. fp32 sums in another order than torch's CPU flash
// attention (its blocking, its exp): within fp32 rounding of scaled_dot_product_attention. s: L floats of scratch.
// A bf16 cache (C uint16_t): the same sums in fp32 on the widened keys and values, each p rounded to bf16 before it
// weights the values (the sum from the unrounded ones) and the output rounded to bf16, as torch's CPU flash
// attention does for bf16 (its sums in fp32 too, in its own order and blocking: within a bf16 rounding of it).
template <typename C>
static void decode_attention_t(const float* q, int64_t rows, int64_t nq, int64_t d, const C* k_layer,
                               const C* v_layer, int64_t head_stride, const int64_t* blocks, int64_t blocks_stride,
                               int64_t bs, int64_t L, const uint8_t* mask, int64_t mask_stride, const int64_t* kv_of,
                               float scale, float* s, float* out) {
    constexpr bool BF = sizeof(C) == 2;
    const int64_t d16 = d & ~(int64_t)15;
    for (int64_t m = 0; m < rows; ++m) {
        const uint8_t* mk = mask ? mask + m * mask_stride : nullptr;
        const int64_t* tb = blocks + m * blocks_stride;
        for (int64_t h = 0; h < nq; ++h) {
            const float* qh = q + (m * nq + h) * d;
            const C* K = k_layer + kv_of[h] * head_stride;
            const C* V = v_layer + kv_of[h] * head_stride;
            float mx = -INFINITY;
            for (int64_t t0 = 0, j = 0; t0 < L; t0 += bs, ++j) {
                const C* Kb = K + tb[j] * bs * d;
                const int64_t n = L - t0 < bs ? L - t0 : bs;
                for (int64_t u = 0; u < n; ++u) {
                    const int64_t t = t0 + u;
                    if (mk && !mk[t]) {
                        s[t] = -INFINITY;
                        continue;
                    }
                    const C* kt = Kb + u * d;
                    float acc[16] = {0};
                    for (int64_t i = 0; i < d16; i += 16)
                        for (int w = 0; w < 16; ++w) acc[w] = acc[w] + qh[i + w] * load(kt[i + w]);
                    for (int64_t i = d16; i < d; ++i) acc[i - d16] = acc[i - d16] + qh[i] * load(kt[i]);
                    float dot = 0.0f;
                    for (int w = 0; w < 16; ++w) dot = dot + acc[w];
                    s[t] = dot * scale;
                    if (s[t] > mx) mx = s[t];
                }
            }
            float sum = 0.0f;
            for (int64_t t = 0; t < L; ++t) {
                const float p = s[t] == -INFINITY ? 0.0f : expf(s[t] - mx);
                s[t] = p;
                sum = sum + p;
            }
            float* o = out + (m * nq + h) * d;
            for (int64_t i = 0; i < d; ++i) o[i] = 0.0f;
            for (int64_t t0 = 0, j = 0; t0 < L; t0 += bs, ++j) {
                const C* Vb = V + tb[j] * bs * d;
                const int64_t n = L - t0 < bs ? L - t0 : bs;
                for (int64_t u = 0; u < n; ++u) {
                    const float p = rnd<BF>(s[t0 + u]);         // bf16: torch rounds P before its P.V GEMM
                    if (p == 0.0f) continue;
                    const C* vt = Vb + u * d;
                    for (int64_t i = 0; i < d; ++i) o[i] = o[i] + p * load(vt[i]);
                }
            }
            const float inv = 1.0f / sum;
            for (int64_t i = 0; i < d; ++i) o[i] = rnd<BF>(o[i] * inv);
        }
    }
}

extern "C" void tp_decode_attention(const float* q, int64_t rows, int64_t nq, int64_t d, const float* k_layer,
                                    const float* v_layer, int64_t head_stride, const int64_t* blocks,
                                    int64_t blocks_stride, int64_t bs, int64_t L, const uint8_t* mask,
                                    int64_t mask_stride, const int64_t* kv_of, float scale, float* s, float* out) {
    decode_attention_t(q, rows, nq, d, k_layer, v_layer, head_stride, blocks, blocks_stride, bs, L, mask, mask_stride,
                       kv_of, scale, s, out);
}

// The gated MLP's activation: a [rows, f] = silu(gu[:, :f]) * gu[:, f:] (gu [rows, 2 f]), silu(g) = g / (1 + expf(-g))
// as torch computes it, with expf for torch's vectorised exp (within an ulp of it). BF: silu(g) rounded to bf16, then
// the product (torch: F.silu(g, inplace=True).mul_(u) in bf16).
template <bool BF> static void silu_mul_t(const float* gu, int64_t rows, int64_t f, float* a) {
    for (int64_t m = 0; m < rows; ++m) {
        const float* g = gu + m * 2 * f;
        const float* u = g + f;
        float* am = a + m * f;
        for (int64_t j = 0; j < f; ++j) am[j] = rnd<BF>(rnd<BF>(g[j] / (1.0f + expf(-g[j]))) * u[j]);
    }
}

extern "C" void tp_silu_mul(const float* gu, int64_t rows, int64_t f, float* a) { silu_mul_t<false>(gu, rows, f, a); }

// x[0..n) rounded to bf16 in place (a matmul's fp32 sums, as torch's bf16 GEMM rounds its output)
extern "C" void tp_round_bf16(float* x, int64_t n) {
    for (int64_t i = 0; i < n; ++i) x[i] = rb(x[i]);
}

// tp_run_at's program: per op its kind, then its arguments as int64 words (addresses, sizes, a float's bits in the low
// 32 bits of its word); OP_END ends it. Values that change from step to step are read from `step`: [0] attention's
// length L, [1] its mask's address (0: none), [2] the mask's row stride, [3] the address of the C array of the
// partial sums the next NORM adds (the last all-reduce's exchange) and [4] their count, [5 + 2 k] and [6 + 2 k]
// rotary table k's cos and sin_sign rows. Words per op (kind included): GEMV 13, GEMV_BF16W 11, Q8 12, ROPE 13,
// ATTN 15, SILU 5, NORM 7 (tp_add_rms_norm's x, rows, H, w, eps bits, h), EXCHANGE 2 (its context's address); the
// bf16 model's ops as their fp32 ones (ROPE_BF16 and ATTN_BF16 on a bf16 cache), ROUND 3 (x, n).
enum : int64_t { OP_END = 0, OP_GEMV = 1, OP_GEMV_BF16W = 2, OP_Q8 = 3, OP_ROPE = 4, OP_ATTN = 5, OP_SILU = 6,
                 OP_NORM = 7, OP_EXCHANGE = 8, OP_NORM_BF16 = 9, OP_ROPE_BF16 = 10, OP_ATTN_BF16 = 11,
                 OP_SILU_BF16 = 12, OP_ROUND = 13 };
enum : int64_t { S_LENGTH = 0, S_MASK = 1, S_MASK_STRIDE = 2, S_PARTS = 3, S_NPARTS = 4, S_TABLES = 5 };

static inline float float_of(int64_t w) {
    const uint32_t bits = (uint32_t)w;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
typedef void (*gemv_fn)(int, int, const void*, int64_t, int64_t, const void*, int64_t, const void*, void*, int,
                        int64_t);
typedef void (*bf16w_fn)(const float*, int64_t, int64_t, const uint16_t*, int64_t, const float*, float*, int,
                         int64_t);
typedef void (*q8_fn)(const float*, int64_t, int64_t, const int8_t*, const uint16_t*, int64_t, const float*, float*,
                      int, void*);

static inline void* ptr(int64_t w) { return (void*)(intptr_t)w; }

// OP_EXCHANGE's context (int64 words, tensorpar/decode/step_exchange.py builds it): the mode (X_PYTHON: the caller
// exchanges; X_ONE: one rank, the parts are the partial itself; X_SHM: the shared-memory step here), the control
// words' address, this rank's line, the metadata's offset in a line (W_META), the spin and the yield phase in ns (as
// tensorpar/shm/sync.py WaitPolicy: poll, then poll with sched_yield between reads), the partial sums'
// address and bytes, the step's two metadata words, this rank's slot of each parity, the C arrays of the ranks' slots
// of each parity (what the next NORM adds) and their count; then what the run leaves: exchanges done here, ns spent
// waiting, the arrival count of an exchange whose wait went back to Python (0: none); the number of peers and their
// lines.
enum : int64_t { X_MODE = 0, X_CTL, X_ME, X_WMETA, X_SPIN, X_YIELD, X_SRC, X_BYTES, X_A, X_B, X_SLOT0, X_SLOT1, X_PARTS0,
                 X_PARTS1, X_NPARTS, X_DONE, X_WAIT_NS, X_PENDING, X_NPEERS, X_PEERS };
enum : int64_t { X_PYTHON = 0, X_ONE = 1, X_SHM = 2 };

// the context's first peer word (X_PEERS): tensorpar/decode/step_exchange.py's words must agree (a test compares them)
extern "C" int64_t tp_exchange_words(void) { return X_PEERS; }
enum : int64_t { RUN_END = 0, RUN_EXCHANGE = 1, RUN_WAIT = 2, RUN_MISMATCH = 3, RUN_BAD_OP = 4 };

static inline int64_t now_ns() {
    timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

// one exchange of the shared-memory step protocol (tensorpar/shm/protocol.py StepProtocol._arrive, the same words
// in the same order): copy, metadata, then the arrival count with a release store (sfence first: a large memcpy may
// end in non-temporal stores); poll until every peer's count reaches ours (spin, then yield), then compare their
// metadata. RUN_END: the step words name the parity's slots; RUN_WAIT: a peer is late past the spin and yield phases
// (X_PENDING holds our count; Python sleeps, checks the peers' liveness and the deadline); RUN_MISMATCH: a peer
// described another collective.
static int64_t exchange_shm(int64_t* x, int64_t* step) {
    int64_t* ctl = (int64_t*)ptr(x[X_CTL]);
    const int64_t me = x[X_ME], wm = x[X_WMETA];
    const int64_t seq = __atomic_load_n(&ctl[me], __ATOMIC_RELAXED), p = seq & 1;
    memcpy(ptr(p ? x[X_SLOT1] : x[X_SLOT0]), ptr(x[X_SRC]), (size_t)x[X_BYTES]);
    ctl[me + wm + 2 * p] = x[X_A];
    ctl[me + wm + 2 * p + 1] = x[X_B];
    _mm_sfence();
    __atomic_store_n(&ctl[me], seq + 1, __ATOMIC_RELEASE);
    const int64_t t0 = now_ns(), spin = x[X_SPIN], end = x[X_SPIN] + x[X_YIELD];
    bool yielding = false;
    for (int64_t i = 0; i < x[X_NPEERS]; ++i) {
        const int64_t line = x[X_PEERS + i];
        for (int64_t polls = 0; __atomic_load_n(&ctl[line], __ATOMIC_ACQUIRE) < seq + 1; ++polls) {
            if (yielding) sched_yield();
            else _mm_pause();
            if (yielding || (polls & 63) == 63) {
                const int64_t el = now_ns() - t0;
                yielding = el > spin;
                if (el > end) {
                    x[X_WAIT_NS] += el;
                    x[X_PENDING] = seq + 1;
                    return RUN_WAIT;
                }
            }
        }
    }
    x[X_WAIT_NS] += now_ns() - t0;
    for (int64_t i = 0; i < x[X_NPEERS]; ++i) {
        const int64_t line = x[X_PEERS + i];
        if (ctl[line + wm + 2 * p] != x[X_A] || ctl[line + wm + 2 * p + 1] != x[X_B]) {
            x[X_PENDING] = seq + 1;
            return RUN_MISMATCH;
        }
    }
    step[S_PARTS] = p ? x[X_PARTS1] : x[X_PARTS0];
    step[S_NPARTS] = x[X_NPARTS];
    x[X_DONE] += 1;
    return RUN_END;
}

// Run program a from word *at until its end (RUN_END) or an exchange Python must finish (RUN_EXCHANGE: the exchange
// is the caller's; RUN_WAIT, RUN_MISMATCH: see exchange_shm); *at is then the word offset of the op after the
// exchange (the caller resumes there once it has set the step's parts). RUN_BAD_OP: an unknown kind at *at.
extern "C" int64_t tp_run_at(const int64_t* prog, int64_t* step, int64_t* at) {
    const int64_t* a = prog + *at;
    for (;;) {
        switch (a[0]) {
        case OP_END:
            *at = a - prog;
            return RUN_END;
        case OP_GEMV:           // fn, dtype, mode, x, M, K, w, N, bias, y, threads, prefetch
            ((gemv_fn)ptr(a[1]))((int)a[2], (int)a[3], ptr(a[4]), a[5], a[6], ptr(a[7]), a[8], ptr(a[9]), ptr(a[10]),
                                 (int)a[11], a[12]);
            a += 13;
            break;
        case OP_GEMV_BF16W:     // fn, x, M, K, w, N, bias, y, threads, prefetch
            ((bf16w_fn)ptr(a[1]))((const float*)ptr(a[2]), a[3], a[4], (const uint16_t*)ptr(a[5]), a[6],
                                  (const float*)ptr(a[7]), (float*)ptr(a[8]), (int)a[9], a[10]);
            a += 11;
            break;
        case OP_Q8:             // fn, x, M, K, wq, ws, N, bias, y, threads, scratch
            ((q8_fn)ptr(a[1]))((const float*)ptr(a[2]), a[3], a[4], (const int8_t*)ptr(a[5]),
                               (const uint16_t*)ptr(a[6]), a[7], (const float*)ptr(a[8]), (float*)ptr(a[9]), (int)a[10],
                               ptr(a[11]));
            a += 12;
            break;
        case OP_ROPE:           // qkv, rows, nq, nkv, d, rd, table k, q_out, k_layer, v_layer, head_stride, row_off
            tp_rope_store((const float*)ptr(a[1]), a[2], a[3], a[4], a[5], a[6],
                          (const float*)ptr(step[S_TABLES + 2 * a[7]]), (const float*)ptr(step[S_TABLES + 1 + 2 * a[7]]),
                          (float*)ptr(a[8]), (float*)ptr(a[9]),
                          (float*)ptr(a[10]), a[11], (const int64_t*)ptr(a[12]));
            a += 13;
            break;
        case OP_ROPE_BF16:      // as OP_ROPE, the cache bf16
            rope_store_t<true>((const float*)ptr(a[1]), a[2], a[3], a[4], a[5], a[6],
                               (const float*)ptr(step[S_TABLES + 2 * a[7]]),
                               (const float*)ptr(step[S_TABLES + 1 + 2 * a[7]]), (float*)ptr(a[8]),
                               (uint16_t*)ptr(a[9]), (uint16_t*)ptr(a[10]), a[11], (const int64_t*)ptr(a[12]));
            a += 13;
            break;
        case OP_ATTN_BF16:      // as OP_ATTN, the cache bf16
            decode_attention_t((const float*)ptr(a[1]), a[2], a[3], a[4], (const uint16_t*)ptr(a[5]),
                               (const uint16_t*)ptr(a[6]), a[7], (const int64_t*)ptr(a[8]), a[9], a[10],
                               step[S_LENGTH], (const uint8_t*)ptr(step[S_MASK]), step[S_MASK_STRIDE],
                               (const int64_t*)ptr(a[11]), float_of(a[12]), (float*)ptr(a[13]), (float*)ptr(a[14]));
            a += 15;
            break;
        case OP_NORM_BF16:      // as OP_NORM
            add_rms_norm_t<true>((float*)ptr(a[1]), (const float* const*)ptr(step[S_PARTS]), (int)step[S_NPARTS], a[2],
                                 a[3], (const float*)ptr(a[4]), float_of(a[5]), (float*)ptr(a[6]));
            a += 7;
            break;
        case OP_SILU_BF16:      // as OP_SILU
            silu_mul_t<true>((const float*)ptr(a[1]), a[2], a[3], (float*)ptr(a[4]));
            a += 5;
            break;
        case OP_ROUND:          // x, n
            tp_round_bf16((float*)ptr(a[1]), a[2]);
            a += 3;
            break;
        case OP_ATTN:           // q, rows, nq, d, k_layer, v_layer, head_stride, blocks (each row's table),
                                // blocks_stride, block size, kv_of, scale bits, s, out
            tp_decode_attention((const float*)ptr(a[1]), a[2], a[3], a[4], (const float*)ptr(a[5]),
                                (const float*)ptr(a[6]), a[7], (const int64_t*)ptr(a[8]), a[9], a[10], step[S_LENGTH],
                                (const uint8_t*)ptr(step[S_MASK]), step[S_MASK_STRIDE], (const int64_t*)ptr(a[11]),
                                float_of(a[12]), (float*)ptr(a[13]), (float*)ptr(a[14]));
            a += 15;
            break;
        case OP_NORM:           // x, rows, H, w, eps bits, h; the partial sums from the step words
            tp_add_rms_norm((float*)ptr(a[1]), (const float* const*)ptr(step[S_PARTS]), (int)step[S_NPARTS], a[2], a[3],
                            (const float*)ptr(a[4]), float_of(a[5]), (float*)ptr(a[6]));
            a += 7;
            break;
        case OP_SILU:           // gu, rows, f, a
            tp_silu_mul((const float*)ptr(a[1]), a[2], a[3], (float*)ptr(a[4]));
            a += 5;
            break;
        case OP_EXCHANGE: {     // context
            int64_t* x = (int64_t*)ptr(a[1]);
            a += 2;
            int64_t r = RUN_EXCHANGE;
            if (x[X_MODE] == X_ONE) {
                step[S_PARTS] = x[X_PARTS0];
                step[S_NPARTS] = 1;
                x[X_DONE] += 1;
                r = RUN_END;
            } else if (x[X_MODE] == X_SHM) {
                r = exchange_shm(x, step);
            }
            if (r != RUN_END) {
                *at = a - prog;
                return r;
            }
            break;
        }
        default:                // not a kind the builder writes
            *at = a - prog;
            return RUN_BAD_OP;
        }
    }
}
