#!/usr/bin/env bash
# `make test-container`: builds the Dockerfile's stages for real in debootstrapped bookworm
# chroots (no Docker engine needed) and runs the resulting image's daemon, HEALTHCHECK and a
# client, then the Kubernetes manifests' containers, in the image's root. See
# tests/container/container_test.py. Needs root and the network (Debian mirror, PyPI).
#
# The debootstrap tarball and the package layers are cached under $TSM_CONTAINER_CACHE
# (default /var/cache/tensorshm-test-container): a rerun skips them. Safe to rerun; everything
# it mounts lives in a private mount namespace, unmounted on exit whatever happens.
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ "$(id -u)" -ne 0 ]; then
  echo "test-container: needs root (debootstrap, chroot, mounts)" >&2
  exit 1
fi
for tool in debootstrap unshare chroot mount; do
  command -v "$tool" >/dev/null || {
    echo "test-container: $tool not found (apt-get install debootstrap util-linux)" >&2
    exit 1
  }
done
python=python3
# The manifests' scenarios read YAML: the project's .venv has pyyaml.
[ -x .venv/bin/python ] && python=.venv/bin/python
cache=${TSM_CONTAINER_CACHE:-/var/cache/tensorshm-test-container}
# A private mount namespace: nothing mounted here is seen outside, and it all goes when the
# namespace's last process exits, even if the script is killed.
exec unshare --mount --propagation private \
  "$python" tests/container/container_test.py --cache "$cache" "$@"
