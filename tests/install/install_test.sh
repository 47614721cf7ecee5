#!/usr/bin/env bash
# Installs the build into a scratch prefix and builds programs against it three ways:
# tests/install/consumer with find_package(tensorshm CONFIG), the same main.cc by hand with
# `c++ -std=c++20 $(pkg-config --cflags --libs tensorshm)`, and tests/install/c_program (the C API)
# with `cc $(pkg-config ...)`. They exchange a tensor through the installed tensorshmd, each
# program's producer with the next one's consumer.
set -euo pipefail
build_dir=$1
consumer_src=$2
c_src=$(cd "$(dirname "$0")" && pwd)/c_program/main.c
cxx_flags=${3:-}
link_flags=${4:-}
work=$(mktemp -d /tmp/tsm-install-test.XXXXXX)
daemon_pid=
cleanup() {
  [ -n "$daemon_pid" ] && kill -TERM "$daemon_pid" 2>/dev/null && wait "$daemon_pid" || true
  rm -rf "$work"
}
trap cleanup EXIT

cmake --install "$build_dir" --prefix "$work/prefix" >/dev/null
test -f "$work/prefix/include/tensorshm/client.h"
test -f "$work/prefix/include/tensorshm/tensorshm.h"
test -f "$work/prefix/include/tensorshm/third_party/dlpack/dlpack.h"
test -x "$work/prefix/bin/tensorshmd"
pc_file=$(find "$work/prefix" -name tensorshm.pc -path '*/pkgconfig/*')
test -n "$pc_file"

cmake -S "$consumer_src" -B "$work/build" -DCMAKE_PREFIX_PATH="$work/prefix" \
  -DCMAKE_CXX_FLAGS="$cxx_flags" -DCMAKE_EXE_LINKER_FLAGS="$link_flags" >/dev/null
cmake --build "$work/build" -j2 >/dev/null

# Without CMake: only what tensorshm.pc says (and -std=c++20 for C++, as the README says).
export PKG_CONFIG_PATH
PKG_CONFIG_PATH=$(dirname "$pc_file")
[ "$(pkg-config --variable=prefix tensorshm)" = "$work/prefix" ]
pc_flags=$(pkg-config --cflags --libs tensorshm)
rpath="-Wl,-rpath,$(pkg-config --variable=libdir tensorshm)"
echo "pkg-config --cflags --libs tensorshm: $pc_flags"
# The library's own ABI: tensorshm.pc requires nothing, and the flags name no abseil.
[ -z "$(pkg-config --print-requires tensorshm)" ] || {
  echo "tensorshm.pc requires: $(pkg-config --print-requires tensorshm)" >&2
  exit 1
}
case "$pc_flags" in *absl*) echo "tensorshm.pc names abseil: $pc_flags" >&2; exit 1 ;; esac
# shellcheck disable=SC2086  # the flags are words
cc -Wall -Wextra -Werror $cxx_flags -o "$work/c_program" "$c_src" $pc_flags $rpath $link_flags
# shellcheck disable=SC2086
c++ -std=c++20 -Wall -Wextra -Werror $cxx_flags -o "$work/cxx_program" "$consumer_src/main.cc" \
  $pc_flags $rpath $link_flags

socket="$work/tensorshm.sock"
"$work/prefix/bin/tensorshmd" --socket "$socket" --host-pool 64Mi --segment-size 16Mi \
  --shm-prefix "tsmtest-install-$$" >"$work/daemon.log" 2>&1 &
daemon_pid=$!
for _ in $(seq 200); do
  grep -q "serving on" "$work/daemon.log" && break
  sleep 0.05
done
grep -q "serving on" "$work/daemon.log" || { cat "$work/daemon.log"; exit 1; }

# Each producer's tensor goes to the next program's consumer.
programs=("$work/build/tensorshm_consumer" "$work/cxx_program" "$work/c_program")
for i in 0 1 2; do
  producer=${programs[i]}
  consumer=${programs[(i + 1) % 3]}
  produced=$("$producer" produce "$socket" "installed/tensor$i")
  consumed=$("$consumer" consume "$socket" "installed/tensor$i")
  echo "$(basename "$producer") produced: $produced, $(basename "$consumer") consumed: $consumed"
  [ -n "$produced" ] && [ "$produced" = "$consumed" ]
done

kill -TERM "$daemon_pid"
wait "$daemon_pid"
daemon_pid=
echo "install test passed"
