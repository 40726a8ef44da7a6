#!/usr/bin/env bash
# Cache keys CI's actions/cache steps use, as step outputs (`bash .ci/cache-keys.sh >>"$GITHUB_OUTPUT"`):
#   nemo-rl=<digests>  the NeMo-RL v0.7.0 source the tests extract into ~/.cache/alignpipe/upstream
#                      (tests/conftest.py: its pinned tree digest and the vendored archive's sha256,
#                      which names the cache entry); a new pin is a new key.
set -euo pipefail
conftest="$(dirname "${BASH_SOURCE[0]}")/../tests/conftest.py"
pin() {  # NAME: the 64-hex value of `NAME = "..."` in tests/conftest.py
  local value
  value="$(sed -n "s/^$1 = \"\([0-9a-f]\{64\}\)\"\$/\1/p" "$conftest")"
  [ -n "$value" ] || { echo "cache-keys: no $1 in tests/conftest.py" >&2; exit 1; }
  echo "$value"
}
echo "nemo-rl=nemo-rl-v0.7.0-$(pin NEMO_RL_TREE_SHA256)-$(pin VENDORED_NEMO_RL_SHA256 | cut -c1-12)"
