// The int8 all-reduce's own work (tensorpar/comm/compress.py, --tp-comm int8): quantizing this rank's fp32 partial
// into blocks of 32 (one fp32 scale each, int8 values), and dequantizing and summing every rank's gathered payload.
//
// The same arithmetic as compress.py's PyTorch path, operation for operation in fp32, so both give the same bits:
//   quantize, per block: amax = max |x| (exact); scale = amax / 127; r = (1 / max(amax, FLT_MIN)) * 127 (PyTorch's
//                        scalar / tensor, two roundings);
//                        q = rint(x * r), halves to even (no clamp: |x * r| <= 127 up to a rounding)
//   sum, per element i of block b: acc = q_0[i] * s_0[b]; acc = acc + q_r[i] * s_r[b] for r = 1 .. t-1 (rank order)
// Built with -ffp-contract=off (no fused multiply-add, which would round once where PyTorch rounds twice) and
// without -ffast-math. A block whose x * r is not finite (amax below 127 / FLT_MAX, or a non-finite element) gets
// q = 0: its scale is then 0 (all zeros) or non-finite (the dequantized block is non-finite, as the exact sum).
// No torch headers; loaded with ctypes (tensorpar/native.py).
#include <cmath>
#include <cstdint>
#include <cfloat>
#include <cstring>

static const int BLOCK = 32;

extern "C" int tp_q8c_abi(void) { return 1; }

// x [n] fp32 -> scales [ceil(n / 32)] fp32, q [n] int8 (the last block may be shorter), then `pad` zero bytes.
extern "C" void tp_q8c_quantize(const float* x, int64_t n, float* scales, int8_t* q, int64_t pad) {
    for (int64_t i = 0; i < pad; ++i) q[n + i] = 0;
    const int64_t nb = (n + BLOCK - 1) / BLOCK;
    for (int64_t b = 0; b < nb; ++b) {
        const int64_t lo = b * BLOCK, hi = lo + BLOCK < n ? lo + BLOCK : n;
        // max |x| on the bit patterns: for floats with the sign cleared, the order of the numbers is that of the
        // unsigned integers (vectorises as an integer max), and NaNs lie above infinity
        uint32_t top = 0;
        for (int64_t i = lo; i < hi; ++i) {
            uint32_t u;
            std::memcpy(&u, x + i, 4);
            u &= 0x7fffffffu;
            top = u > top ? u : top;
        }
        if (top > 0x7f800000u) top = 0x7fc00000u;    // a NaN: the default quiet NaN, as PyTorch's max gives
        float amax;
        std::memcpy(&amax, &top, 4);
        scales[b] = amax / 127.0f;
        const float r = (1.0f / (amax > FLT_MIN ? amax : FLT_MIN)) * 127.0f;     // PyTorch's 127 / t: reciprocal, times
        if (!(std::isfinite(r) && std::isfinite(amax))) {
            for (int64_t i = lo; i < hi; ++i) q[i] = 0;
            continue;
        }
        for (int64_t i = lo; i < hi; ++i) q[i] = (int8_t)std::rint(x[i] * r);
    }
}

// g: t payloads of m bytes each, in rank order (each: nb fp32 scales, then n int8 values) -> out [n] fp32, the sum.
extern "C" void tp_q8c_dequant_sum(const uint8_t* g, int64_t t, int64_t m, int64_t n, float* out) {
    const int64_t nb = (n + BLOCK - 1) / BLOCK;
    for (int64_t b = 0; b < nb; ++b) {
        const int64_t lo = b * BLOCK, hi = lo + BLOCK < n ? lo + BLOCK : n;
        const float s0 = reinterpret_cast<const float*>(g)[b];
        const int8_t* q0 = reinterpret_cast<const int8_t*>(g + 4 * nb);
        for (int64_t i = lo; i < hi; ++i) out[i] = (float)q0[i] * s0;
        for (int64_t r = 1; r < t; ++r) {
            const uint8_t* p = g + r * m;
            const float s = reinterpret_cast<const float*>(p)[b];
            const int8_t* qr = reinterpret_cast<const int8_t*>(p + 4 * nb);
            for (int64_t i = lo; i < hi; ++i) out[i] = out[i] + (float)qr[i] * s;
        }
    }
}
