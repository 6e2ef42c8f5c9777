// Software prefetch of the weights a thread multiplies next (linear.cpp, quant4.cpp).
//
// A deep model's weights come from memory at every step (SmolLM2's 30 layers do not stay in the
// caches), and the hardware prefetcher follows a block of weights only once it is being read: the
// first register strip of each block then waits on memory. So each strip of rows asks for its share
// of the bytes its thread reads after the current block (or k chunk), while it computes. A call of
// one strip (a few rows) streams its weights: there the hardware keeps up, and these prefetches
// only took load slots (10-25% slower at one row), so such calls fetch nothing.
#pragma once

#include <cstdint>

namespace sf_ahead {

// Strip s's share (of `strips`) of the `bytes` at `next`; empty for a lone strip or no next bytes.
struct Share {
    const char* p = nullptr;
    int64_t bytes = 0;
};

inline Share share(const void* next, int64_t bytes, int64_t s, int64_t strips) {
    if (next == nullptr || bytes <= 0 || strips < 2) return {};
    const int64_t lo = bytes * s / strips, hi = bytes * (s + 1) / strips;
    return {static_cast<const char*>(next) + lo, hi - lo};
}

// The share of the strip of MR rows that starts at row m of a chunk of `rows` rows.
template <int MR>
inline Share strip_share(const void* next, int64_t bytes, int64_t m, int64_t rows) {
    return share(next, bytes, m / MR, (rows + MR - 1) / MR);
}

// The whole share at once (the GGUF kernels' shares are a k chunk's few KB, split over the strips).
inline void fetch(const Share& sh) {
    for (int64_t o = 0; o < sh.bytes; o += 64) __builtin_prefetch(sh.p + o, 0, 2);
}

// The share spread over a strip's k steps, a line or a few at each (the float linear kernel's
// shares are a whole 64-column block's tens of KB): at(k) at every step k < steps.
class Spread {
   public:
    Spread() = default;
    Spread(const Share& sh, int64_t steps) : p_(steps > 0 ? sh.p : nullptr) {
        if (p_ == nullptr || sh.bytes <= 0) {
            p_ = nullptr;
            return;
        }
        step64_ = sh.bytes * 64 / steps;
        const int64_t lines = (sh.bytes + 64 * steps - 1) / (64 * steps);
        lines_ = lines < 1 ? 1 : lines > 4 ? 4 : static_cast<int>(lines);
    }
    inline void at(int64_t k) const {
        if (p_ == nullptr) return;
        const char* q = p_ + ((k * step64_) >> 6);
        for (int i = 0; i < lines_; ++i) __builtin_prefetch(q + 64 * i, 0, 2);
    }

   private:
    const char* p_ = nullptr;
    int64_t step64_ = 0;  // bytes per k step, in 1/64 byte
    int lines_ = 0;       // cache lines asked for per k step
};

}  // namespace sf_ahead
