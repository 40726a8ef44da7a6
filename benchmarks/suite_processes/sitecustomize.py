"""Log every Python process of a test run at its exit: wall and CPU seconds, its command line,
and the test that started it (``PYTEST_CURRENT_TEST``, which subprocesses inherit).

Used for one measuring run only (benchmarks/suite_processes.py); not part of the package:

    PYTHONPATH=$PWD/benchmarks/suite_processes SUITE_PROCESS_LOG=$PWD/build/procs.jsonl make test

A process killed with SIGKILL (the resume tests' kills) never reaches ``atexit`` and is not logged.
"""

import atexit
import json
import os
import resource
import sys
import time

_LOG = os.environ.get("SUITE_PROCESS_LOG")
_START = time.time()


def _record() -> None:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    row = {
        "pid": os.getpid(),
        "start": round(_START, 2),  # epoch seconds: what ran at the same time as what
        "wall_s": round(time.time() - _START, 2),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
        "argv": " ".join(sys.argv)[:300],
        "cwd": os.getcwd(),
        "test": os.environ.get("PYTEST_CURRENT_TEST", ""),
        "pytest": "_pytest" in sys.modules,  # a pytest process (or worker), not one a test started
    }
    try:
        with open(_LOG, "a") as f:  # one short append per process: lines do not interleave
            f.write(json.dumps(row) + "\n")
    except OSError:
        pass


if _LOG:
    atexit.register(_record)
