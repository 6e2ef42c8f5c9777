// How a blocked product's work is shared by the OpenMP threads (linear.cpp, quant4.cpp).
//
// A work item is (column block, chunk of rows), the rows cut at whole register strips; the items
// go to the threads in contiguous runs (schedule(static)). Column blocks alone share well when
// there are many of them, but a narrow model's projections have few: SmolLM2's o and down
// projections are 9 blocks of 64 columns, so one of 2 threads does 5 and the other waits a fifth
// of the product. Rows are then cut into chunks too: 9 blocks x 2 chunks give each thread 9
// items, and both threads stream the same block at the same time (the second read hits the
// shared cache). A chunk re-reads (the GGUF kernel: re-widens) its block, so the fewest chunks
// that bring the threads within ~3% of each other are taken.
#pragma once

#include <cstdint>

namespace sf_split {

struct Split {
    int64_t blocks, chunk_rows, items;
    bool par;

    // Item `it` is column block it % blocks over the chunk of rows from (it / blocks) * chunk_rows
    // (none when that is past M). The column block of the item after it, the one its thread most
    // likely runs next (for prefetch_ahead.h), or -1.
    int64_t next_block(int64_t it, int64_t M) const {
        const int64_t n = it + 1;
        return n < items && (n / blocks) * chunk_rows < M ? n % blocks : -1;
    }
};

// Strips of work the busiest thread gets, times the threads, over all strips: 1 = even shares.
inline double balance(int64_t blocks, int64_t strips, int64_t chunks, int threads) {
    const int64_t per_chunk = (strips + chunks - 1) / chunks;
    const int64_t items = blocks * chunks;
    int64_t busiest = 0, first = 0;
    for (int t = 0; t < threads; ++t) {  // libgomp's static split: the first items % threads get one more
        const int64_t n = items / threads + (t < items % threads ? 1 : 0);
        int64_t load = 0;
        for (int64_t it = first; it < first + n; ++it) {
            const int64_t m0 = (it / blocks) * per_chunk;
            load += m0 < strips ? (strips - m0 < per_chunk ? strips - m0 : per_chunk) : 0;
        }
        busiest = load > busiest ? load : busiest;
        first += n;
    }
    return busiest == 0 ? 1.0 : double(busiest) * threads / double(blocks * strips);
}

// `par`: the product is large enough to be worth the threads; mr: rows per register strip.
inline Split split(int64_t M, int64_t blocks, int mr, int threads, bool par) {
    const int64_t strips = (M + mr - 1) / mr;
    int64_t chunks = 1;
    if (par && threads > 1 && strips > 1) {
        double best = balance(blocks, strips, 1, threads);
        const int64_t most = strips < 4 * threads ? strips : 4 * threads;
        for (int64_t c = 2; c <= most && best > 1.03; ++c) {
            const double b = balance(blocks, strips, c, threads);
            if (b < best - 1e-9) best = b, chunks = c;
        }
    }
    Split s;
    s.blocks = blocks;
    s.chunk_rows = (strips + chunks - 1) / chunks * mr;
    s.items = blocks * chunks;
    s.par = par && threads > 1 && s.items > 1;
    return s;
}

}  // namespace sf_split
