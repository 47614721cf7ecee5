#!/bin/sh
# Prints, one a line, the Debian packages holding the shared libraries that the ELF files in
# BIN_DIR and LIB_DIR link (libraries in LIB_DIR itself excepted): what the Dockerfile's runtime
# stage installs. Run in the build stage, where the -dev packages pulled in the libraries.
#   usage: container-runtime-packages.sh BIN_DIR LIB_DIR
set -eu
bin_dir=$1
lib_dir=$2
libs=$(mktemp)
owners=$(mktemp)
trap 'rm -f "$libs" "$owners"' EXIT

for file in "$bin_dir"/* "$lib_dir"/*.so*; do
  [ -f "$file" ] && [ ! -L "$file" ] || continue
  # Only ELF files: the first four bytes are 0x7f 'E' 'L' 'F'.
  [ "$(head -c 4 "$file" | tail -c 3)" = "ELF" ] || continue
  out=$(LD_LIBRARY_PATH="$lib_dir" ldd "$file")
  if printf '%s\n' "$out" | grep -q 'not found'; then
    echo "container-runtime-packages: $file links a library that is not installed:" >&2
    printf '%s\n' "$out" | grep 'not found' >&2
    exit 1
  fi
  # "libfoo.so.1 => /lib/x86_64-linux-gnu/libfoo.so.1 (0x...)" and the loader's own line.
  printf '%s\n' "$out" | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}' >>"$libs"
done

sort -u "$libs" >"$libs.sorted"
mv "$libs.sorted" "$libs"
while read -r lib; do
  case "$lib" in "$lib_dir"/*) continue ;; esac
  real=$(readlink -f "$lib")
  # dpkg knows each file under the path its package ships it at: with merged /usr that may be
  # /lib/... or /usr/lib/..., whichever ldd printed.
  for candidate in "$lib" "$real" "/usr$lib" "/usr$real" "${lib#/usr}" "${real#/usr}"; do
    if owner=$(dpkg-query -S "$candidate" 2>/dev/null); then
      printf '%s\n' "${owner%%: *}" >>"$owners"
      continue 2
    fi
  done
  echo "container-runtime-packages: no Debian package holds $lib ($real)" >&2
  exit 1
done <"$libs"
tr ',' '\n' <"$owners" | sed 's/^ *//' | sort -u
