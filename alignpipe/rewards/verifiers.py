"""Verifiers: score one completion against a prepared row, 1.0 correct / 0.0 wrong.

Row schema (``data/prepared/rlvr/*.jsonl``): ``answer`` (str), ``verifier`` (one of
:data:`VERIFIERS`, default ``"exact"``), optional ``tests`` (Python asserts, for ``code``),
optional ``extract: boxed`` (``exact``/``numeric`` score the last ``\\boxed{...}`` of the
completion, as NeMo-RL's math environment and NeMo-Gym's ``math_with_judge`` read answers;
no box scores 0.0).

``exact`` and ``numeric`` are pure, in-process and take microseconds. ``math`` runs HF
math-verify in a reused worker-process pool (it uses ``signal.alarm``), ``code`` runs the
completion plus the row's tests in a sandboxed subprocess. Both heavy modules are imported
lazily, so importing this module costs nothing.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

__all__ = [
    "ROW_FIELDS",
    "VERIFIERS",
    "UnknownVerifierError",
    "Verifier",
    "boxed_answer",
    "exact_match",
    "get_verifier",
    "numeric_match",
    "parse_number",
    "score_completion",
    "score_completions",
]

# Every row field scoring reads besides the answer. Whatever carries rows to a verifier (the
# local reward function's columns, the NeMo-RL environment's extra_env_info) carries these: a
# field lost on the way scores the row differently (extract: boxed, a code row's sandbox limits).
ROW_FIELDS = ("verifier", "extract", "tests", "sandbox", "abs_tol", "rel_tol", "task")

DEFAULT_VERIFIER = "exact"
NUMERIC_REL_TOL = 1e-6
NUMERIC_ABS_TOL = 1e-9


class UnknownVerifierError(KeyError, ValueError):
    """A row names a verifier that is not in :data:`VERIFIERS`."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "unknown verifier"


# --------------------------------------------------------------------------- extraction


def boxed_answer(completion: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (nested braces balanced), or None."""
    start = completion.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(completion)):
        depth += {"{": 1, "}": -1}.get(completion[j], 0)
        if depth == 0:
            return completion[i:j]
    return None


def _answer_text(row: dict, completion: str | None) -> str | None:
    """What ``exact``/``numeric`` compare: the completion, or its boxed answer (``extract: boxed``)."""
    if completion is None:
        return None
    extract = row.get("extract")
    if extract is None:
        return str(completion)
    if extract == "boxed":
        return boxed_answer(str(completion))
    raise ValueError(f"row field extract={extract!r}: the only extraction is 'boxed'")


# --------------------------------------------------------------------------- exact


def exact_match(row: dict, completion: str) -> float:
    """1.0 iff ``completion.strip() == str(row["answer"]).strip()`` (its boxed answer with ``extract: boxed``)."""
    text = _answer_text(row, completion)
    if text is None:
        return 0.0
    return 1.0 if text.strip() == str(row["answer"]).strip() else 0.0


# --------------------------------------------------------------------------- numeric

# "1,234,567.89": commas only in proper thousands positions (so "1,2" stays non-numeric).
_THOUSANDS = re.compile(r"^[+-]?\d{1,3}(?:,\d{3})+(?:\.\d*)?$")
_THIN_SPACES = str.maketrans("", "", "_\u2009\u202f\u00a0'")
_FRACTION = re.compile(r"^([+-]?\d+(?:\.\d+)?)\s*/\s*([+-]?\d+(?:\.\d+)?)$")
_FLOAT = re.compile(r"^[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?$")


def parse_number(value: Any) -> float | None:
    """Parse ``value`` as a number, or return ``None`` if it is not one.

    Accepts ints/floats, and strings after stripping whitespace: thousands separators
    (``1,000``, ``1_000``, ``1 000`` with thin/no-break spaces, ``1'000``), a leading ``+``,
    decimals, scientific notation and simple fractions (``1/2``, ``-3 / 4``). Anything else
    (words, units, empty strings, ``nan``) is not a number.
    """
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int | float | Fraction):
        f = float(value)
        return None if math.isnan(f) else f
    s = str(value).strip()
    if not s:
        return None
    if _FLOAT.match(s):  # the common case first
        return float(s)
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    s = s.translate(_THIN_SPACES)
    if _FLOAT.match(s):
        return float(s)
    m = _FRACTION.match(s)
    if m:
        a, b = m.group(1), m.group(2)
        if "." not in a and "." not in b:  # integers: exact, and no Fraction overhead
            num, den = int(a), int(b)
        else:
            num, den = Fraction(a), Fraction(b)
        if den == 0:
            return None
        return float(num / den)
    return None


def numeric_match(row: dict, completion: str) -> float:
    """1.0 iff completion and ``row["answer"]`` parse as numbers that agree within tolerance.

    Tolerance: ``math.isclose(rel_tol=row.get("rel_tol", 1e-6), abs_tol=row.get("abs_tol", 1e-9))``.
    A non-numeric completion (or answer) scores 0.0.
    """
    text = _answer_text(row, completion)
    pred = None if text is None else parse_number(text)
    gold = parse_number(row["answer"])
    if pred is None or gold is None:
        return 0.0
    rel = float(row.get("rel_tol", NUMERIC_REL_TOL))
    abs_ = float(row.get("abs_tol", NUMERIC_ABS_TOL))
    return 1.0 if math.isclose(pred, gold, rel_tol=rel, abs_tol=abs_) else 0.0


# --------------------------------------------------------------------------- heavy verifiers


def _math_single(row: dict, completion: str) -> float:
    from alignpipe.rewards.math_verify_pool import verify_math_batch

    return verify_math_batch([str(row["answer"])], [completion])[0]


def _math_batch(rows: Sequence[dict], completions: Sequence[str]) -> list[float]:
    from alignpipe.rewards.math_verify_pool import verify_math_batch

    return verify_math_batch([str(r["answer"]) for r in rows], list(completions))


def _code_single(row: dict, completion: str) -> float:
    from alignpipe.rewards.sandbox import score_code

    return score_code(row, completion)


def _code_batch(rows: Sequence[dict], completions: Sequence[str]) -> list[float]:
    from alignpipe.rewards.sandbox import score_code_batch

    return score_code_batch(list(rows), list(completions))


# --------------------------------------------------------------------------- registry


class Verifier:
    """A named verifier: ``v(row, completion) -> float`` and ``v.batch(rows, completions)``."""

    def __init__(
        self,
        name: str,
        fn: Callable[[dict, str], float],
        batch_fn: Callable[[Sequence[dict], Sequence[str]], list[float]] | None = None,
    ) -> None:
        self.name = name
        self.fn = fn
        self.batch_fn = batch_fn

    def __call__(self, row: dict, completion: str) -> float:
        return self.fn(row, completion)

    def batch(self, rows: Sequence[dict], completions: Sequence[str]) -> list[float]:
        if self.batch_fn is not None:
            return self.batch_fn(rows, completions)
        return [self.fn(r, c) for r, c in zip(rows, completions, strict=True)]

    def __repr__(self) -> str:
        return f"Verifier({self.name!r})"


VERIFIERS: dict[str, Verifier] = {
    "exact": Verifier("exact", exact_match),
    "numeric": Verifier("numeric", numeric_match),
    "math": Verifier("math", _math_single, _math_batch),
    "code": Verifier("code", _code_single, _code_batch),
}


def get_verifier(name: str | None) -> Verifier:
    """The verifier called ``name`` (``None`` -> ``"exact"``); unknown names raise with the known list."""
    key = DEFAULT_VERIFIER if name is None else name
    try:
        return VERIFIERS[key]
    except (KeyError, TypeError):
        raise UnknownVerifierError(
            f"unknown verifier {name!r}; known verifiers: {', '.join(sorted(VERIFIERS))}"
        ) from None


def score_completion(row: dict, completion: str) -> float:
    """Score one completion with the verifier ``row`` names (``row.get("verifier", "exact")``).

    Returns 1.0 (correct) or 0.0 (wrong, unparsable, timed out, crashed).
    """
    return float(get_verifier(row.get("verifier") or DEFAULT_VERIFIER)(row, completion))


def score_completions(rows: Sequence[dict], completions: Sequence[str]) -> list[float]:
    """Batched :func:`score_completion`: one score per (row, completion) pair, in order.

    Pairs are grouped by verifier; ``math`` and ``code`` groups go to their worker pools in
    one call (the pools are created once and reused across calls).
    """
    if len(rows) != len(completions):
        raise ValueError(f"{len(rows)} rows but {len(completions)} completions")
    groups: dict[str, list[int]] = {}
    for i, row in enumerate(rows):
        name = get_verifier(row.get("verifier") or DEFAULT_VERIFIER).name
        groups.setdefault(name, []).append(i)
    scores = [0.0] * len(rows)
    for name, idx in groups.items():
        out = VERIFIERS[name].batch([rows[i] for i in idx], [completions[i] for i in idx])
        for i, s in zip(idx, out, strict=True):
            scores[i] = float(s)
    return scores
