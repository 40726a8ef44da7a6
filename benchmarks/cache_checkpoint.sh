#!/usr/bin/env bash
# How DVC takes a large multi-file checkpoint into its cache with the project's link type
# (`cache.type hardlink,symlink` in .dvc/config), compared with md5sum of the same files.
#
# A synthetic checkpoint (default 8 x 256 MiB = 2 GiB of random bytes, like safetensors shards)
# is written to a throwaway DVC repo on the same filesystem as the workdir. Then:
#   1. the files are read once, so both measurements start with a warm page cache;
#   2. `md5sum` over the files (one process, sequential);
#   3. `dvc add ckpt` (hash, move into .dvc/cache, link back);
#   4. disk use: `df` before and after, `du` of workspace+cache counted once, link counts.
# With hard links the cache and the workspace share the inodes, so no second copy is written.
#
# Usage: benchmarks/cache_checkpoint.sh [WORKDIR] [N_FILES] [MIB_PER_FILE]
# Output: a JSON line on stdout (benchmarks/run_all.sh stores it in benchmarks/results/).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
# Default: a fresh directory from mktemp (under $TMPDIR); the 2 GiB it writes is removed below.
work="${1:-$(mktemp -d -t alignpipe-cache.XXXXXX)}"
n="${2:-8}"
mib="${3:-256}"
dvc="${DVC:-$here/.venv/bin/dvc}"

rm -rf "$work"
mkdir -p "$work/repo/ckpt"
cd "$work/repo"
git init -q
"$dvc" init -q
# The project's cache settings (link type), exactly as committed.
cp "$here/.dvc/config" .dvc/config
"$dvc" config core.autostage false
"$dvc" config core.analytics false

for i in $(seq 1 "$n"); do
  head -c "$((mib * 1024 * 1024))" /dev/urandom > "ckpt/model-$(printf %05d "$i")-of-$(printf %05d "$n").safetensors"
done
printf '{"metadata": {"total_size": %d}}\n' "$((n * mib * 1024 * 1024))" > ckpt/model.safetensors.index.json
sync
cat ckpt/* > /dev/null   # warm page cache for both measurements

avail_before=$(df --output=avail -B1 . | tail -1)
t0=$(date +%s.%N)
md5sum ckpt/* > /dev/null
t1=$(date +%s.%N)
/usr/bin/time -f "%e %U %S" -o "$work/dvc_add.time" "$dvc" add -q ckpt
t2=$(date +%s.%N)
sync
avail_after=$(df --output=avail -B1 . | tail -1)

link_type=$("$dvc" config cache.type)
first=$(ls ckpt/*.safetensors | head -1)
nlink=$(stat -c %h "$first")
ws_bytes=$(du -sb ckpt | cut -f1)
both_bytes=$(du -sb ckpt .dvc/cache | awk '{s+=$1} END {printf "%d", s}')   # du counts a shared inode once
read -r add_wall add_user add_sys < "$work/dvc_add.time"
python3 - "$n" "$mib" "$t0" "$t1" "$t2" "$avail_before" "$avail_after" "$link_type" "$nlink" "$ws_bytes" \
  "$both_bytes" "$add_user" "$add_sys" <<'PY'
import json, os, sys, time
n, mib, t0, t1, t2, before, after, link, nlink, ws, both, user, sys_ = sys.argv[1:]
md5 = float(t1) - float(t0)
add = float(t2) - float(t1)
print(json.dumps({
    "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    "loadavg_1_5_15": [round(x, 2) for x in os.getloadavg()],
    "files": int(n), "mib_per_file": int(mib), "total_gib": round(int(n) * int(mib) / 1024, 2),
    "cache_type": link, "link_count_of_a_shard": int(nlink),
    "md5sum_s": round(md5, 2), "dvc_add_s": round(add, 2), "dvc_add_cpu_s": round(float(user) + float(sys_), 2),
    "ratio_dvc_add_over_md5sum": round(add / md5, 2),
    "df_used_delta_mib": round((int(before) - int(after)) / 2**20, 1),
    "du_workspace_mib": round(int(ws) / 2**20, 1), "du_workspace_plus_cache_mib": round(int(both) / 2**20, 1),
}))
PY
cd / && rm -rf "$work"
