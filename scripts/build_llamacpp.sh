#!/usr/bin/env bash
# Build the llama.cpp binaries the peer benchmarks run (`verispec bench -m llamacpp-server`,
# scripts/bench_vs_llamacpp.py): llama-server, llama-speculative-simple, llama-bench and
# llama-simple, from the llama.cpp source vendored in the llama-cpp-python sdist (the same
# llama.cpp that verispec's [llamacpp] extra runs). CPU only: Release, -DGGML_NATIVE=ON (a
# benchmark binary for this machine), no CUDA, no curl.
#
#   scripts/build_llamacpp.sh            # prints the bin directory (builds once, ~8 min on 2 cores)
#   LLAMACPP_BIN=/path/to/bin scripts/build_llamacpp.sh   # use that build (checked, not rebuilt)
#   LLAMACPP_DIR=/tmp/llama scripts/build_llamacpp.sh     # cache elsewhere
#
# Does nothing when the binaries exist: $LLAMACPP_BIN if set, else /work/cache/llama.cpp/build/bin
# (the development machine's build) if present, else ${LLAMACPP_DIR:-~/.cache/verispec/llama.cpp}/build/bin.
# Only the bin path goes to stdout; progress goes to stderr.
set -euo pipefail
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
    sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
    exit 0
fi

VERSION=0.3.16
DIR=${LLAMACPP_DIR:-$HOME/.cache/verispec/llama.cpp}
TARGETS=(llama-server llama-speculative-simple llama-bench llama-simple)

have() {  # have DIR: every target is an executable in DIR
  local t
  for t in "${TARGETS[@]}"; do [ -x "$1/$t" ] || return 1; done
}

if [ -n "${LLAMACPP_BIN:-}" ]; then
  have "$LLAMACPP_BIN" || { echo "error: LLAMACPP_BIN=$LLAMACPP_BIN lacks one of ${TARGETS[*]}" >&2; exit 1; }
  echo "$LLAMACPP_BIN"
  exit 0
fi
for bin in /work/cache/llama.cpp/build/bin "$DIR/build/bin"; do
  if have "$bin"; then echo "$bin"; exit 0; fi
done

for tool in cmake c++ tar; do
  command -v "$tool" >/dev/null || { echo "error: $tool is needed to build llama.cpp" >&2; exit 1; }
done
mkdir -p "$DIR"
SRC=$DIR/llama_cpp_python-$VERSION/vendor/llama.cpp
if [ ! -f "$SRC/CMakeLists.txt" ]; then
  echo "downloading the llama-cpp-python $VERSION sdist into $DIR" >&2
  [ -f "$DIR/llama_cpp_python-$VERSION.tar.gz" ] ||
    python3 -m pip download --no-binary :all: --no-deps -d "$DIR" "llama-cpp-python==$VERSION" >&2
  tar -xzf "$DIR/llama_cpp_python-$VERSION.tar.gz" -C "$DIR" "llama_cpp_python-$VERSION/vendor/llama.cpp"
fi
echo "building ${TARGETS[*]} in $DIR/build (takes minutes)" >&2
cmake -S "$SRC" -B "$DIR/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_CUDA=OFF \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DBUILD_SHARED_LIBS=OFF >&2
cmake --build "$DIR/build" --config Release -j "$(nproc)" --target "${TARGETS[@]}" >&2
have "$DIR/build/bin" || { echo "error: the build left no ${TARGETS[*]} in $DIR/build/bin" >&2; exit 1; }
echo "$DIR/build/bin"
