"""The package's shape: no import cycle, every module importable alone, the root holds only entry points."""

from __future__ import annotations

import ast
import os
import pickle
import sys
import traceback
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "relayrl"
GENERATED = "v1"  # protoc's stubs: they import each other as protoc writes them
ROOT_MODULES = {"__init__", "cli", "config", "errors", "registry"}  # entry points and cross-cutting types


def module_files() -> dict[str, Path]:
    """Dotted name -> file of every hand-written module of the package."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        if GENERATED in rel.parts[1:2]:
            continue
        name = ".".join(rel.parts)
        out[name.removesuffix(".__init__")] = path
    return out


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the package modules it imports anywhere in its body (function-level imports included)."""

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {owner(alias.name) for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets |= {owner(f"{node.module}.{alias.name}") or owner(node.module) for alias in node.names}
        graph[name] = {t for t in targets if t and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path that starts and ends at the same node, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_no_import_cycle() -> None:
    cycle = find_cycle(import_graph(module_files()))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_find_cycle_sees_a_lazy_import_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_package_root_holds_only_entry_points() -> None:
    root = {p.stem for p in PACKAGE.glob("*.py")}
    assert root == ROOT_MODULES, f"modules at the package root besides entry points: {sorted(root - ROOT_MODULES)}"
    runtime = {p.stem for p in (PACKAGE / "runtime").glob("*.py")}
    assert {"threads", "cpus", "heap", "gcfreeze", "procs", "ports", "forkserver", "launcher"} <= runtime


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_every_module_imports_alone() -> None:
    """Each module in a child forked before any relayrl module was imported (third-party libraries preloaded,
    so each child costs milliseconds), so each sees only what it imports itself; as many children at a time as
    there are CPUs."""
    for lib in ("torch", "transformers", "grpc", "datasets", "pydantic", "numpy", "yaml", "rich"):
        __import__(lib)
    failures = {}
    running: dict[int, tuple[str, int]] = {}  # pid -> (module, read end of its pipe)

    def reap() -> None:  # the oldest child (os.wait() could reap a child an earlier test left to this process)
        pid = next(iter(running))
        name, read = running.pop(pid)
        with os.fdopen(read, "rb") as pipe:  # read to the end first: a child blocked on a full pipe never exits
            error = pickle.loads(pipe.read() or pickle.dumps("child died"))
        os.waitpid(pid, 0)
        if error:
            failures[name] = error

    for name in module_files():
        if len(running) >= max(1, len(os.sched_getaffinity(0))):
            reap()
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            for loaded in [m for m in sys.modules if m == "relayrl" or m.startswith("relayrl.")]:
                del sys.modules[loaded]
            error = ""
            try:
                __import__(name)
            except BaseException:
                error = traceback.format_exc(limit=-3)
            os.write(write, pickle.dumps(error))
            os._exit(0)
        os.close(write)
        running[pid] = (name, read)
    while running:
        reap()
    assert not failures, "\n".join(f"{n}: {e}" for n, e in failures.items())
