// Fused elementwise CPU kernels: RMSNorm with optional residual add, rotary embedding (HF
// rotate-half), SwiGLU gate, per-row int8 quantization of activations and the int8 GEMM's
// dequantization (fp32 or bf16 tensors). Python wrappers: splitfuse/kernels/cpu/elementwise.py.
//
// Every exported symbol starts with sf_ew_. Tensors are passed as base pointers plus row strides
// in elements; the innermost dimension is contiguous. Work is split over rows (silu_and_mul: rows
// and column chunks) with OpenMP when rows * row_length * op_cost reaches a threshold (below it,
// handing work to the thread pool costs more than it saves); op_cost weighs the ops by their
// serial time per element (silu's exp and division cost ~4x a norm's element).
// sf_ew_set_parallel_threshold changes the threshold (0 = always parallel, huge = never).
// Rows are computed independently, so results do not depend on the number of threads.
//
// Numerics follow the torch reference ops (HF Llama):
//   rms_norm:     s = x (+ residual); r = 1 / sqrtf(sum(s*s) / H + eps); out = w * (s * r)
//   rotary:       o1 = x1*c - x2*s; o2 = x2*c + x1*s  (products rounded separately, as torch)
//   silu_and_mul: out = (g / (1 + exp(-g))) * u
//   quantize_rows: scale = max(max|x|, 1e-12) / levels; q = nearbyint(x / scale) + zero_point
//   dequantize_rows: out = (acc * scale) + bias, in fp32, then narrowed to the output dtype
// In bf16 (T = uint16_t bits) the arithmetic is fp32 and values are rounded to bf16 wherever
// torch's bf16 ops round them (round_to<T>): the residual sum; the normed value before the
// weight and the product after it; the rotary tables, each product and each sum; silu's output
// and the product.
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "elementwise_simd.h"
#include "sf_api.h"

using namespace sf_ew;

namespace {

// Measured on AVX2 (Zen 3, 2 threads, warm pool): a parallel region costs ~1-2 us; serially a
// norm or rotary element takes ~0.15-0.25 ns and a silu_and_mul output ~1 ns. 16384 weighted
// elements (~3-4 us serial) is about where splitting starts to pay.
int64_t g_parallel_threshold = 16384;
constexpr int64_t kCostNorm = 1, kCostRotary = 1, kCostSilu = 4, kCostQuantize = 2;

inline bool go_parallel(int64_t rows, int64_t row_len, int64_t cost) {
    return rows > 1 && rows * row_len * cost >= g_parallel_threshold && omp_get_max_threads() > 1;
}

// ---------------------------------------------------------------------------------------- rms
template <typename T>
inline float sum_squares(const T* s, int64_t h) {
    vf a0 = {}, a1 = {}, a2 = {}, a3 = {};
    int64_t j = 0;
    for (; j + 4 * VW <= h; j += 4 * VW) {
        vf v0 = loadu(s + j), v1 = loadu(s + j + VW), v2 = loadu(s + j + 2 * VW), v3 = loadu(s + j + 3 * VW);
        a0 += v0 * v0;
        a1 += v1 * v1;
        a2 += v2 * v2;
        a3 += v3 * v3;
    }
    for (; j + VW <= h; j += VW) {
        vf v = loadu(s + j);
        a0 += v * v;
    }
    float acc = hsum((a0 + a1) + (a2 + a3));
    for (; j < h; ++j) acc += load1(s + j) * load1(s + j);
    return acc;
}

template <typename T>
inline void rms_row(const T* x, const T* res, const T* w, T* out, T* res_out, int64_t h, float eps) {
    const T* s = x;
    if (res) {
        // Pass 1: the residual stream s = x + res, written out first (res_out may alias x or res).
        int64_t j = 0;
        for (; j + VW <= h; j += VW) storeu(res_out + j, loadu(x + j) + loadu(res + j));
        for (; j < h; ++j) store1(res_out + j, load1(x + j) + load1(res + j));
        s = res_out;
    }
    const float ss = sum_squares(s, h);
    const float r = 1.0f / std::sqrt(ss / static_cast<float>(h) + eps);
    const vf rv = splat(r);
    int64_t j = 0;
    for (; j + VW <= h; j += VW) storeu(out + j, loadu(w + j) * round_to<T>(loadu(s + j) * rv));
    for (; j < h; ++j) store1(out + j, load1(w + j) * round_to<T>(load1(s + j) * r));
}

// ------------------------------------------------------------------------------------- rotary
template <typename T>
inline void rotate_heads(const T* src, int64_t s_h, T* dst, int64_t d_h, int64_t nh, int64_t half,
                         const float* c, const float* sn) {
    for (int64_t hh = 0; hh < nh; ++hh) {
        const T* x = src + hh * s_h;
        T* o = dst + hh * d_h;
        int64_t j = 0;
        for (; j + VW <= half; j += VW) {
            vf x1 = loadu(x + j), x2 = loadu(x + half + j);
            vf cv = round_to<T>(loadu(c + j)), sv = round_to<T>(loadu(sn + j));
            vf o1 = round_to<T>(x1 * cv) - round_to<T>(x2 * sv);
            vf o2 = round_to<T>(x2 * cv) + round_to<T>(x1 * sv);
            storeu(o + j, o1);
            storeu(o + half + j, o2);
        }
        for (; j < half; ++j) {
            float x1 = load1(x + j), x2 = load1(x + half + j);
            float cj = round_to<T>(c[j]), sj = round_to<T>(sn[j]);
            float o1 = round_to<T>(x1 * cj) - round_to<T>(x2 * sj);
            float o2 = round_to<T>(x2 * cj) + round_to<T>(x1 * sj);
            store1(o + j, o1);
            store1(o + half + j, o2);
        }
    }
}

// ------------------------------------------------------------------------------- silu_and_mul
template <typename T>
inline void silu_mul_row(const T* g, const T* u, T* o, int64_t n) {
    int64_t j = 0;
    for (; j + VW <= n; j += VW) storeu(o + j, silu_mul<T>(loadu(g + j), loadu(u + j)));
    if (j < n) {  // tail through a padded vector: the same exp as the body
        float gt[VW] = {}, ut[VW] = {}, ot[VW];
        for (int64_t i = j; i < n; ++i) {
            gt[i - j] = load1(g + i);
            ut[i - j] = load1(u + i);
        }
        storeu(ot, silu_mul<T>(loadu(gt), loadu(ut)));
        for (int64_t i = j; i < n; ++i) store1(o + i, ot[i - j]);
    }
}


// ----------------------------------------------------------------------------------- quantize
template <typename T>
inline float abs_max(const T* x, int64_t k) {
    vi a0 = {}, a1 = {};  // |x| as int bits: for non-negative floats, int order is float order
    const vi no_sign = vi{} + 0x7fffffff;
    int64_t j = 0;
    for (; j + 2 * VW <= k; j += 2 * VW) {
        vi v0 = reinterpret_cast<vi>(loadu(x + j)) & no_sign, v1 = reinterpret_cast<vi>(loadu(x + j + VW)) & no_sign;
        a0 = a0 > v0 ? a0 : v0;
        a1 = a1 > v1 ? a1 : v1;
    }
    a0 = a0 > a1 ? a0 : a1;
    float m = 0.0f;
    for (int i = 0; i < VW; ++i) {
        float f;
        int32_t bits = a0[i];
        std::memcpy(&f, &bits, sizeof(f));
        m = f > m ? f : m;
    }
    for (; j < k; ++j) m = std::fabs(load1(x + j)) > m ? std::fabs(load1(x + j)) : m;
    return m;
}

// bf16 rows are widened exactly, so a bf16 row quantizes as its fp32 copy would.
template <typename T>
inline void quantize_row(const T* x, uint8_t* q, float* scale, int64_t k, float levels, float zero_point) {
    const float m = abs_max(x, k);
    const float s = (m > 1e-12f ? m : 1e-12f) / levels;
    *scale = s;
    // Round half to even (as torch.round) by adding and subtracting 1.5 * 2^23: exact for
    // |x / s| <= levels < 2^22, and vectorises where nearbyint would call libm per element.
    const float magic = 12582912.0f;
    const vf sv = splat(s), mv = splat(magic), zv = splat(zero_point);
    int64_t j = 0;
    for (; j + VW <= k; j += VW) {
        const vf r = (rounded(loadu(x + j) / sv + mv) - mv) + zv;
        const vi iv = __builtin_convertvector(r, vi);
        for (int i = 0; i < VW; ++i) q[j + i] = static_cast<uint8_t>(iv[i]);
    }
    for (; j < k; ++j)
        q[j] = static_cast<uint8_t>(static_cast<int32_t>((rounded(load1(x + j) / s + magic) - magic) + zero_point));
}

template <typename T>
void quantize_rows(const int64_t* a) {
    const T* x = reinterpret_cast<const T*>(a[0]);
    uint8_t* q = reinterpret_cast<uint8_t*>(a[2]);
    float* scales = reinterpret_cast<float*>(a[3]);
    const int64_t sx = a[1], rows = a[4], k = a[5];
    const float levels = static_cast<float>(a[6]), zero_point = static_cast<float>(a[7]);
#pragma omp parallel for schedule(static) if (go_parallel(rows, k, kCostQuantize))
    for (int64_t t = 0; t < rows; ++t) quantize_row(x + t * sx, q + t * k, scales + t, k, levels, zero_point);
}

// ------------------------------------------------------------------------------ dequantize
// out[t] = T(acc[t] * scale[t] (+ bias)): the int8 GEMM's fp32 sums times the row's activation
// scale, the product and the sum rounded separately (as torch's mul_ then add_), then narrowed
// to T once. For T = float, out may be acc itself (in place).
template <typename T>
void dequantize_rows(const int64_t* a) {
    const float* acc = reinterpret_cast<const float*>(a[0]);
    const float* scales = reinterpret_cast<const float*>(a[2]);
    const float* bias = reinterpret_cast<const float*>(a[3]);
    T* out = reinterpret_cast<T*>(a[4]);
    const int64_t sa = a[1], so = a[5], rows = a[6], n = a[7];
#pragma omp parallel for schedule(static) if (go_parallel(rows, n, kCostNorm))
    for (int64_t t = 0; t < rows; ++t) {
        const float* r = acc + t * sa;
        T* o = out + t * so;
        const float s = scales[t];
        const vf sv = splat(s);
        int64_t j = 0;
        if (bias) {
            for (; j + VW <= n; j += VW) storeu(o + j, rounded(loadu(r + j) * sv) + loadu(bias + j));
            for (; j < n; ++j) store1(o + j, rounded(r[j] * s) + bias[j]);
        } else {
            for (; j + VW <= n; j += VW) storeu(o + j, loadu(r + j) * sv);
            for (; j < n; ++j) store1(o + j, r[j] * s);
        }
    }
}

// out[t] = w * normed(x[t] (+ res[t])); with res, res_out[t] = x[t] + res[t] (written first, so
// res_out may be x or res itself; out may be x; out must not be res_out). res == nullptr: no add.
template <typename T>
void rms_norm(const T* x, int64_t sx, const T* res, int64_t sr, const T* w, T* out, int64_t so, T* res_out,
              int64_t sro, int64_t rows, int64_t h, float eps) {
#pragma omp parallel for schedule(static) if (go_parallel(rows, h, kCostNorm))
    for (int64_t t = 0; t < rows; ++t)
        rms_row(x + t * sx, res ? res + t * sr : nullptr, w, out + t * so, res ? res_out + t * sro : nullptr,
                h, eps);
}

// Rotate q [T, Hq, D] and k [T, Hk, D] (strides per token and per head, in elements; the head
// dimension contiguous) into qo / ko (which may be q / k with the same strides: in place), with
// fp32 cos/sin tables. Returns -1 on success; otherwise the index of the first token whose
// position is outside [0, max_pos), and nothing was written.
template <typename T>
int64_t rotary(const T* q, int64_t sqt, int64_t sqh, const T* k, int64_t skt, int64_t skh, T* qo, int64_t sqot,
               int64_t sqoh, T* ko, int64_t skot, int64_t skoh, const int64_t* pos, const float* cos, int64_t sc,
               const float* sin, int64_t ss, int64_t max_pos, int64_t rows, int64_t hq, int64_t hk, int64_t d) {
    for (int64_t t = 0; t < rows; ++t)
        if (pos[t] < 0 || pos[t] >= max_pos) return t;
    const int64_t half = d / 2;
#pragma omp parallel for schedule(static) if (go_parallel(rows, (hq + hk) * d, kCostRotary))
    for (int64_t t = 0; t < rows; ++t) {
        const float* c = cos + pos[t] * sc;
        const float* sn = sin + pos[t] * ss;
        rotate_heads(q + t * sqt, sqh, qo + t * sqot, sqoh, hq, half, c, sn);
        rotate_heads(k + t * skt, skh, ko + t * skot, skoh, hk, half, c, sn);
    }
    return -1;
}

// out[t, :n] = silu(x[t, :n]) * x[t, n:2n]. Parallel work items are (row, column chunk): with
// fewer rows than threads (decode, large intermediate sizes) each row is split into chunks too.
template <typename T>
void silu_and_mul(const T* x, int64_t sx, T* out, int64_t so, int64_t rows, int64_t n) {
    if (rows <= 0 || n <= 0) return;
    const bool par = rows * n * kCostSilu >= g_parallel_threshold && omp_get_max_threads() > 1;
    int64_t chunks = 1;
    if (par && rows < omp_get_max_threads()) {
        const int64_t want = (omp_get_max_threads() + rows - 1) / rows;
        const int64_t most = (n + 511) / 512;  // no chunk below ~512 outputs
        chunks = want < most ? want : most;
    }
    int64_t chunk = (n + chunks - 1) / chunks;
    chunk = (chunk + VW - 1) / VW * VW;  // chunks start on vector boundaries: only the last has a tail
    chunks = (n + chunk - 1) / chunk;
    const int64_t items = rows * chunks;
#pragma omp parallel for schedule(static) if (par && items > 1)
    for (int64_t it = 0; it < items; ++it) {
        const int64_t t = it / chunks, j0 = (it % chunks) * chunk;
        const int64_t len = n - j0 < chunk ? n - j0 : chunk;
        silu_mul_row(x + t * sx + j0, x + t * sx + n + j0, out + t * so + j0, len);
    }
}

// The packed-argument forms the Python wrappers call: one pointer to the arguments above, in
// order, each 8 bytes (int64, pointers as int64, eps as double). A ctypes call converts each
// argument separately (~0.3 us apiece); packing them with struct.pack costs a fraction of that.
template <typename T>
void rms_norm_packed(const int64_t* a) {
    double eps;
    std::memcpy(&eps, a + 11, sizeof(eps));
    rms_norm<T>(reinterpret_cast<const T*>(a[0]), a[1], reinterpret_cast<const T*>(a[2]), a[3],
                reinterpret_cast<const T*>(a[4]), reinterpret_cast<T*>(a[5]), a[6], reinterpret_cast<T*>(a[7]), a[8],
                a[9], a[10], static_cast<float>(eps));
}

template <typename T>
int64_t rotary_packed(const int64_t* a) {
    return rotary<T>(reinterpret_cast<const T*>(a[0]), a[1], a[2], reinterpret_cast<const T*>(a[3]), a[4], a[5],
                     reinterpret_cast<T*>(a[6]), a[7], a[8], reinterpret_cast<T*>(a[9]), a[10], a[11],
                     reinterpret_cast<const int64_t*>(a[12]), reinterpret_cast<const float*>(a[13]), a[14],
                     reinterpret_cast<const float*>(a[15]), a[16], a[17], a[18], a[19], a[20], a[21]);
}

template <typename T>
void silu_and_mul_packed(const int64_t* a) {
    silu_and_mul<T>(reinterpret_cast<const T*>(a[0]), a[1], reinterpret_cast<T*>(a[2]), a[3], a[4], a[5]);
}

}  // namespace

extern "C" {

// Calls with at least this many weighted elements (rows * row length * op cost) run on the
// OpenMP pool.
void sf_ew_set_parallel_threshold(int64_t elements) { g_parallel_threshold = elements; }
int64_t sf_ew_get_parallel_threshold(void) { return g_parallel_threshold; }
// Vector width in floats the library was compiled for (16 = AVX-512, 8 = AVX2, 4 = other).
int sf_ew_vector_width(void) { return VW; }

// fp32 and bf16 (uint16_t bits) forms of the kernels above, packed arguments.
void sf_ew_rms_norm_f32_packed(const int64_t* a) { rms_norm_packed<float>(a); }
void sf_ew_rms_norm_bf16_packed(const int64_t* a) { rms_norm_packed<uint16_t>(a); }
int64_t sf_ew_rotary_f32_packed(const int64_t* a) { return rotary_packed<float>(a); }
int64_t sf_ew_rotary_bf16_packed(const int64_t* a) { return rotary_packed<uint16_t>(a); }
void sf_ew_silu_and_mul_f32_packed(const int64_t* a) { silu_and_mul_packed<float>(a); }
void sf_ew_silu_and_mul_bf16_packed(const int64_t* a) { silu_and_mul_packed<uint16_t>(a); }

// Per-row symmetric quantization of x [rows, k] (fp32 or bf16; row stride sx) to uint8
// q [rows, k] (contiguous) around zero_point, with fp32 scales [rows]:
// q = nearbyint(x / scale) + zero_point, scale = max(max|x|, 1e-12) / levels. The caller keeps
// levels + zero_point within uint8. Packed: x, sx, q, scales, rows, k, levels, zero_point.
void sf_ew_quantize_rows_u8_packed(const int64_t* a) { quantize_rows<float>(a); }
void sf_ew_quantize_rows_u8_bf16_packed(const int64_t* a) { quantize_rows<uint16_t>(a); }

// out [rows, n] (fp32 or bf16, row stride so) = acc [rows, n] (fp32, row stride sa) * scales[t]
// (+ bias [n] fp32, or 0 for none). Packed: acc, sa, scales, bias, out, so, rows, n.
void sf_ew_dequantize_rows_f32_packed(const int64_t* a) { dequantize_rows<float>(a); }
void sf_ew_dequantize_rows_bf16_packed(const int64_t* a) { dequantize_rows<uint16_t>(a); }

}  // extern "C"
