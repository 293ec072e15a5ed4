"""House order of the kernel packages (issue 29), from the sources alone (`ast`, no imports, no DSL):
the modules of `decode/` import one another without a circle (function-level imports included), and the
prefill kernels live in `futx/prefill/`, not loose at the top of `futx/`."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DECODE = ROOT / "decode"


def _decode_modules() -> set[str]:
    return {p.stem for p in DECODE.glob("*.py")}


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The decode modules that `path` (a module of decode/) imports anywhere in its body."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "decode":
                    found.add(parts[1] if len(parts) > 1 else "__init__")
        elif isinstance(node, ast.ImportFrom):
            if node.level > 1 or (node.level == 0 and (node.module or "").split(".")[0] != "decode"):
                continue
            rest = (node.module or "").split(".")[1 if node.level == 0 else 0:]
            rest = [p for p in rest if p]
            if rest:
                found.add(rest[0])
            else:   # `from . import a, b` / `from decode import a`: submodules, or names of the package
                found.update(a.name if a.name in modules else "__init__" for a in node.names)
    found.discard(path.stem)
    return found & modules


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A circle of the graph as a path [a, ..., a], or None."""
    state: dict[str, int] = {}   # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_cycle_finder():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_decode_import_graph_is_acyclic():
    modules = _decode_modules()
    graph = {m: _imports(DECODE / f"{m}.py", modules) for m in modules}
    # the skinny family: the variants import the base, only the dispatch module imports the variants
    assert {"skinny_regs", "skinny_wgmma", "skinny_ws", "skinny_ws_e4m3"} <= graph["skinny_dispatch"]
    assert not graph["skinny"] & {"skinny_regs", "skinny_wgmma", "skinny_ws", "skinny_ws_e4m3", "skinny_dispatch"}
    for variant in ("skinny_regs", "skinny_wgmma", "skinny_ws"):
        assert "skinny" in graph[variant]
        assert "skinny_dispatch" not in graph[variant]
    assert "skinny_ws" in graph["skinny_ws_e4m3"] and "skinny_dispatch" not in graph["skinny_ws_e4m3"]
    assert "skinny_ws_e4m3" not in graph["skinny_ws"]
    assert (circle := _cycle(graph)) is None, f"import circle among decode modules: {' -> '.join(circle)}"


def test_prefill_kernels_have_their_own_package():
    futx = ROOT / "futx"
    for name in ("mainloop", "prefill_attention", "row_quant"):
        assert not (futx / f"{name}.py").exists(), f"futx/{name}.py: prefill kernels belong in futx/prefill/"
    for name in ("__init__", "mainloop", "attention", "row_quant"):
        assert (futx / "prefill" / f"{name}.py").is_file(), name
    # every kernel module (one with a registry factory) of futx/ is a prefill kernel, but the runtime's smoke test
    kernels = {p.relative_to(ROOT).as_posix() for p in futx.rglob("*.py")
               if any(isinstance(n, ast.FunctionDef) and n.name == "compile_target"
                      for n in ast.parse(p.read_text()).body)}
    assert {k for k in kernels if not k.startswith("futx/prefill/")} == {"futx/runtime/smoke.py"}, kernels
