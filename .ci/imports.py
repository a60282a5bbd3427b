"""The import rules CI checks, on posttrain as installed (with the folders pyproject.toml maps into it):

1. the layers contract in pyproject.toml (import-linter): a lower layer never imports a higher one;
2. no import cycle anywhere: no module reaches itself through a chain of imports, package `__init__`s included.

    python .ci/imports.py        # from the repository root; exits 1 and names the broken rule or the cycle
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def cycles(graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each a cycle of imports."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.find_modules_directly_imported_by(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return out


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        site = Path(tmp) / "site"
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                        "--target", str(site), str(ROOT)], check=True)
        env = {"PYTHONPATH": str(site), "PATH": str(Path(sys.executable).parent)}
        lint = subprocess.run(["lint-imports", "--config", str(ROOT / "pyproject.toml")], cwd=tmp, env=env)
        sys.path.insert(0, str(site))
        import grimp

        graph = grimp.build_graph("posttrain")
        found = cycles(graph)
        for cycle in found:
            print(f"import cycle: {' <-> '.join(cycle)}", file=sys.stderr)
        print(f"import cycles: {len(found)} among {len(graph.modules)} modules")
        return 1 if lint.returncode or found else 0


if __name__ == "__main__":
    sys.exit(main())
