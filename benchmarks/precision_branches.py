"""Count the precision branches of the training runtime (issue 49: "one precision plan").

A precision branch is an `if` / `elif` statement, a conditional expression (`a if c else b`), a
comprehension's `if`, an `assert`-free `while` or a `match` whose condition (the match subject
or a case guard) reads a precision setting or a precision object's kind. The condition reads one
when it contains, outside the name of a function it calls:

- an identifier (a name, an attribute, a keyword argument) containing one of `WORDS`: the
  precision section (`config.precision.*`), its fields (param_dtype, master_weights, grad_dtype,
  fp8_fast_accum) and what they become in the modules (fp8, mxfp8, payload, emulate(d),
  fast_accum, recipe, fp8_rows, lm_head_fp8);
- a string constant among `VALUES` (the precision choices, and the attribute names a
  `hasattr` / `getattr` asks a GEMM or dispatcher for);
- a local name assigned (in the same function) from an expression that reads one of the above
  (followed to a fixed point), e.g. `fused = getattr(self.gemm, "swiglu_mlp", None)`.

Not counted: a condition that only calls a function named after FP8 (`_fused_fp8(h)` chooses a
Triton kernel or its reference, as every kernel does), the dtype of a tensor (`x.dtype ==
torch.float64`), or a branch in a test. Scope: `moetrain/` without `moetrain/tools/` (the runtime;
the planner's cost model is reported apart with --tools).

    python benchmarks/precision_branches.py            # totals per file, then each branch
    python benchmarks/precision_branches.py --tools    # moetrain/tools/ instead
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

WORDS = ("precision", "fp8", "payload", "emulat", "fast_accum", "recipe")
# --broad: the optimizer's dtypes too, where a torch.dtype or a flag carries them
BROAD_WORDS = ("param_dtype", "grad_dtype", "master_weights", "use_masters")
VALUES = {"fp8", "fp8_rowwise", "mxfp8", "fp8-emulated", "swiglu_mlp", "takes_fp8_rows", "fp8_rows"}
KIND_CALLS = {"getattr", "hasattr", "isinstance"}  # their arguments say what an object is


def _reads(node: ast.AST, tainted: set[str], words: tuple[str, ...], arguments: bool) -> bool:
    """Whether expression `node` reads a precision setting (module docstring). `arguments`:
    look into the arguments of calls too (a condition), or only into those of `KIND_CALLS`
    (what taints a local: `model = parallelize(..., precision)` is not a setting)."""

    def visit(sub: ast.AST) -> bool:
        if isinstance(sub, ast.Call):
            func = sub.func
            receiver = [func.value] if isinstance(func, ast.Attribute) else []
            if isinstance(func, ast.Name) and func.id in tainted:  # `fused(...)`: a kind's call
                return True
            kind_call = isinstance(func, ast.Name) and func.id in KIND_CALLS
            args = [*sub.args, *(k.value for k in sub.keywords)]
            keywords = [k.arg for k in sub.keywords if k.arg]
            if arguments or kind_call:
                if any(any(w in k.lower() for w in words) for k in keywords):
                    return True
                return any(visit(a) for a in [*receiver, *args])
            return any(visit(a) for a in receiver)
        if isinstance(sub, ast.Name):
            return sub.id in tainted or any(w in sub.id.lower() for w in words)
        if isinstance(sub, ast.Attribute):
            return any(w in sub.attr.lower() for w in words) or visit(sub.value)
        if isinstance(sub, ast.Constant):
            return isinstance(sub.value, str) and sub.value in VALUES
        return any(visit(child) for child in ast.iter_child_nodes(sub))

    return visit(node)


def _plain_names(target: ast.AST) -> list[ast.Name]:
    """The names a target binds (`x`, `a, b`), not `self` of `self.x = ...`."""
    if isinstance(target, ast.Name):
        return [target]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [n for t in target.elts for n in _plain_names(t)]
    return []


def _tainted_locals(scope: ast.AST, words: tuple[str, ...]) -> set[str]:
    """Local names assigned from a precision-reading expression, to a fixed point."""
    assigns: list[tuple[list[str], ast.AST]] = []
    for sub in ast.walk(scope):
        if isinstance(sub, ast.Assign):
            targets = [n.id for t in sub.targets for n in _plain_names(t)]
            assigns.append((targets, sub.value))
        elif isinstance(sub, (ast.AnnAssign, ast.NamedExpr)) and sub.value is not None:
            if isinstance(sub.target, ast.Name):
                assigns.append(([sub.target.id], sub.value))
    tainted: set[str] = set()
    changed = True
    while changed:
        changed = False
        for targets, value in assigns:
            if not set(targets) <= tainted and _reads(value, tainted, words, arguments=False):
                tainted |= set(targets)
                changed = True
    return tainted


def _conditions(scope: ast.AST):
    for sub in ast.walk(scope):
        if isinstance(sub, (ast.If, ast.IfExp, ast.While)):
            yield sub.lineno, sub.test
        elif isinstance(sub, ast.comprehension):
            for test in sub.ifs:
                yield test.lineno, test
        elif isinstance(sub, ast.Match):
            yield sub.lineno, sub.subject
            for case in sub.cases:
                if case.guard is not None:
                    yield case.guard.lineno, case.guard


def branches(path: Path, words: tuple[str, ...] = WORDS) -> list[tuple[int, str]]:
    """(line, condition source) of each precision branch in the file."""
    source = path.read_text()
    tree = ast.parse(source)
    scopes = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    seen: dict[int, tuple[int, str]] = {}
    for scope in [tree, *scopes]:
        # module level: only conditions outside every function (those are walked per function)
        tainted = _tainted_locals(scope, words) if scope is not tree else set()
        inner = {id(n) for s in scopes if scope is tree for n in ast.walk(s)}
        for line, test in _conditions(scope):
            if id(test) in inner or id(test) in seen:
                continue
            if _reads(test, tainted, words, arguments=True):
                seen[id(test)] = (line, ast.get_source_segment(source, test) or "")
    return sorted(seen.values())


def count(
    root: Path, tools: bool = False, words: tuple[str, ...] = WORDS
) -> dict[Path, list[tuple[int, str]]]:
    package = root / "moetrain"
    files = (package / "tools").rglob("*.py") if tools else package.rglob("*.py")
    result = {}
    for path in sorted(files):
        if not tools and (package / "tools") in path.parents:
            continue
        found = branches(path, words)
        if found:
            result[path.relative_to(root)] = found
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tools", action="store_true", help="count moetrain/tools/ instead")
    parser.add_argument("--broad", action="store_true", help="the optimizer's dtypes too")
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    args = parser.parse_args(argv)
    result = count(args.root, args.tools, WORDS + BROAD_WORDS if args.broad else WORDS)
    total = sum(len(v) for v in result.values())
    for path, found in result.items():
        print(f"{len(found):3d}  {path}")
    print(f"{total:3d}  precision branches in {len(result)} files")
    for path, found in result.items():
        for line, condition in found:
            print(f"{path}:{line}: {' '.join(condition.split())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
