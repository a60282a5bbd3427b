"""A calculator tool: the model writes `<calc>37*48</calc>` and the environment answers with the value, `1776`.

The expression is integer arithmetic: + − × (`*`), integer division (`//`), remainder (`%`), unary minus and
parentheses, no names, no powers, at most 200 characters and values of at most 40 digits, so that no call can run
long or grow without bound. What does not parse, or divides by zero, is answered with `error: ...`, which the model
sees as the tool's reply. Without a chat template the reply follows the call as `=1776`. A turn that ends with the model's stop token ends the episode.
"""

from __future__ import annotations

import ast
import operator
import re

from posttrain.environments.base import Environment, Reply, register

OPEN, CLOSE = "<calc>", "</calc>"
MAX_CHARS, MAX_DIGITS = 200, 40
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
           ast.Mod: operator.mod}
_CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE) + r"\s*$", re.S)


def evaluate(expression: str) -> int:
    """The value of an integer expression; ValueError says why there is none.

    >>> evaluate("37*48 + (100 - 1)//3")
    1809
    """
    if len(expression) > MAX_CHARS:
        raise ValueError(f"expression longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse {expression.strip()!r}") from None

    def value(node) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            out = node.value
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            out = -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
        elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, (ast.FloorDiv, ast.Mod)) and right == 0:
                raise ValueError("division by zero")
            out = _BINARY[type(node.op)](left, right)
        else:
            raise ValueError(f"not integer arithmetic: {ast.unparse(node)!r}")
        if len(str(abs(out))) > MAX_DIGITS:
            raise ValueError(f"a value of more than {MAX_DIGITS} digits")
        return out

    return value(tree.body)


@register("calculator")
class Calculator(Environment):
    """Answers a turn that ends in `<calc>EXPR</calc>` with EXPR's value; any other turn ends the episode."""

    stop = (CLOSE,)

    def render(self, text: str) -> str:
        return f"={text}"  # <calc>37*48</calc>=1776, without a chat template

    def step(self, text: str, ids: list[int], ended: bool) -> Reply:
        call = None if ended else _CALL.search(text)
        if call is None:
            return Reply(done=True)
        try:
            return Reply(text=str(evaluate(call.group(1))), info={"calls": 1.0})
        except ValueError as e:
            return Reply(text=f"error: {e}", info={"calls": 1.0, "call_errors": 1.0})
