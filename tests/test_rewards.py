"""exact / numeric verifiers, the registry and the batched entry point (all in-process)."""

import time

import pytest

from alignpipe.rewards import (
    VERIFIERS,
    UnknownVerifierError,
    parse_number,
    score_completion,
    score_completions,
)


def row(answer, verifier=None, **kw):
    r = {"prompt": "p", "answer": answer, **kw}
    if verifier is not None:
        r["verifier"] = verifier
    return r


@pytest.mark.parametrize(
    "answer,completion,expected",
    [
        ("12", " 12 ", 1.0),
        ("12", "12\n", 1.0),
        (" abc", "abc\t", 1.0),
        ("12", "12.0", 0.0),  # exact is exact
        ("abc", "ABC", 0.0),
        ("a b", "a  b", 0.0),
        ("12", "", 0.0),
        (12, "12", 1.0),  # non-string answers compare by str()
    ],
)
def test_exact(answer, completion, expected):
    assert score_completion(row(answer, "exact"), completion) == expected


@pytest.mark.parametrize(
    "verifier,answer,completion,expected",
    [
        ("exact", "01235", "Sorted: \\boxed{01235}.", 1.0),
        ("exact", "01235", "\\boxed{1235}", 0.0),  # exact keeps the leading zero
        ("exact", "01235", "01235", 0.0),  # no box: nothing to read
        ("exact", "12", "\\boxed{21} no, \\boxed{12}", 1.0),  # the last box counts
        ("exact", "12", "\\boxed{12", 0.0),  # unbalanced
        ("numeric", "85", "37 + 48 = \\boxed{85}", 1.0),
        ("numeric", "85", "\\boxed{85.0}", 1.0),
        ("numeric", "85", "85", 0.0),
        ("numeric", "0.5", "\\boxed{1/2}", 1.0),
    ],
)
def test_boxed_extraction(verifier, answer, completion, expected):
    """``extract: boxed`` rows (the small profile, Gym-style prompts) score the last \\boxed{}."""
    assert score_completion(row(answer, verifier, extract="boxed"), completion) == expected


def test_an_unknown_extraction_is_named():
    with pytest.raises(ValueError, match="extract='last_line'"):
        score_completion(row("1", "exact", extract="last_line"), "1")


def test_default_verifier_is_exact():
    assert score_completion({"answer": "x"}, " x ") == 1.0
    assert score_completion({"answer": "1000"}, "1,000") == 0.0  # exact, not numeric
    assert score_completion({"answer": "x", "verifier": None}, "x") == 1.0


@pytest.mark.parametrize(
    "answer,completion,expected",
    [
        ("1000", "1,000", 1.0),
        (1000, "1,000", 1.0),
        ("1,000,000", "1000000", 1.0),
        ("1234.5", "1,234.50", 1.0),
        ("12", " 12 ", 1.0),
        ("12", "12.0", 1.0),
        ("12", "+12", 1.0),
        ("0.5", "1/2", 1.0),
        (0.5, "1/2", 1.0),
        ("1/2", "0.5", 1.0),
        ("-0.75", "-3 / 4", 1.0),
        ("1/3", "0.3333333", 1.0),  # within rel_tol 1e-6
        ("1/3", "0.333", 0.0),
        ("1e3", "1000", 1.0),
        ("10000", "10\u202f000", 1.0),  # narrow no-break space separator
        ("12", "13", 0.0),
        ("12", "twelve", 0.0),
        ("12", "12 apples", 0.0),
        ("12", "", 0.0),
        ("12", "1,2", 0.0),  # not a thousands grouping
        ("1", "1/0", 0.0),
        ("nan", "nan", 0.0),
        ("0", "-0", 1.0),
    ],
)
def test_numeric(answer, completion, expected):
    assert score_completion(row(answer, "numeric"), completion) == expected


def test_numeric_tolerance_is_per_row():
    assert score_completion(row("3.14159", "numeric"), "3.14") == 0.0
    assert score_completion(row("3.14159", "numeric", rel_tol=1e-2), "3.14") == 1.0
    assert score_completion(row("0", "numeric", abs_tol=0.01), "0.005") == 1.0


def test_parse_number():
    assert parse_number(" 1,234 ") == 1234.0
    assert parse_number("3/4") == 0.75
    assert parse_number(True) is None
    assert parse_number(None) is None
    assert parse_number("") is None
    assert parse_number("inf") is None  # words are not numbers


def test_registry_and_unknown_name():
    assert set(VERIFIERS) >= {"exact", "numeric", "math", "code"}
    with pytest.raises(UnknownVerifierError) as ei:
        score_completion(row("1", "regex"), "1")
    msg = str(ei.value)
    assert "regex" in msg
    for name in ("exact", "numeric", "math", "code"):
        assert name in msg
    assert isinstance(ei.value, KeyError) and isinstance(ei.value, ValueError)


def test_batched_matches_single_and_keeps_order():
    rows = [row("1", "exact"), row("1000", "numeric"), row("x", "exact"), row("0.5", "numeric")]
    comps = ["1", "1,000", "y", "1/3"]
    assert score_completions(rows, comps) == [1.0, 1.0, 0.0, 0.0]
    assert score_completions(rows, comps) == [
        score_completion(r, c) for r, c in zip(rows, comps, strict=True)
    ]
    assert score_completions([], []) == []
    with pytest.raises(ValueError):
        score_completions(rows, comps[:2])


def test_exact_numeric_are_fast():
    r_exact, r_num = row("42", "exact"), row("1000", "numeric")
    n = 20000
    t0 = time.process_time()  # CPU time: a loaded machine must not fail this
    for _ in range(n):
        score_completion(r_exact, " 42 ")
        score_completion(r_num, "1,000")
    per_call = (time.process_time() - t0) / (2 * n)
    assert per_call < 100e-6, f"{per_call * 1e6:.1f} us per call"
