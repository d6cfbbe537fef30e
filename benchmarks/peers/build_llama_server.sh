#!/usr/bin/env bash
# Build llama.cpp's own `llama-server` from the llama.cpp that llama-cpp-python 0.3.36 vendors, so
# the serving benchmark's peer runs the same ggml as accelab's llama.cpp engine. Same CPU flags as
# the Makefile's llama-cpp-python build (native, no AMX: ggml's AMX kernels die with SIGILL on these
# VMs). 10-25 minutes on 2 cores: run it under the heavy-job lock on a shared machine:
#
#   flock /tmp/accelab-heavy.lock bash benchmarks/peers/build_llama_server.sh
#
# The binary lands in benchmarks/peers/build/bin/llama-server (build/ is ignored by git).
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
BUILD="${LLAMA_SERVER_BUILD:-$HERE/build}"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
PYTHON="${PYTHON:-python3}"
JOBS="${JOBS:-$(nproc)}"

if [ -x "$BUILD/bin/llama-server" ]; then
  echo "llama-server already built: $BUILD/bin/llama-server"
  exit 0
fi
mkdir -p "$BUILD/src"
cd "$BUILD/src"

# 1. the sdist (a source archive, never a wheel)
if ! ls llama_cpp_python-"$VERSION".tar.gz >/dev/null 2>&1; then
  "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d .
fi
rm -rf "llama_cpp_python-$VERSION"
tar xzf "llama_cpp_python-$VERSION.tar.gz"
SRC="$BUILD/src/llama_cpp_python-$VERSION/vendor/llama.cpp"
[ -f "$SRC/CMakeLists.txt" ] || { echo "no vendored llama.cpp at $SRC" >&2; exit 1; }

# 2. configure and build only the server (and what it links)
cmake -S "$SRC" -B "$BUILD/cmake" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DCMAKE_C_FLAGS=-mno-amx-int8 -DCMAKE_CXX_FLAGS=-mno-amx-int8 -DLLAMA_BUILD_SERVER=ON \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF
cmake --build "$BUILD/cmake" --target llama-server llama-batched-bench -j "$JOBS"

# 3. the binaries where the benchmark looks for them
mkdir -p "$BUILD/bin"
cp "$BUILD/cmake/bin/llama-server" "$BUILD/bin/"
cp "$BUILD/cmake/bin/llama-batched-bench" "$BUILD/bin/" 2>/dev/null || true
"$BUILD/bin/llama-server" --version 2>&1 | head -3
echo "built $BUILD/bin/llama-server"
