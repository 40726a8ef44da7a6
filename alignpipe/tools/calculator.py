"""The ``calculator`` tool: arithmetic on ints and floats, read with ``ast``, never ``eval``.

Allowed: numbers, ``+ - * / // % **``, unary ``-``/``+`` and parentheses. Work is bounded so a
policy cannot stall a rollout: the expression's length, every integer's size (MAX_BITS, checked
before a power is computed) and float overflow are refused with a message, not computed.
"""

from __future__ import annotations

import ast
import math
import operator

from alignpipe.tools.calls import ToolError

__all__ = ["CALCULATOR_SCHEMA", "CalculatorError", "evaluate"]

MAX_CHARS = 1000  # bounds parsing (and nesting) work
MAX_BITS = 4096  # ~1233 decimal digits: any integer past this is refused

CALCULATOR_SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / // % ** and parentheses, e.g. '(2 + 3) * 4 / 7'.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "the arithmetic expression"}},
            "required": ["expression"],
            "additionalProperties": False,
        },
    },
}

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


class CalculatorError(ToolError, ValueError):
    """An expression the calculator refuses; the message is what the policy reads."""


def _check(value):
    if isinstance(value, complex):
        raise CalculatorError("the result is not a real number (a fractional power of a negative number)")
    if isinstance(value, int) and value.bit_length() > MAX_BITS:
        raise CalculatorError(f"a number in the expression exceeds {MAX_BITS} bits; refused")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("the result is not finite (overflow)")
    return value


def _power(base, exp):
    if isinstance(base, int) and isinstance(exp, int) and exp > 0 and abs(base) > 1:
        # exp * bits(base) bounds the result's size: refuse before computing it.
        if exp * (abs(base).bit_length() - 1) > MAX_BITS:
            raise CalculatorError(f"{base} ** {exp} exceeds {MAX_BITS} bits; refused")
    if isinstance(exp, int) and exp < 0 and isinstance(base, int):
        base = float(base)  # ints to a negative power are floats; float math bounds the work
    return base**exp


def _eval(node):
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _check(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _eval(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        left, right = _eval(node.left), _eval(node.right)
        try:
            if isinstance(node.op, ast.Pow):
                return _check(_power(left, right))
            if type(node.op) in _BINARY:
                return _check(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("the result is too large (overflow)") from None
        raise CalculatorError(f"operator {type(node.op).__name__} is not supported (use + - * / // % **)")
    what = type(node).__name__ if not isinstance(node, ast.Constant) else repr(node.value)
    raise CalculatorError(f"{what} is not arithmetic: only numbers, + - * / // % ** and parentheses")


def evaluate(expression: str) -> str:
    """The value of ``expression`` as text (``str`` of the int or float); CalculatorError if refused."""
    if len(expression) > MAX_CHARS:
        raise CalculatorError(f"the expression has {len(expression)} characters; at most {MAX_CHARS}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError) as e:
        raise CalculatorError(
            f"not an arithmetic expression: {e.msg if isinstance(e, SyntaxError) else e}"
        ) from None
    try:
        return str(_eval(tree))
    except RecursionError:
        raise CalculatorError("the expression is nested too deeply") from None
