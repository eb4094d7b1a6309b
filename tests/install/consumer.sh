#!/usr/bin/env bash
# CTest install_consumer: installs the build into a temporary prefix, configures
# examples/cpp_consumer against it with find_package(flashmsa), builds and runs it.
#   consumer.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$1 src=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" > "$work/install.log"
test -f "$work/prefix/lib/cmake/flashmsa/flashmsaConfig.cmake" || test -f "$work/prefix/lib64/cmake/flashmsa/flashmsaConfig.cmake"
cmake -S "$src/examples/cpp_consumer" -B "$work/consumer" -G Ninja -DCMAKE_PREFIX_PATH="$work/prefix" \
  -DCMAKE_BUILD_TYPE=Release > "$work/configure.log" || { cat "$work/configure.log"; exit 1; }
cmake --build "$work/consumer" > "$work/build.log" || { cat "$work/build.log"; exit 1; }
"$work/consumer/flashmsa_consumer"
"$work/prefix/bin/flashmsa" --help > /dev/null  # the main job is installed too
