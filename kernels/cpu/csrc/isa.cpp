#include "sf_api.h"

// What the library was compiled for (build.py's library_isa): the engine chooses between our
// kernels and torch's from this, not from the CPU's flags, so a narrowed build
// (SPLITFUSE_CPU_ISA=avx2 on an AVX-512 machine) takes the paths an AVX2-only CPU takes.
int sf_build_isa() {
  int bits = 0;
#if defined(__AVX2__) && defined(__FMA__)
  bits |= 1;
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  bits |= 2;
#endif
#if defined(__AVX512BF16__)
  bits |= 4;
#endif
#if defined(__AVX512VNNI__)
  bits |= 8;
#endif
  return bits;
}
