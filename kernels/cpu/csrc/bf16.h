// Scalar bf16 <-> fp32 for the CPU kernels (bf16 tensors travel as their uint16_t bits).
// Widening is exact: bf16 is the high half of a float. Narrowing rounds to nearest even, as
// torch does (NaN payloads are not kept).
#pragma once

#include <cstdint>
#include <cstring>

namespace sf_bf16 {

static inline float to_f32(uint16_t h) {
    const uint32_t w = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &w, sizeof(f));
    return f;
}

static inline uint16_t from_f32(float v) {
    uint32_t b;
    std::memcpy(&b, &v, sizeof(b));
    return static_cast<uint16_t>((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

}  // namespace sf_bf16
