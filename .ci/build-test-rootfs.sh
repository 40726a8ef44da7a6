#!/usr/bin/env bash
# The container tests' image filesystem, ahead of the tests, where they cannot build it: they run
# `debootstrap` themselves (tests/test_container.py, build_rootfs_tar), which needs root, and on
# GitHub's runners the suite runs as an unprivileged user with passwordless sudo. Here debootstrap
# and tar run through sudo, and the tarball lands where the tests look, owned by the user, so
# they reuse it; they import it into the user's own (rootless) podman. As root this builds the
# same tarball the tests would. Idempotent: an existing tarball is left alone.
# Usage: .ci/build-test-rootfs.sh [--print-packages]   (the --include list, read from the tests)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# The package list is the tests' own ROOTFS_PACKAGES (one place), read without importing them.
packages="$(python3 - "$repo/tests/test_container.py" <<'PY'
import ast, sys
tree = ast.parse(open(sys.argv[1]).read())
for node in tree.body:
    if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "ROOTFS_PACKAGES" for t in node.targets):
        print(ast.literal_eval(node.value))
        break
else:
    sys.exit("build-test-rootfs: no ROOTFS_PACKAGES in tests/test_container.py")
PY
)"
if [ "${1:-}" = --print-packages ]; then
  echo "$packages"
  exit 0
fi
# tests/test_container.py: CACHE / "bookworm-python-libs.tar", debootstrap of bookworm from deb.debian.org
cache="$HOME/.cache/alignpipe/container"
tar="$cache/bookworm-python-libs.tar"
if [ -f "$tar" ]; then
  echo "install-container: test rootfs present ($tar)"
  exit 0
fi
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
mkdir -p "$cache"
work="$(mktemp -d "$cache/.rootfs-XXXXXX")"
trap '$SUDO rm -rf "$work"' EXIT
$SUDO debootstrap --variant=minbase "--include=$packages" bookworm "$work/root" http://deb.debian.org/debian \
  >"$work/debootstrap.log" 2>&1 || { cat "$work/debootstrap.log" >&2; exit 1; }
$SUDO tar -C "$work/root" -cf "$work/rootfs.tar" .
$SUDO chown "$(id -u):$(id -g)" "$work/rootfs.tar"
mv "$work/rootfs.tar" "$tar"
echo "install-container: test rootfs built ($tar, $(du -h "$tar" | cut -f1))"
