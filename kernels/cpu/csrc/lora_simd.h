// LoRA products over linear.cpp's packed weights (namespace sf_lora; nothing here is exported):
// the register strips that decoder.cpp's lora_shrink (XA = X . A, each row through its own
// adapter's columns) and the LoRA deltas (XA . B) both run, and those deltas, which linear.cpp's
// and quant4.cpp's kernels add in their stores (block_addend).
//
// The stacks (splitfuse/lora/stacks.py): a projection's output parts j (qkv: q, k, v; gate_up:
// gate, up; o and down: one), each with R_j columns per slot. XA's part j holds every slot's
// R_j columns side by side (slot-minor) from its column `col`; B_j [max_loras * R_j, part
// width] is packed for the linear kernel (row k of B_j: slot k / R_j). Row t of a step with slot
// s adds XA[t, col + s R_j + i] . B_j[s R_j + i, :] over i < R_j to its part-j outputs.
//
// The linear kernel computes a block of output columns' deltas for all its rows first, into a
// small buffer of its thread (block_deltas: each slot's few KB of B for the block read once, for
// all of the slot's rows), and its store adds them to the sums. Measured on the bench model (256
// rows over 4 adapters of rank 16, all seven projections): the step's LoRA cost +27% -> +13%
// against a separate pass over the output after the product (which re-read rows another core had
// written); adding the deltas to the output right after each block (rows of a tall block at a
// power-of-two stride conflict in the cache) or computing them in each strip's store (B re-read
// per strip of rows, as the strip's weights stream through L1) cost the same as this.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "bf16.h"
#include "elementwise_simd.h"

#if defined(__AVX512BF16__) && SF_EW_VW == 16 && SF_EW_NATIVE_VW == 16
#include <immintrin.h>
#endif

namespace sf_lora {

using sf_ew::vf;
using sf_ew::VW;

// Rows per register strip and weight vectors per strip: linear.cpp's MR and NV.
constexpr int LMR = SF_EW_NATIVE_VW == 16 ? 6 : 2;
constexpr int LNV = 4;

// One output part of an adapted projection, as block_deltas reads it.
struct DeltaPart {
    const void* b;      // B_j packed (the model's dtype), B's K = max_loras * rank rows
    int64_t b_rows;     // max_loras * rank
    int64_t rank;       // R_j
    int64_t col;        // the part's first column in XA
    int64_t out_start;  // its output columns [out_start, out_end) in the projection's output
    int64_t out_end;    //   (gate_up, not gated: gate [0, I), up [I, 2I))
};

// What linear.cpp needs to add each row's adapter's delta to a projection's outputs.
struct Deltas {
    const void* xa;           // XA [rows, xa_stride], the model's dtype
    int64_t xa_stride;
    const int64_t* order;     // the call's rows with an adapter, grouped by slot: slot s's are
    const int64_t* seg;       //   order[seg[s] .. seg[s + 1])
    int64_t slots;
    const int64_t* row_slot;  // per row of the call: its slot, -1 for none
    int64_t nb;               // the packed B's block width (linear.cpp's NB)
    int64_t parts;
    DeltaPart part[3];
};

// acc[r][j] = sum over k in [k0, k1) of x[r][k] * W[k, vector j] for rows r < R and vectors
// j < V, W in linear.cpp's packed layout: w[j] is vector j's first column at k = 0 (float32:
// nb floats per k). One sequential sum over k per output, as linear.cpp's strips compute it.
// The sums run in a local array (registers) and are copied to acc at the end: acc is the caller's
// and the loads of x (float) may alias it, so summing into it directly keeps every accumulator in
// memory (a store and a reload per multiply-add: ~10x slower).
template <int R, int V>
inline void lora_strip(const float* const* x, const float* const* w, int64_t nb, int64_t k0, int64_t k1,
                       vf (&acc)[LMR][LNV]) {
    vf sum[R][V];
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < V; ++j) sum[r][j] = vf{};
    const float* xr[R];
    const float* wj[V];
    for (int r = 0; r < R; ++r) xr[r] = x[r];
    for (int j = 0; j < V; ++j) wj[j] = w[j];
    for (int64_t k = k0; k < k1; ++k) {
        vf wk[V];
        for (int j = 0; j < V; ++j) wk[j] = sf_ew::loadu(wj[j] + k * nb);
        for (int r = 0; r < R; ++r) {
            const vf xb = sf_ew::splat(xr[r][k]);
            for (int j = 0; j < V; ++j) sum[r][j] += wk[j] * xb;
        }
    }
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < V; ++j) acc[r][j] = sum[r][j];
}

// bf16: W holds pairs of consecutive k per column (nb pairs per k pair); a pair's half outside
// [k0, k1) gets x = 0, so a slot's rows of B starting at an odd k leave its neighbour's out.
// The pair product is linear.cpp's (vdpbf16ps where the compiler targets AVX-512 BF16).
template <int R, int V>
inline void lora_strip(const uint16_t* const* x, const uint16_t* const* w, int64_t nb, int64_t k0, int64_t k1,
                       vf (&acc)[LMR][LNV]) {
    vf sum[R][V];  // local: see the float32 form
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < V; ++j) acc[r][j] = sum[r][j] = vf{};
    if (k0 >= k1) return;
    auto pair = [&](int64_t p, const uint32_t (&xp)[LMR]) {
        sf_ew::vu wv[V];
        for (int j = 0; j < V; ++j) std::memcpy(&wv[j], w[j] + p * 2 * nb, sizeof(sf_ew::vu));
#if defined(__AVX512BF16__) && SF_EW_VW == 16 && SF_EW_NATIVE_VW == 16
        for (int r = 0; r < R; ++r) {
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[r]));
            for (int j = 0; j < V; ++j)
                sum[r][j] = reinterpret_cast<vf>(
                    _mm512_dpbf16_ps(reinterpret_cast<__m512>(sum[r][j]), (__m512bh)wv[j], xb));
        }
#else
        vf w_even[V], w_odd[V];
        for (int j = 0; j < V; ++j) {
            w_even[j] = reinterpret_cast<vf>(wv[j] << 16);
            w_odd[j] = reinterpret_cast<vf>(wv[j] & 0xffff0000u);
        }
        for (int r = 0; r < R; ++r) {
            const vf x_even = sf_ew::splat(sf_bf16::to_f32(static_cast<uint16_t>(xp[r])));
            const vf x_odd = sf_ew::splat(sf_bf16::to_f32(static_cast<uint16_t>(xp[r] >> 16)));
            for (int j = 0; j < V; ++j) sum[r][j] += w_even[j] * x_even + w_odd[j] * x_odd;
        }
#endif
    };
    uint32_t xp[LMR];
    int64_t p = k0 / 2;
    if (k0 & 1) {  // the first pair's even half is the previous slot's
        for (int r = 0; r < R; ++r) xp[r] = uint32_t(x[r][k0]) << 16;
        pair(p++, xp);
    }
    for (; 2 * p + 1 < k1; ++p) {
        for (int r = 0; r < R; ++r) std::memcpy(&xp[r], x[r] + 2 * p, sizeof(uint32_t));
        pair(p, xp);
    }
    if (2 * p < k1) {  // the last pair's odd half is outside (the next slot's, or K's padding)
        for (int r = 0; r < R; ++r) xp[r] = x[r][2 * p];
        pair(p, xp);
    }
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < V; ++j) acc[r][j] = sum[r][j];
}

// lora_strip for rows [0, rows) (at most LMR) and V vectors, dispatched to the templates.
template <typename T>
void strip_rows(int rows, int v, const T* const* x, const T* const* w, int64_t nb, int64_t k0, int64_t k1,
                vf (&acc)[LMR][LNV]) {
    auto by_v = [&](auto r) {
        constexpr int R = decltype(r)::value;
        switch (v) {
            case 1: lora_strip<R, 1>(x, w, nb, k0, k1, acc); break;
            case 2: lora_strip<R, 2>(x, w, nb, k0, k1, acc); break;
            case 3: lora_strip<R, 3>(x, w, nb, k0, k1, acc); break;
            default: lora_strip<R, 4>(x, w, nb, k0, k1, acc); break;
        }
    };
    switch (rows) {  // LMR is 6 or 2
        case 1: by_v(std::integral_constant<int, 1>{}); break;
        case 2: by_v(std::integral_constant<int, 2>{}); break;
        case 3: if constexpr (LMR > 2) by_v(std::integral_constant<int, 3>{}); break;
        case 4: if constexpr (LMR > 3) by_v(std::integral_constant<int, 4>{}); break;
        case 5: if constexpr (LMR > 4) by_v(std::integral_constant<int, 5>{}); break;
        default: if constexpr (LMR > 5) by_v(std::integral_constant<int, LMR>{}); break;
    }
}

// Where the vector of columns [col, col + VW) (col a multiple of VW) of a packed weight of K rows
// (linear.cpp's layout) starts, at k = 0.
template <typename T>
const T* packed_vector(const T* w, int64_t K, int64_t nb, int64_t col) {
    const int64_t block_elems = (sizeof(T) == 2 ? (K + 1) / 2 * 2 : K) * nb;
    return w + (col / nb) * block_elems + (col % nb) * (sizeof(T) == 2 ? 2 : 1);
}

// One element W[k, col] of a packed weight of K rows, as a float.
template <typename T>
float packed_at(const T* w, int64_t K, int64_t nb, int64_t k, int64_t col) {
    if constexpr (sizeof(T) == 2)
        return sf_ew::load1(packed_vector(w, K, nb, col) + (k / 2) * 2 * nb + (k & 1));
    else
        return w[(col / nb) * K * nb + k * nb + col % nb];
}

// The LoRA deltas of one block of a linear call's outputs, before its base product runs:
// d[(t - m0) * LNV * VW + j * VW + lane] = the delta of row t (in [m0, m0 + rows), with an
// adapter) at column col[j] + lane of the projection's output (valid[j] of them; rows without an
// adapter are not written), rounded to T. A slot's rows go through its rows of B in strips of up
// to LMR rows and LNV vectors, so each slot's few KB of B for the block are read once; a vector
// that is not whole in one part at one of the part's vector boundaries (a part boundary inside
// it, or a part not a whole number of vectors from the block's start) goes column by column.
template <typename T>
void block_deltas(const Deltas& e, int64_t m0, int64_t rows, const int64_t (&col)[LNV], const int (&valid)[LNV],
                  float* d) {
    constexpr int64_t row_elems = LNV * VW;
    const T* xa = static_cast<const T*>(e.xa);
    int part_of[LNV];  // the part a vector is whole in, at one of its vector boundaries, or -1
    for (int j = 0; j < LNV; ++j) {
        part_of[j] = -1;
        for (int64_t q = 0; q < e.parts && valid[j] == VW; ++q) {
            const DeltaPart& p = e.part[q];
            if (col[j] >= p.out_start && col[j] + VW <= p.out_end && (col[j] - p.out_start) % VW == 0)
                part_of[j] = static_cast<int>(q);
        }
    }
    for (int64_t s = 0; s < e.slots; ++s) {
        int64_t mine[LMR];
        int n = 0;
        auto flush = [&] {
            for (int64_t q = 0; q < e.parts; ++q) {
                const DeltaPart& p = e.part[q];
                const T* b = static_cast<const T*>(p.b);
                int vecs[LNV], nv = 0;
                const T* w[LNV];
                for (int j = 0; j < LNV; ++j)
                    if (part_of[j] == q) {
                        w[nv] = packed_vector(b, p.b_rows, e.nb, col[j] - p.out_start);
                        vecs[nv++] = j;
                    }
                if (nv == 0) continue;
                const T* xr[LMR];
                for (int r = 0; r < n; ++r) xr[r] = xa + mine[r] * e.xa_stride + p.col;
                vf acc[LMR][LNV];
                strip_rows<T>(n, nv, xr, w, e.nb, s * p.rank, (s + 1) * p.rank, acc);
                for (int r = 0; r < n; ++r)
                    for (int i = 0; i < nv; ++i)
                        sf_ew::storeu(d + (mine[r] - m0) * row_elems + vecs[i] * VW, sf_ew::round_to<T>(acc[r][i]));
            }
            for (int j = 0; j < LNV; ++j) {  // the rest, column by column
                if (part_of[j] >= 0) continue;
                for (int c = 0; c < VW; ++c) {
                    const int64_t out = col[j] + c;
                    for (int r = 0; r < n; ++r) d[(mine[r] - m0) * row_elems + j * VW + c] = 0.0f;
                    if (c >= valid[j]) continue;
                    for (int64_t q = 0; q < e.parts; ++q) {
                        const DeltaPart& p = e.part[q];
                        if (out < p.out_start || out >= p.out_end) continue;
                        for (int r = 0; r < n; ++r) {
                            const T* x = xa + mine[r] * e.xa_stride + p.col;
                            float sum = 0.0f;
                            for (int64_t k = s * p.rank; k < (s + 1) * p.rank; ++k)
                                sum = std::fma(sf_ew::load1(x + k),
                                               packed_at(static_cast<const T*>(p.b), p.b_rows, e.nb, k, out - p.out_start),
                                               sum);
                            d[(mine[r] - m0) * row_elems + j * VW + c] = sf_ew::round_to<T>(sum);
                        }
                    }
                }
            }
            n = 0;
        };
        for (int64_t i = e.seg[s]; i < e.seg[s + 1]; ++i) {
            const int64_t t = e.order[i];
            if (t < m0 || t >= m0 + rows) continue;
            mine[n++] = t;
            if (n == LMR) flush();
        }
        if (n) flush();
    }
}

// What a linear call adds to its sums before storing them (GATED: before SwiGLU), or nothing: LoRA
// deltas computed from XA (lora_simd.h; rows with slot -1 get none), or a dense addend in T
// [M, the unfused output's columns] (the Python layers' deltas, every row), the unfused output of
// a GATED call being gate [0, N) then up [N, 2N).
template <typename T>
struct Addend {
    const sf_lora::Deltas* lora = nullptr;
    const T* dense = nullptr;
    int64_t dense_stride = 0;
    bool any() const { return lora != nullptr || dense != nullptr; }
};

// The addend of rows [m0, m0 + rows) at the block of output columns [n0, n0 + cols) (GATED: NB / 2
// gate columns, then their up columns N on) in this thread's scratch (float, row stride NB = LNV *
// VW, vector j at j * VW), made before the block's product so that its store adds it (linear.cpp's
// and quant4.cpp's kernels).
template <typename T, bool GATED>
const float* block_addend(const Addend<T>& add, int64_t N, int64_t m0, int64_t rows, int64_t n0, int64_t cols) {
    constexpr int OUT = GATED ? LNV / 2 : LNV;
    constexpr int64_t NB = LNV * VW;
    thread_local std::vector<float> scratch;
    if (static_cast<int64_t>(scratch.size()) < rows * NB) scratch.resize(rows * NB);
    int64_t col[LNV];
    int valid[LNV];
    for (int j = 0; j < LNV; ++j) {
        const int64_t left = cols - (j % OUT) * VW;
        valid[j] = left <= 0 ? 0 : left < VW ? static_cast<int>(left) : VW;
        col[j] = n0 + (j % OUT) * VW + (GATED && j >= OUT ? N : 0);
    }
    float* d = scratch.data();
    if (add.lora != nullptr) {
        block_deltas<T>(*add.lora, m0, rows, col, valid, d);
        return d;
    }
    for (int64_t r = 0; r < rows; ++r) {
        const T* src = add.dense + (m0 + r) * add.dense_stride;
        for (int j = 0; j < LNV; ++j) {
            float* out = d + r * NB + j * VW;
            if (valid[j] == VW) {
                sf_ew::storeu(out, sf_ew::loadu(src + col[j]));
            } else {
                for (int c = 0; c < VW; ++c) out[c] = c < valid[j] ? sf_ew::load1(src + col[j] + c) : 0.0f;
            }
        }
    }
    return d;
}

}  // namespace sf_lora
