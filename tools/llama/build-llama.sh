#!/bin/sh
# Builds llama.cpp's llama-server and llama-perplexity (Release, CPU only) from the source that the
# pinned node-llama-cpp package carries (node_modules/node-llama-cpp/llama/gitRelease.bundle, a git
# bundle of the llama.cpp release the package's prebuilt libllama comes from), so the prompt-cache
# tests run the same llama.cpp as the node tests. Nothing is downloaded.
#
#   tools/llama/build-llama.sh [NODE_PREFIX] [OUT]     (defaults: .node and .llama)
#
# Writes OUT/bin/llama-server and OUT/bin/llama-perplexity, and OUT/bundle.sha256: an OUT whose
# stamp matches the bundle is left as it is (a second run costs nothing). Without the bundle it
# says so and exits 0: everything llama-related stays optional (the tests that need a server are
# then skipped at configure time). Any other failure exits nonzero.
set -eu
prefix=${1:-.node}
out=${2:-.llama}
bundle="$prefix/node_modules/node-llama-cpp/llama/gitRelease.bundle"
if [ ! -f "$bundle" ]; then
  echo "build-llama: no llama.cpp source ($bundle not found; npm i -E --no-save --prefix $prefix node-llama-cpp@3.21.1): skipped"
  exit 0
fi
stamp=$(sha256sum "$bundle" | cut -d' ' -f1)
if [ -x "$out/bin/llama-server" ] && [ -x "$out/bin/llama-perplexity" ] && [ "$(cat "$out/bundle.sha256" 2>/dev/null)" = "$stamp" ]; then
  echo "build-llama: $out/bin is up to date with $bundle"
  exit 0
fi
rm -rf "$out/src" "$out/build" "$out/bin" "$out/bundle.sha256"
mkdir -p "$out"
git clone -q "$bundle" "$out/src"
# CPU only, static, no UI assets, no TLS: the server the tests start talks plain HTTP on 127.0.0.1.
cmake -S "$out/src" -B "$out/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
  -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF -DGGML_OPENMP=OFF > "$out/configure.log"
cmake --build "$out/build" -j"${JOBS:-2}" --target llama-server llama-perplexity
mkdir -p "$out/bin"
cp "$out/build/bin/llama-server" "$out/build/bin/llama-perplexity" "$out/bin/"
echo "$stamp" > "$out/bundle.sha256"
echo "build-llama: built $out/bin/llama-server and $out/bin/llama-perplexity from $bundle"
