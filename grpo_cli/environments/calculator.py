"""The calculator tool: arithmetic the model writes (`<calc>12-17</calc>`), evaluated safely.

Never `eval`: the text is parsed with Python's `ast` and only numbers, + - * / // % ** and
parentheses are walked. Hostile input is bounded, not trusted: the expression is at most
MAX_CHARS characters and MAX_NODES nodes deep in all, every intermediate number at most
MAX_DIGITS digits (so `9**9**9` is refused before it is computed: the exponent's size is checked
first), and names, calls, attributes, subscripts and strings are refused by the parser walk
(`__import__('os')` is "not arithmetic"). An error is a ValueError whose message the model sees.
"""

from __future__ import annotations

import ast
import math
import operator

MAX_CHARS = 200
MAX_NODES = 64
MAX_DIGITS = 100  # |value| < 10**100

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _bounded(value):
    if isinstance(value, complex):
        raise ValueError("the result is not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("the result is not a finite number")
    if abs(value) >= 10**MAX_DIGITS:
        raise ValueError(f"a number over {MAX_DIGITS} digits")
    return value


def _power(base, exponent):
    # Bound the result's size before computing it: |base| ** exponent has about
    # exponent * log10|base| digits.
    if isinstance(exponent, int) and exponent < 0 and base == 0:
        raise ValueError("division by zero")
    if abs(base) > 1 and exponent * math.log10(abs(base)) >= MAX_DIGITS:
        raise ValueError(f"a number over {MAX_DIGITS} digits")
    return base**exponent


def _walk(node, budget: list[int]):
    budget[0] -= 1
    if budget[0] < 0:
        raise ValueError(f"more than {MAX_NODES} terms")
    if isinstance(node, ast.Expression):
        return _walk(node.body, budget)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_walk(node.operand, budget))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _walk(node.left, budget), _walk(node.right, budget)
        if isinstance(node.op, ast.Pow):
            return _bounded(_power(left, right))
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise ValueError("division by zero")
        return _bounded(_BINARY[type(node.op)](left, right))
    raise ValueError("not arithmetic (numbers, + - * / // % ** and parentheses only)")


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression; ValueError with a short reason otherwise."""
    text = expression.strip().replace("×", "*").replace("÷", "/").replace("^", "**")
    if not text:
        raise ValueError("empty expression")
    if len(text) > MAX_CHARS:
        raise ValueError(f"longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ValueError("does not parse as arithmetic") from None
    return _walk(tree, [MAX_NODES])


def calc(expression: str) -> str:
    """Evaluate arithmetic: numbers, + - * / and parentheses. Example: <calc>12-17</calc> gives -5.

    Args:
        expression: the arithmetic to evaluate, e.g. 12-17
    """
    value = evaluate(expression)
    if isinstance(value, float):
        value = int(value) if value.is_integer() and abs(value) < 2**53 else round(value, 6)
    return str(value)


# Worked examples the tool environment shows as chat turns before the question (ToolEnv.demonstrations).
calc.examples = [("What is 12 minus 17?", "12-17"), ("What is 3 times 4?", "3*4")]
