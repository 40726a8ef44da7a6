#!/usr/bin/env bash
# Run pipeline stages on an emulated x86-64 CPU and check their outputs against dvc.lock: the
# byte check for a CPU kind not at hand (benchmarks/RESULTS.md, "Emulated CPUs").
#
# qemu-user runs the stage process on the CPU model named (its CPUID: vendor, instruction sets;
# QEMU 7.2 emulates AVX2, not AVX-512), and computes the approximate instructions (rsqrtps,
# rcpps) exactly, where every real CPU approximates: bytes that match here depend on neither the
# vendor's MKL path nor those approximations. alignpipe reads the vendor from /proc/cpuinfo, which
# qemu-user leaves the host's, so a private mount shows it one naming the emulated CPU (root).
# About 25x slower than the host: rlvr takes 21 minutes on 2 cores.
#
# Usage: benchmarks/emulated_cpu.sh QEMU_CPU STAGE...   e.g. Skylake-Client-v4 rlvr rlhf
#   (qemu-x86_64 -cpu help lists the models; EPYC-Milan-v1 is AMD family 25 model 1, AVX2-only)
# Needs qemu-user (Debian: apt-get install qemu-user), root, and the stages' inputs in the
# workspace (dvc checkout). exit 0: every output as the committed dvc.lock has it; 1: some
# differ (listed; `dvc checkout` puts the committed ones back).
set -euo pipefail
[ $# -ge 2 ] || { sed -n 12,16p "$0" >&2; exit 2; }
cpu=$1; shift
command -v qemu-x86_64 >/dev/null || { echo "emulated_cpu: needs qemu-x86_64 (apt-get install qemu-user)" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "emulated_cpu: needs root, to mount a /proc/cpuinfo naming $cpu" >&2; exit 2; }
py=.venv/bin/python
[ -x $py ] || { echo "emulated_cpu: no .venv here; run make venv" >&2; exit 2; }

case $cpu in EPYC*|Opteron*|phenom*|athlon*) vendor=AuthenticAMD ;; *) vendor=GenuineIntel ;; esac
cpuinfo=$(mktemp)
trap 'rm -f "$cpuinfo"' EXIT
# The host's cpuinfo with the emulated vendor and name, and without what TCG cannot run.
$py - "$vendor" "$cpu" >"$cpuinfo" <<'EOF'
import sys
vendor, cpu = sys.argv[1:]
for line in open("/proc/cpuinfo").read().splitlines():
    key = line.partition(":")[0].strip()
    if key == "vendor_id":
        line = f"vendor_id\t: {vendor}"
    elif key == "model name":
        line = f"model name\t: {cpu} (qemu-user)"
    elif key == "flags":
        line = "flags\t\t: " + " ".join(f for f in line.partition(":")[2].split() if not f.startswith("avx512"))
    print(line)
EOF

export cpu cpuinfo py
unshare -m bash -euo pipefail -c '
  mount --bind "$cpuinfo" /proc/cpuinfo
  for stage in "${@}"; do
    echo "== $stage on $cpu (emulated)"
    PYTHONHASHSEED=0 qemu-x86_64 -cpu "$cpu" "$py" -m alignpipe run "$stage" 2> >(grep -v "^qemu-x86_64: warning" >&2)
  done' emulated "$@"

# What differs from the committed dvc.lock, file by file: DVC compares the workspace with HEAD.
changed=$(.venv/bin/dvc diff)
if [ -n "$changed" ]; then
  printf 'emulated_cpu: outputs differ from dvc.lock (`dvc checkout` puts the committed ones back):\n%s\n' "$changed" >&2
  exit 1
fi
echo "emulated_cpu: $*: every output as dvc.lock has it"
