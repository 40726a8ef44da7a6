"""``ALIGNPIPE_TIMING``: when a stage process reached a point, for ``benchmarks/``."""

from __future__ import annotations

import json
import os
import sys
import time


def record_timing(stage: str, event: str, **extra: float) -> None:
    """``ALIGNPIPE_TIMING=<file>`` (or ``1`` for stderr): append how long after process start
    ``event`` happened, as a JSON line, with ``extra`` fields (e.g. a phase's ``seconds``).
    ``benchmarks/`` uses it for start-up overhead and the held-out share of a stage."""
    target = os.environ.get("ALIGNPIPE_TIMING")
    if not target:
        return
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    with open("/proc/self/stat") as f:
        started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    line = json.dumps(
        {
            "stage": stage,
            "event": event,
            "unix": time.time(),
            "since_process_start_s": round(uptime - started_ticks / os.sysconf("SC_CLK_TCK"), 2),
            "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
            # the process's high-water mark so far (Linux reports KiB): at "end", the stage's peak
            "peak_rss_mb": round(usage.ru_maxrss / 1024, 1),
            **{k: round(v, 2) for k, v in extra.items()},
        }
    )
    if target == "1":
        print(f"alignpipe-timing {line}", file=sys.stderr)
    else:
        with open(target, "a") as f:
            f.write(line + "\n")
