"""Assert tests judged outside the sandbox, so that their expected answers never enter it.

Each ``assert`` whose condition is built from literals, arithmetic, comparisons and a few pure
builtins (``abs``, ``len``, ``sorted``, ``set``, ``round``, ``math.isclose``...) around calls into
the solution is split in two. Inside the sandbox only the calls run (the *holes*): the statement
becomes ``__areal_check__(k, (hole_0, hole_1, ...))``, which reports their values. Outside, the
rest of the condition (the *skeleton*, with the literals: the answers) is evaluated here on those
values, rebuilt from builtin types only. So ``assert add(1, 2) == 3`` sends ``add(1, 2)`` in and
keeps ``== 3`` out; ``assert abs(area(2) - 12.566) < 1e-3`` keeps ``abs(. - 12.566) < 1e-3`` out.

A test passes only if each of its split assertions ran at least once and held every time (so a
solution that skips them, by leaving early or by forging the harness's report, fails). An
``assert A and B`` is split as ``assert A`` then ``assert B`` (the same verdict); a condition that
is one call into the solution (``assert is_prime(7)``) is judged by its reported value's truth.

Why this holds: every reported value is the solution's to choose, so an assertion binds only
through its skeleton's literals, which it cannot see. Everything else that would decide a test
inside the solution's process is an *inside check* (``split_asserts`` lists them): an assert that
cannot be split (``or``, comprehensions, ``math.factorial(...)``, a name bound to anything but a
solution's result, as in ``expected = 3``, or a call of what the test defines or imports: ``def
ref``, ``ref = functools.partial(...)``, ``r = Ref()``), a ``raise``, a call that checks by its
name (``self.assertEqual(...)``, ``sys.exit(1)``), or a test with no split assertion at all.
The solution owns that process (it can read the harness's memory for the nonce, return an
object equal to everything, or replace ``ref`` so that ``assert f(x) == ref(x)`` holds), so the
sandbox refuses such tests (they fail closed) unless the config trusts inside checks.
"""

from __future__ import annotations

import ast
import builtins
import math
import operator
import re
import sys
from typing import Any


def _round(number: Any, ndigits: Any = None) -> Any:
    if isinstance(ndigits, int) and abs(ndigits) > 1000:  # ``round(5, -10**9)`` computes 10**10**9
        raise ValueError("round() with ndigits past the size limit")
    return round(number, ndigits)


def _sum(values: Any, start: Any = 0) -> Any:
    if not isinstance(start, list | tuple):
        return sum(values, start)
    # ``sum(lists, [])`` copies its total at each step: a million one-item lists took hours
    out = list(start)
    for v in values:
        if not isinstance(v, type(start)):
            raise TypeError(f"can only concatenate {type(start).__name__} (not {type(v).__name__})")
        out += v
        if len(out) > _MAX_SIZE:
            raise ValueError("a sum past the size limit")
    return type(start)(out)


_CALLS: dict[str, Any] = {
    "abs": abs, "len": len, "sorted": sorted, "set": set, "frozenset": frozenset, "list": list, "tuple": tuple,
    "round": _round, "min": min, "max": max, "sum": _sum, "float": float, "int": int, "str": str, "bool": bool,
    "any": any, "all": all, "dict": dict, "isinstance": isinstance, "type": lambda value, /: type(value)}
"""Builtins the skeleton may call: pure, and bounded on bounded input."""
_MATH = {"isclose": math.isclose, "fabs": math.fabs, "sqrt": math.sqrt, "floor": math.floor, "ceil": math.ceil,
         "inf": math.inf, "nan": math.nan, "pi": math.pi, "e": math.e}
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Not: operator.not_, ast.Invert: operator.invert}
_COMPARE = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
            ast.Gt: operator.gt, ast.GtE: operator.ge, ast.Is: operator.is_, ast.IsNot: operator.is_not,
            ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b}
_SHORT_CIRCUIT = (ast.BoolOp, ast.IfExp, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp, ast.Lambda,
                  ast.NamedExpr, ast.Await, ast.Yield, ast.YieldFrom, ast.Starred)


class _Hole(ast.AST):
    """A placeholder in a skeleton: the ``index``-th reported value."""

    _fields = ()

    def __init__(self, index: int):
        super().__init__()
        self.index = index


def _skeleton(node: ast.expr, holes: list[ast.expr]) -> ast.AST:
    """``node`` with every part that must run inside replaced by a ``_Hole`` (appended to ``holes``)."""
    if isinstance(node, ast.Constant):
        return node
    if isinstance(node, ast.List | ast.Tuple | ast.Set):
        return type(node)(elts=[_skeleton(e, holes) for e in node.elts], ctx=ast.Load())
    if isinstance(node, ast.Dict) and None not in node.keys:
        return ast.Dict(keys=[_skeleton(k, holes) for k in node.keys],
                        values=[_skeleton(v, holes) for v in node.values])
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return ast.UnaryOp(op=node.op, operand=_skeleton(node.operand, holes))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        return ast.BinOp(left=_skeleton(node.left, holes), op=node.op, right=_skeleton(node.right, holes))
    if isinstance(node, ast.Compare) and all(type(op) in _COMPARE for op in node.ops):
        return ast.Compare(left=_skeleton(node.left, holes), ops=node.ops,
                           comparators=[_skeleton(c, holes) for c in node.comparators])
    if isinstance(node, ast.Call) and _safe_callee(node.func) and not any(k.arg is None for k in node.keywords):
        return ast.Call(func=node.func, args=[_skeleton(a, holes) for a in node.args],
                        keywords=[ast.keyword(arg=k.arg, value=_skeleton(k.value, holes)) for k in node.keywords])
    if _is_math_constant(node) or (isinstance(node, ast.Name) and node.id in _CALLS):
        return node  # ``math.pi``; ``len`` as a value (``sorted(x, key=len)``)
    holes.append(node)
    return _Hole(len(holes) - 1)


def _safe_callee(func: ast.expr) -> bool:
    return (isinstance(func, ast.Name) and func.id in _CALLS) or (
        isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "math"
        and func.attr in _MATH and callable(_MATH[func.attr]))


def _is_math_constant(node: ast.expr) -> bool:
    return (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "math"
            and node.attr in _MATH and not callable(_MATH[node.attr]))


def _solution_call(hole: ast.expr, not_solution: set[str], results: frozenset[str] = frozenset()) -> bool:
    """Whether ``hole`` is a call into the solution (or a part of its result): its root is a
    call of a name that is neither a Python builtin nor imported or defined by the test, or a
    name in ``results`` (bound only to such calls' results: ``x = f(1)``). Anything else
    (``type(x)``, ``Fraction(1, 2)``, ``math.factorial(9)``, a loop variable) may not be a plain
    value, or may stand for an answer, and stays inside."""
    node, called = hole, False
    while isinstance(node, ast.Call | ast.Attribute | ast.Subscript):
        called = called or isinstance(node, ast.Call)
        node = node.func if isinstance(node, ast.Call) else node.value
    if not isinstance(node, ast.Name):
        return False
    return node.id in results or (called and node.id not in not_solution and not hasattr(builtins, node.id)
                                  and node.id not in sys.stdlib_module_names)


def split_asserts(source: str) -> tuple[str, dict[int, ast.AST], list[str]]:
    """``source`` with each assert that can be judged outside turned into a report of its holes,
    the skeletons by report number, and the inside checks left in it (see the module docstring),
    each as ``line N: <code>``."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError) as e:
        return source, {}, [f"it does not parse ({type(e).__name__})"]  # the harness's compile reports it
    table: dict[int, ast.AST] = {}
    inside: list[str] = []
    not_solution, results = _not_solution(tree)

    def split(cond: ast.expr) -> tuple[ast.AST, list[ast.expr]] | None:
        if any(isinstance(n, _SHORT_CIRCUIT) for n in ast.walk(cond)):
            return None
        holes: list[ast.expr] = []
        skeleton = _skeleton(cond, holes)
        if not holes or not all(_solution_call(h, not_solution, results) for h in holes):
            return None  # nothing hidden, or a part that may not be a plain value (or is no answer)
        truth = skeleton.operand if isinstance(skeleton, ast.UnaryOp) and isinstance(skeleton.op, ast.Not) else skeleton
        if isinstance(truth, _Hole):  # only its truth counts (``assert m.search(s)``): report that, a plain value
            holes[truth.index] = ast.Call(ast.Name("bool", ast.Load()), [holes[truth.index]], [])
        return skeleton, holes

    def where(node: ast.stmt) -> str:
        return f"line {node.lineno}: {ast.unparse(node).splitlines()[0][:100]}"

    class Rewrite(ast.NodeTransformer):
        def visit_Assert(self, node: ast.Assert) -> ast.AST:
            test = node.test
            conds = test.values if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And) else [test]
            parts = [split(c) for c in conds]
            if any(p is None for p in parts):
                if not (isinstance(test, ast.Constant) and test.value):  # ``assert True`` decides nothing
                    inside.append(where(node))
                return node
            reports = []
            for skeleton, holes in parts:
                k = len(table)
                table[k] = skeleton
                report = [ast.Constant(k), ast.Tuple(holes, ast.Load())]
                call = ast.Call(ast.Name("__areal_check__", ast.Load()), report, [])
                reports.append(ast.copy_location(ast.Expr(call), node))
            return reports

        def visit_Raise(self, node: ast.Raise) -> ast.AST:
            inside.append(where(node))
            return node

    for node in ast.walk(tree):  # checks that are calls: ``self.assertEqual(f(1), 2)``, ``if ...: sys.exit(1)``
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and _check_call(node.value.func):
            inside.append(where(node))
    tree = ast.fix_missing_locations(Rewrite().visit(tree))
    if not table and not inside:
        inside.append("no assertion in it can be judged outside the sandbox")
    return ast.unparse(tree), table, inside


def _not_solution(tree: ast.AST) -> tuple[set[str], frozenset[str]]:
    """Names whose calls are no calls into the solution: what the test imports, defines (functions,
    classes), or binds to anything but the result of a call into the solution (``ref =
    functools.partial(...)``, ``r = Reference()``, loop variables). Their values are computed in the
    solution's process like the solution's, but they would stand for answers there (``assert
    f(x) == ref(x)``), so an assertion that calls them is not split. Second: the names bound only
    to results of calls into the solution (``s = Solution()``, ``x = f(1)``), the solution's."""
    imported = {(a.asname or a.name).split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)
                for a in n.names}
    defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)}
    other: set[str] = set()
    results: set[str] = set()
    for n in ast.walk(tree):
        value = None
        if isinstance(n, ast.Assign | ast.AnnAssign | ast.NamedExpr):
            targets, value = getattr(n, "targets", None) or [n.target], n.value
        elif isinstance(n, ast.AugAssign | ast.For | ast.AsyncFor | ast.comprehension):
            targets = [n.target]
        elif isinstance(n, ast.withitem) and n.optional_vars is not None:
            targets = [n.optional_vars]
        elif isinstance(n, ast.ExceptHandler) and n.name:
            other.add(n.name)
            continue
        else:
            continue
        names = {t.id for target in targets for t in ast.walk(target) if isinstance(t, ast.Name)}
        if value is None or not _solution_call(value, imported | defined):
            other |= names
        else:  # ``x = f(1)``, ``a, b = f(1)``: not ``d[k] = f(1)`` (``d`` may hold more)
            results |= {t.id for target in targets for t in _plain_targets(target)}
    not_solution = imported | defined | other
    return not_solution, frozenset(results - not_solution)


def _check_call(func: ast.expr) -> bool:
    """Whether a call statement is a check by its name: ``assert*`` (unittest, numpy.testing),
    ``fail``, or a way out (``exit``, ``sys.exit``, ``os._exit``, ``abort``)."""
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
    return name.lower().startswith("assert") or name in ("fail", "exit", "_exit", "quit", "abort")


def _plain_targets(target: ast.expr) -> list[ast.Name]:
    if isinstance(target, ast.Name):
        return [target]
    if isinstance(target, ast.Starred):
        return _plain_targets(target.value)
    if isinstance(target, ast.Tuple | ast.List):
        return [n for e in target.elts for n in _plain_targets(e)]
    return []


_MAX_SIZE = 1 << 22
"""Largest sequence or integer (in bits) the skeleton may build from reported values."""
_WIDE_FORMAT = re.compile(r"\*|[0-9]{7,}")
"""In a %-format, what may be a huge width or precision (``'%999999999d' % 1``: 1 GB)."""


def judge(skeleton: ast.AST, encoded: Any) -> bool:
    """Whether the assert's condition holds for the reported (encoded) hole values. Raises
    ``ValueError`` (or ``TypeError``...) for a value that cannot be rebuilt or compared."""
    holes = decode(encoded)
    if not isinstance(holes, tuple):
        raise ValueError("the report is not a tuple of values")
    return bool(_evaluate(skeleton, holes))


def _evaluate(node: ast.AST, holes: tuple) -> Any:
    if isinstance(node, _Hole):
        return holes[node.index]
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.List):
        return [_evaluate(e, holes) for e in node.elts]
    if isinstance(node, ast.Tuple):
        return tuple(_evaluate(e, holes) for e in node.elts)
    if isinstance(node, ast.Set):
        return {_evaluate(e, holes) for e in node.elts}
    if isinstance(node, ast.Dict):
        return {_evaluate(k, holes): _evaluate(v, holes) for k, v in zip(node.keys, node.values, strict=True)}
    if isinstance(node, ast.UnaryOp):
        return _UNARY[type(node.op)](_evaluate(node.operand, holes))
    if isinstance(node, ast.BinOp):
        a, b = _evaluate(node.left, holes), _evaluate(node.right, holes)
        _check_size(node.op, a, b)
        return _BINOPS[type(node.op)](a, b)
    if isinstance(node, ast.Compare):
        left = _evaluate(node.left, holes)
        for op, comparator in zip(node.ops, node.comparators, strict=True):
            right = _evaluate(comparator, holes)
            if not _COMPARE[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.Call):
        func = _CALLS[node.func.id] if isinstance(node.func, ast.Name) else _MATH[node.func.attr]
        return func(*(_evaluate(a, holes) for a in node.args),
                    **{k.arg: _evaluate(k.value, holes) for k in node.keywords})
    if isinstance(node, ast.Attribute):
        return _MATH[node.attr]
    if isinstance(node, ast.Name):
        return _CALLS[node.id]
    raise ValueError(f"cannot evaluate {type(node).__name__}")


def _check_size(op: ast.operator, a: Any, b: Any) -> None:
    """Refuse an operation whose result would be huge, or take quadratic time on huge integers
    (the values came from the solution)."""
    if (isinstance(op, ast.Div | ast.FloorDiv | ast.Mod) and isinstance(a, int) and isinstance(b, int)
            and min(a.bit_length(), b.bit_length()) > 1 << 16):
        raise ValueError("a division of integers past the size limit")
    if isinstance(op, ast.Pow | ast.Mult) and isinstance(a, int) and isinstance(b, int):
        bits = a.bit_length() * b if isinstance(op, ast.Pow) else a.bit_length() + b.bit_length()
        if bits > _MAX_SIZE and abs(a) > 1:
            raise ValueError("an integer past the size limit")
    if isinstance(op, ast.Mod) and isinstance(a, str | bytes) and _WIDE_FORMAT.search(str(a)):
        raise ValueError("a %-format with a width or precision past the size limit")
    if isinstance(op, ast.Mult):
        for seq, count in ((a, b), (b, a)):
            if isinstance(seq, str | bytes | list | tuple) and isinstance(count, int) and len(seq) * count > _MAX_SIZE:
                raise ValueError("a repeated sequence past the size limit")


def decode(x: Any, depth: int = 0) -> Any:
    """The value the harness encoded (``_harness._encode``), rebuilt from builtin types only."""
    if depth > 100:
        raise ValueError("nested more than 100 deep")
    if x is None or isinstance(x, bool | int | str):
        return x
    if isinstance(x, list):
        return [decode(v, depth + 1) for v in x]
    if isinstance(x, dict) and len(x) == 1:
        (tag, v), = x.items()
        if tag == "f" and isinstance(v, str):
            return float(v)
        if tag == "i" and isinstance(v, str) and len(v) <= _MAX_SIZE // 4:
            return int(v, 16)
        if tag == "c" and isinstance(v, list) and len(v) == 2:
            return complex(float(v[0]), float(v[1]))
        if tag == "b" and isinstance(v, str):
            return bytes.fromhex(v)
        if tag in ("t", "s", "d") and isinstance(v, list):
            items = [decode(e, depth + 1) for e in v]
            if tag == "t":
                return tuple(items)
            if tag == "s":
                return set(items)
            if all(isinstance(e, list) and len(e) == 2 for e in items):
                return {_hashable(a): b for a, b in items}
        if tag == "x":
            raise ValueError(f"the value could not be reported ({str(v)[:200]})")
    raise ValueError("a malformed value")


def _hashable(v: Any) -> Any:
    hash(v)
    return v
