#!/usr/bin/env bash
# Container tests (pytest -m container): podman with the runc runtime, debootstrap to build
# the local test image (no registry access), catatonit for `--init`. Idempotent. Not root (GitHub's
# runners: passwordless sudo), apt-get goes through sudo, and the test image's filesystem is built
# here (.ci/build-test-rootfs.sh), because the tests' own debootstrap needs root.
set -euo pipefail
need=()
for pkg in podman runc catatonit debootstrap uidmap; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || need+=("$pkg")
done
if [ "${#need[@]}" -gt 0 ]; then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  # Through env: sudo's env_reset drops variables set before it.
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}"
fi
podman --version
runc --version | head -1
if [ "$(id -u)" -ne 0 ]; then
  bash "$(dirname "${BASH_SOURCE[0]}")/build-test-rootfs.sh"
fi
