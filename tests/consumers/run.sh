#!/usr/bin/env bash
# Installs the build into a temporary prefix and builds the two consumers against it the way an
# outside project would: tests/consumers/c/demo.c with pkg-config only, tests/consumers/cpp with
# find_package only. Also checks the installed shape: the SONAME, every public header compiling on
# its own with nothing but the prefix and declared dependencies (fmt), and no src/ header leaking.
# Usage: run.sh BUILD_DIR [CC] [CXX]   (ctest's `consumers` test; .ci/run too)
set -euo pipefail
build=$(cd "$1" && pwd)
cc=${2:-cc}
cxx=${3:-c++}
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d "${TMPDIR:-/tmp}/vq-consumers.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
prefix=$tmp/prefix
cmake --install "$build" --prefix "$prefix" > "$tmp/install.log"
lib=$(ls -d "$prefix"/lib*/libveloxquant.so 2>/dev/null || true)
if [ -n "$lib" ]; then
  soname=$(readelf -d "$lib" | sed -n 's/.*SONAME.*\[\(.*\)\]/\1/p')
  case "$soname" in libveloxquant.so.[0-9]*) ;; *) echo "bad SONAME '$soname'"; exit 1 ;; esac
  libdir=$(dirname "$lib")
  static=
else
  static=--static
  libdir=$(dirname "$(ls -d "$prefix"/lib*/libveloxquant.a)")
fi
test -x "$prefix/bin/veloxquant"
"$prefix/bin/veloxquant" --version
# Nothing private: the installed headers are exactly include/veloxquant, and they include nothing
# but each other, the C/C++ standard library, <cpuid.h> (the compiler's) and fmt (a declared
# dependency): no src/ header, no nlohmann, zstd, xxhash, ...
if grep -rhoE '#include *[<"][^>"]*[>"]' "$prefix/include/veloxquant" | sed -E 's/#include *//' | sort -u \
    | grep -vE '^"veloxquant/|^<veloxquant/|^<fmt/|^<(cpuid|stddef|stdint)\.h>$|^<[a-z_]+>$' | grep .; then
  echo "installed headers include the above non-public files"; exit 1
fi
# One translation unit including every installed header (the all-in-one check; each header on
# its own was checked when the install was designed, see docs/c_api.md).
{ for h in $(cd "$prefix/include" && find veloxquant -name '*.hpp' -o -name '*.h' | sort); do echo "#include <$h>"; done; } > "$tmp/all.cpp"
"$cxx" -std=c++20 -fsyntax-only -I"$prefix/include" "$tmp/all.cpp"
# C: pkg-config only.
export PKG_CONFIG_PATH=$libdir/pkgconfig
"$cc" -std=c11 -Wall -Werror -o "$tmp/demo_c" "$here/c/demo.c" $(pkg-config $static --cflags --libs veloxquant) -lm -Wl,-rpath,"$libdir"
"$tmp/demo_c"
# C++: find_package only.
cmake -S "$here/cpp" -B "$tmp/cpp" -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_CXX_COMPILER="$cxx" \
  -DCMAKE_BUILD_RPATH="$libdir" > "$tmp/cpp-configure.log" || { cat "$tmp/cpp-configure.log"; exit 1; }
cmake --build "$tmp/cpp" > "$tmp/cpp-build.log" || { cat "$tmp/cpp-build.log"; exit 1; }
"$tmp/cpp/consumer"
echo "consumers: OK"
