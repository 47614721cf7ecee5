#!/usr/bin/env bash
# Makes the Debian base images the container tests build from, in the buildah store of
# tests/container/buildah-storage.sh: localhost/debian:bookworm and localhost/debian:bookworm-slim,
# or, given a suite (`base-images.sh trixie`), localhost/debian:<suite>.
# No image registry is reachable from the project's machines, only Debian's archive: the images
# are a minbase debootstrap of bookworm committed with buildah, which is also what the official
# debian:bookworm images are made from (debuerreotype; -slim only drops documentation, so here
# both names are the same image).
#
#   bash tests/container/base-images.sh          (bookworm)
#   bash tests/container/base-images.sh trixie   (test-packages installs the abi3 wheel there)
#   source tests/container/buildah-storage.sh
#   $BUILDAH from --pull=never localhost/debian:bookworm
#
# Idempotent: an image already in the store is kept, and the debootstrap tarball is cached as
# $TSM_CONTAINER_CACHE/<suite>-minbase.tar, so a rerun downloads nothing. Installs buildah and
# debootstrap when missing. Fetches from the Debian archive the host's apt uses
# (TSM_DEBIAN_MIRROR overrides). Needs root. Exits non-zero, saying why, on any failure. To make
# them again (another mirror, new host CA certificates):
#   $BUILDAH rmi localhost/debian:bookworm localhost/debian:bookworm-slim
set -euo pipefail
cd "$(dirname "$0")/../.."
source tests/container/buildah-storage.sh

suite=${1:-bookworm}
case $suite in
  bookworm) images=(localhost/debian:bookworm localhost/debian:bookworm-slim) ;;
  *) images=("localhost/debian:$suite") ;;
esac
tarball=$TSM_CONTAINER_CACHE/$suite-minbase.tar

say() { echo "base-images: $*"; }
fail() {
  echo "base-images: FAILED: $*" >&2
  exit 1
}
trap 'echo "base-images: FAILED: line $LINENO: $BASH_COMMAND" >&2' ERR

[ "$(id -u)" -eq 0 ] || fail "needs root (debootstrap, buildah's store in $TSM_CONTAINER_CACHE)"

missing=()
for p in buildah debootstrap; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  say "installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq || fail "apt-get update"
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null ||
    fail "apt-get install ${missing[*]}"
fi

# The Debian archive this machine's apt uses (deb822 .sources or sources.list lines): the main
# archive, not -security or others.
host_mirror() {
  local uri
  for uri in $( (cat /etc/apt/sources.list.d/*.sources 2>/dev/null || true) |
    awk '$1 == "URIs:" { for (i = 2; i <= NF; i++) print $i }') \
    $( (cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null || true) |
      awk '$1 == "deb" { print ($2 ~ /^\[/ ? $3 : $2) }'); do
    case ${uri%/} in
      */debian) echo "$uri" && return 0 ;;
    esac
  done
  return 1
}

have_image() { $BUILDAH inspect --type image "$1" >/dev/null 2>&1; }

# One at a time (test-container and test-packages may run at once): a second waits, then finds
# the images made.
mkdir -p "$TSM_CONTAINER_CACHE"
exec 9>"$TSM_CONTAINER_CACHE/base-images.lock"
flock 9

if have_image "${images[0]}" && have_image "${images[-1]}"; then
  say "cached in $TSM_CONTAINER_CACHE/storage: ${images[*]}"
  exit 0
fi

mirror=${TSM_DEBIAN_MIRROR:-$(host_mirror)} ||
  fail "no Debian archive in /etc/apt's sources; set TSM_DEBIAN_MIRROR"

if [ -f "$tarball" ]; then
  say "cached debootstrap tarball $tarball"
else
  say "debootstrap --variant=minbase --make-tarball $suite from $mirror"
  scratch=$TSM_CONTAINER_CACHE/make-tarball
  rm -rf "$scratch" "$tarball.partial"
  debootstrap --variant=minbase --make-tarball="$tarball.partial" "$suite" "$scratch" "$mirror" \
    >"$TSM_CONTAINER_CACHE/debootstrap.log" 2>&1 ||
    fail "debootstrap --make-tarball (log: $TSM_CONTAINER_CACHE/debootstrap.log)"
  rm -rf "$scratch"
  mv "$tarball.partial" "$tarball"
fi

# The working container, removed on exit whatever happens (and here, if a killed run left it).
container=tsm-base-image-$suite
$BUILDAH rm "$container" >/dev/null 2>&1 || true
trap '$BUILDAH rm "$container" >/dev/null 2>&1 || true' EXIT

say "buildah from scratch; debootstrap --unpack-tarball into its root"
$BUILDAH from --name "$container" scratch >/dev/null || fail "buildah from scratch"
root=$($BUILDAH mount "$container") || fail "buildah mount $container"
# debootstrap mounts /proc and /sys in the root while it installs: in a mount namespace of its
# own, they go with it whatever happens.
unshare --mount --propagation private \
  debootstrap --variant=minbase --unpack-tarball="$tarball" "$suite" "$root" "$mirror" \
  >"$TSM_CONTAINER_CACHE/debootstrap.log" 2>&1 ||
  fail "debootstrap --unpack-tarball (log: $TSM_CONTAINER_CACHE/debootstrap.log)"
# As the official images: no service starts during package installs; no package lists or
# downloaded packages in the image.
printf '#!/bin/sh\nexit 101\n' >"$root/usr/sbin/policy-rc.d"
chmod 0755 "$root/usr/sbin/policy-rc.d"
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/archives/*.deb
# Where this host reaches the network through a TLS-inspecting proxy, builds on it need the
# proxy's CA as much as the host does: the host's local CA certificates (added to the bundle when
# an image installs ca-certificates) and its pip configuration go into these local images, as an
# organisation's own base images carry its CA. Images elsewhere come from Docker Hub unchanged.
trust=()
for crt in /usr/local/share/ca-certificates/*.crt; do
  [ -f "$crt" ] || continue
  install -D -m 0644 "$crt" "$root/usr/local/share/ca-certificates/$(basename "$crt")"
  trust+=("$crt")
done
if [ -f /etc/pip.conf ]; then
  install -m 0644 /etc/pip.conf "$root/etc/pip.conf"
  trust+=(/etc/pip.conf)
fi
[ ${#trust[@]} -eq 0 ] || say "the host's network trust in the images: ${trust[*]}"
$BUILDAH umount "$container" >/dev/null
$BUILDAH config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  --cmd bash --label "tensorshm.base-image=debootstrap --variant=minbase $suite $mirror" \
  "$container" ||
  fail "buildah config"
say "buildah commit ${images[0]}"
$BUILDAH commit --quiet "$container" "${images[0]}" >/dev/null ||
  fail "buildah commit ${images[0]}"
if [ ${#images[@]} -gt 1 ]; then
  $BUILDAH tag "${images[0]}" "${images[1]}" || fail "buildah tag ${images[1]}"
fi
say "made ${images[*]} ($($BUILDAH images --noheading --format "{{.Size}}" "${images[0]}" | head -n 1))"
