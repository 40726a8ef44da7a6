"""Symbolic math verification with HF ``math-verify``, in reused worker processes.

Scoring matches NeMo-RL v0.7.0's ``hf_math_verify`` (``math_environment.py``): the gold answer
is wrapped as ``\\boxed{gt}`` and parsed with ``LatexExtractionConfig``; the prediction with
``ExprExtractionConfig`` + ``LatexExtractionConfig``; ``math_metric(...)([gold], [pred])``
gives 1.0 or 0.0, and any exception or math-verify timeout gives 0.0.

math-verify times itself out with ``signal.alarm``, which only works in a process's main
thread. So every item runs in the main thread of a worker process (``forkserver`` start
method on Linux, ``spawn`` elsewhere: never ``fork`` from a parent that may hold torch/CUDA
threads). The parent enforces its own per-item wall-clock deadline on top: a worker that
overruns it (stuck in C code, or the alarm was swallowed) is killed and replaced, and a worker
that dies is replaced; both items score 0.0 and are reported (``logging`` warning, and
:attr:`WorkerPool.stats`).

The pool is created lazily on first use, reused across calls (GRPO scores many completions
per step), re-created after a ``fork`` of the parent, and shut down at interpreter exit.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import os
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "ItemResult",
    "WorkerPool",
    "get_math_pool",
    "math_verify_one",
    "shutdown_math_pool",
    "verify_math_batch",
    "verify_math_detailed",
]

# Per-item wall-clock limit enforced by the parent. math-verify's own alarms are 5 s for
# parsing and 5 s for verification; this catches whatever they miss.
DEFAULT_TIMEOUT_S = float(os.environ.get("ALIGNPIPE_MATH_TIMEOUT_S", "15"))
# A new worker gets this long to start (interpreter + imports) before its first item's clock.
STARTUP_TIMEOUT_S = 120.0


def _default_workers() -> int:
    env = os.environ.get("ALIGNPIPE_MATH_WORKERS")
    if env:
        return max(1, int(env))
    return max(1, min(4, os.cpu_count() or 1))


@dataclass(frozen=True)
class ItemResult:
    """Outcome of one item: ``status`` is ``ok``, ``timeout``, ``crash`` or ``error``."""

    score: float
    status: str
    detail: str = ""


# --------------------------------------------------------------------------- worker side

_METRIC: Callable | None = None


def math_verify_one(gold: str, pred: str) -> float:
    """Score one (gold, prediction) pair exactly like NeMo-RL's ``HFVerifyWorker``.

    Must run in a process's main thread (math-verify uses ``signal.alarm``).
    """
    global _METRIC
    from math_verify.errors import TimeoutException

    if _METRIC is None:
        from math_verify.metric import math_metric
        from math_verify.parser import ExprExtractionConfig, LatexExtractionConfig

        _METRIC = math_metric(
            gold_extraction_target=(LatexExtractionConfig(),),
            pred_extraction_target=(ExprExtractionConfig(), LatexExtractionConfig()),
        )
    try:
        score, _ = _METRIC(["\\boxed{" + str(gold) + "}"], [str(pred)])
    except (Exception, TimeoutException):
        return 0.0
    return float(score)


def warm_math_verify() -> None:
    """Import math-verify and parse and verify one pair with its alarms off, before the worker
    reports ready: on a loaded machine the first item's imports (about 1 s on an idle core) ran
    past the per-item deadline, and two correct answers scored 0 (benchmarks/RESULTS.md)."""
    from math_verify import parse, verify

    verify(parse("\\boxed{\\frac{1}{2}}", parsing_timeout=None), parse("$0.5$", parsing_timeout=None),
           timeout_seconds=None)  # fmt: skip
    math_verify_one("1", "1")


def _worker_main(conn: Connection, fn: Callable[..., Any], warm_up: Callable[[], None] | None = None) -> None:
    """Worker loop: receive an argument tuple, send back ``("ok", value)`` or ``("error", msg)``.
    ``warm_up()`` runs first, inside the start-up allowance, not an item's deadline."""
    # Quiet math-verify's "could not extract" warnings: they are per-item noise.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    if warm_up is not None:
        try:
            warm_up()
        except Exception:  # noqa: BLE001 - the items will report what is wrong
            pass
    try:
        conn.send(("ready", os.getpid()))
    except (BrokenPipeError, OSError):
        return
    while True:
        try:
            args = conn.recv()
        except (EOFError, OSError, KeyboardInterrupt):
            return
        if args is None:
            return
        try:
            out = ("ok", fn(*args))
        except BaseException as e:  # noqa: BLE001 - report everything, keep serving
            out = ("error", f"{type(e).__name__}: {e}")
        try:
            conn.send(out)
        except (BrokenPipeError, OSError):
            return


# --------------------------------------------------------------------------- parent side


class _Worker:
    __slots__ = ("proc", "conn", "task", "deadline", "ready")

    def __init__(self, ctx, fn: Callable[..., Any], warm_up: Callable[[], None] | None = None) -> None:
        parent, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_worker_main, args=(child, fn, warm_up), daemon=True)
        self.proc.start()
        child.close()
        self.conn: Connection = parent
        self.task: int | None = None
        self.deadline = 0.0
        self.ready = False  # the per-item clock starts only once the worker has started

    def kill(self) -> None:
        try:
            self.conn.close()
        except OSError:
            pass
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5)

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except (BrokenPipeError, OSError):
            pass
        self.proc.join(timeout=2)
        self.kill()


class WorkerPool:
    """A small pool of worker processes running ``fn(*args)``, one item at a time each.

    Unlike ``ProcessPoolExecutor``, every item has its own wall-clock deadline, and a worker
    that overruns it is killed and replaced without disturbing the other items.

    ``fn`` must be picklable by reference (a module-level function). ``map`` is thread-safe
    (calls are serialized).
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        num_workers: int | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        start_method: str | None = None,
        warm_up: Callable[[], None] | None = None,
    ) -> None:
        self.fn = fn
        self.warm_up = warm_up  # run by each worker before it is ready (module-level, picklable)
        self.num_workers = num_workers or _default_workers()
        self.timeout_s = timeout_s
        if start_method is None:
            start_method = "forkserver" if sys.platform.startswith("linux") else "spawn"
        self._ctx = mp.get_context(start_method)
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self.stats: Counter[str] = Counter()
        self.closed = False

    def _spawn(self) -> _Worker:
        return _Worker(self._ctx, self.fn, self.warm_up)

    def map(
        self,
        arg_tuples: Sequence[tuple],
        timeout_s: float | None = None,
        default: Any = 0.0,
    ) -> list[ItemResult]:
        """Run ``fn(*args)`` for each tuple; results in order.

        Timeouts, worker crashes and exceptions give ``ItemResult(default, status, detail)``.
        """
        if self.closed:
            raise RuntimeError("WorkerPool is shut down")
        limit = self.timeout_s if timeout_s is None else timeout_s
        n = len(arg_tuples)
        results: list[ItemResult | None] = [None] * n
        if n == 0:
            return []
        with self._lock:
            while len(self._workers) < min(self.num_workers, n):
                self._workers.append(self._spawn())
            pending = deque(range(n))
            busy: dict[Connection, _Worker] = {}

            def dispatch(w: _Worker) -> bool:
                while pending:
                    i = pending.popleft()
                    try:
                        w.conn.send(arg_tuples[i])
                    except (BrokenPipeError, OSError):
                        pending.appendleft(i)
                        return False
                    w.task = i
                    w.deadline = time.monotonic() + (limit if w.ready else STARTUP_TIMEOUT_S)
                    busy[w.conn] = w
                    return True
                return True

            def replace(w: _Worker) -> None:
                busy.pop(w.conn, None)
                w.kill()
                idx = self._workers.index(w)
                self._workers[idx] = nw = self._spawn()
                if not dispatch(nw):  # a fresh worker that cannot take work: give up on it
                    raise RuntimeError("math-verify worker could not be started")

            for w in list(self._workers):
                if not dispatch(w):
                    replace(w)
            while busy:
                now = time.monotonic()
                next_deadline = min(w.deadline for w in busy.values())
                ready = wait(list(busy), timeout=max(0.0, next_deadline - now))
                for conn in ready:
                    w = busy[conn]
                    i = w.task
                    try:
                        status, value = conn.recv()
                    except (EOFError, OSError):
                        w.proc.join(timeout=1)
                        code = w.proc.exitcode
                        results[i] = ItemResult(default, "crash", f"worker died (exit code {code})")
                        self._report("crash", i, results[i].detail)
                        replace(w)
                        continue
                    if status == "ready":
                        w.ready = True
                        w.deadline = time.monotonic() + limit
                        continue
                    if status == "ok":
                        results[i] = ItemResult(value, "ok")
                    else:
                        results[i] = ItemResult(default, "error", str(value))
                        self._report("error", i, str(value))
                    busy.pop(conn)
                    w.task = None
                    if not dispatch(w):
                        replace(w)
                now = time.monotonic()
                for w in [w for w in busy.values() if w.deadline <= now and w.conn not in ready]:
                    i = w.task
                    what = f"no result within {limit:g} s" if w.ready else "worker did not start"
                    results[i] = ItemResult(default, "timeout", what)
                    self._report("timeout", i, results[i].detail)
                    replace(w)
        for s in results:
            self.stats[s.status] += 1
        return results  # type: ignore[return-value]

    def _report(self, status: str, index: int, detail: str) -> None:
        log.warning("reward worker item %d: %s (%s); scored 0", index, status, detail)

    def shutdown(self) -> None:
        with self._lock:
            workers, self._workers = self._workers, []
            self.closed = True
        if os.getpid() != self._pid:  # inherited through fork: not ours to stop
            return
        for w in workers:
            w.stop()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


# --------------------------------------------------------------------------- module pool

_POOL: WorkerPool | None = None
_POOL_LOCK = threading.Lock()


def get_math_pool() -> WorkerPool:
    """The process-wide math-verify pool (created on first use, replaced after a fork)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL.closed or _POOL._pid != os.getpid():
            _POOL = WorkerPool(math_verify_one, warm_up=warm_math_verify)
        return _POOL


def shutdown_math_pool() -> None:
    """Stop the process-wide pool's workers (also registered with ``atexit``)."""
    global _POOL
    with _POOL_LOCK:
        pool, _POOL = _POOL, None
    if pool is not None:
        pool.shutdown()


atexit.register(shutdown_math_pool)


def verify_math_detailed(
    golds: Sequence[str], preds: Sequence[str], timeout_s: float | None = None
) -> list[ItemResult]:
    """Per-item results (score, status ``ok``/``timeout``/``crash``/``error``, detail)."""
    if len(golds) != len(preds):
        raise ValueError(f"{len(golds)} golds but {len(preds)} predictions")
    args = [(str(g), "" if p is None else str(p)) for g, p in zip(golds, preds, strict=True)]
    return get_math_pool().map(args, timeout_s=timeout_s)


def verify_math_batch(
    golds: Sequence[str], preds: Sequence[str], timeout_s: float | None = None
) -> list[float]:
    """Scores (1.0/0.0) for each (gold, prediction) pair; timeouts and crashes score 0.0."""
    return [float(r.score) for r in verify_math_detailed(golds, preds, timeout_s)]


def gold_parses(gold: str) -> bool:
    """Whether math-verify reads ``gold`` as math the way :func:`math_verify_one` reads golds
    (``\\boxed{gold}``, ``LatexExtractionConfig``); text it cannot parse comes back as a bare
    string, and then every prediction scores 0."""
    from math_verify import parse
    from math_verify.parser import LatexExtractionConfig

    parsed = parse("\\boxed{" + str(gold) + "}", extraction_config=[LatexExtractionConfig()])
    return any(not isinstance(p, str) for p in parsed)


def golds_parse(golds: Sequence[str], timeout_s: float | None = None) -> list[bool]:
    """:func:`gold_parses` for each gold: in this process from the main thread (math-verify's
    ``signal.alarm`` works there), else in a worker process. A gold whose parse times out does
    not parse; a worker that crashes is an error, not a verdict on the data."""
    if threading.current_thread() is threading.main_thread():
        from math_verify.errors import TimeoutException

        out = []
        for g in golds:
            try:
                out.append(gold_parses(g))
            except TimeoutException:
                out.append(False)
        return out
    pool = WorkerPool(gold_parses, num_workers=1)
    try:
        results = pool.map([(g,) for g in golds], timeout_s, False)
    finally:
        pool.shutdown()
    broken = [r for r in results if r.status in ("crash", "error")]
    if broken:
        raise RuntimeError(f"the math gold check could not run: {broken[0].status}: {broken[0].detail}")
    return [r.status == "ok" and r.score is True for r in results]
