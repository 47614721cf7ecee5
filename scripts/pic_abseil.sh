#!/usr/bin/env bash
# Builds position-independent static abseil libraries into .deps/abseil-pic/lib, from Debian's
# source package of the very version of libabsl-dev installed (same headers, same options.h).
# libtensorshm.so links them, hidden behind its version script, so that it NEEDS no libabsl:
# Debian's own libabsl_*.a are built for executables (local-exec TLS in libabsl_base.a and
# others), which a shared library cannot take. Safe to run again: it rebuilds only when the
# installed libabsl-dev changed. Called by scripts/setup.sh (as root: it adds a deb-src list).
set -euo pipefail
cd "$(dirname "$0")/.."

version=$(dpkg-query -W -f='${Version}' libabsl-dev)
out=.deps/abseil-pic
if [ -f "$out/VERSION" ] && [ "$(cat "$out/VERSION")" = "$version" ]; then
  exit 0
fi
echo "setup: building position-independent static abseil $version (for libtensorshm.so)"

# Debian's source packages of the release this machine runs: a list of our own beside the
# system's, for the suites and mirror its deb lines name.
sources=/etc/apt/sources.list.d/tensorshm-deb-src.sources
if ! apt-get source --print-uris "abseil=$version" >/dev/null 2>&1; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "setup: need root to add Debian's source list $sources" >&2
    exit 1
  fi
  . /etc/os-release
  cat >"$sources" <<LIST
# Added by tensorshm's scripts/pic_abseil.sh: the source of libabsl-dev, built as PIC.
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: ${VERSION_CODENAME} ${VERSION_CODENAME}-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb-src
URIs: http://deb.debian.org/debian-security
Suites: ${VERSION_CODENAME}-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
LIST
  apt-get update -qq
fi

work=.deps/abseil-src
rm -rf "$work" "$out"
mkdir -p "$work"
# As root apt warns that it downloads unsandboxed (the _apt user cannot write here): not news.
(cd "$work" && apt-get source -qq --download-only "abseil=$version" 2>&1 |
  grep -v "^W: Download is performed unsandboxed" || true)
dsc=$(ls "$work"/abseil_*.dsc 2>/dev/null || true)
if [ -z "$dsc" ]; then
  echo "setup: could not download Debian's source of abseil $version (apt-get source abseil=$version)" >&2
  exit 1
fi
# apt checked the files against the signed Sources index; the .dsc signature is not needed.
dpkg-source -x "$dsc" "$work/src" >/dev/null 2>&1
# As Debian builds it (debian/rules: C++17, static), plus -fPIC.
cmake -S "$work/src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_STANDARD=17 \
  -DBUILD_SHARED_LIBS=OFF -DCMAKE_POSITION_INDEPENDENT_CODE=ON -DBUILD_TESTING=OFF \
  -DABSL_PROPAGATE_CXX_STD=ON >/dev/null
# What the client library uses (status, strings, str_format, time, synchronization) and what
# those need.
cmake --build "$work/build" -j"${JOBS:-2}" --target status statusor strings str_format_internal \
  time synchronization cord >/dev/null
mkdir -p "$out/lib"
find "$work/build" -name 'libabsl_*.a' -exec cp {} "$out/lib/" \;
echo "$version" >"$out/VERSION"
rm -rf "$work"
