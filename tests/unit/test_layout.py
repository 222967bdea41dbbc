"""The package's shape: its layers in one declared order with no import against it, no import cycle, every module
importable alone, the root holds only entry points."""

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
# entry points (the CLI, what `relayrl up` and `relayrl check-engine` run) and cross-cutting types and helpers
ROOT_MODULES = {"__init__", "cli", "launcher", "check_engine", "config", "errors", "registry", "imports"}
ROOT = "__init__"  # the room of the package's own __init__ (``import relayrl``)
# The package's rooms (its top-level modules and packages) bottom to top. A module imports only from its own room
# or from a lower layer: rooms of one layer never import each other; what two of them share moves down a layer.
LAYERS: list[set[str]] = [
    {ROOT, "v1", "errors", "registry", "imports"},  # generated stubs, error codes, registries by name, spec imports
    {"wire", "runtime"},  # wire types (sampling parameters, LoRA spec); process plumbing that knows no config
    {"config"},
    {"rpc", "cores"},  # gRPC plumbing (channels, auth, retry, server, request checks); threads and pinning per role
    {"data", "rewards", "client", "weightsync", "algorithms"},  # what the roles share (algorithms: pure functions)
    {"env"},
    {"episodes"},
    {"controller", "rollout", "trainer", "scorer", "models"},  # the roles' logic; models: the built-in demo assets
    {"ops"},  # operating a job: supervision, placement, scaling, deploy manifests, operator commands
    {"services"},  # the role servers
    {"launcher", "check_engine"},  # what `relayrl up` and `relayrl check-engine` run: they compose the roles
    {"cli", "bench"},
]


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


def imported_names(path: Path) -> set[str]:
    """The dotted names a module imports anywhere in its body (function-level and TYPE_CHECKING imports included):
    ``from a.b import c`` gives ``a.b.c``."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the package modules it imports anywhere in its body (function-level imports included)."""

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        targets = {owner(imported) for imported in imported_names(path)}
        graph[name] = {t for t in targets if t and t != name}
    return graph


def room(name: str) -> str | None:
    """The room (top-level module or package) of a dotted name in the package, None for a name outside it."""
    parts = name.split(".")
    if parts[0] != PACKAGE.name:
        return None
    return parts[1] if len(parts) > 1 else ROOT


def layer_violations(imports: dict[str, set[str]], layers: list[set[str]]) -> list[str]:
    """``module -> target (room layer -> room layer)`` for each import in ``imports`` (module -> dotted names) that
    goes to another room of the same or a higher layer, or from or to a room no layer names."""
    level = {name: i for i, layer in enumerate(layers) for name in layer}
    found = []
    for module, targets in sorted(imports.items()):
        for target in sorted(targets):
            source, dest = room(module), room(target)
            if dest is None or dest == source:
                continue
            if source not in level or dest not in level or level[dest] >= level[source]:
                where = f"{source} {level.get(source, '?')} -> {dest} {level.get(dest, '?')}"
                found.append(f"{module} -> {target} ({where})")
    return found


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


def test_imports_follow_the_layers() -> None:
    imports = {name: imported_names(path) for name, path in module_files().items()}
    violations = layer_violations(imports, LAYERS)
    assert not violations, "imports against the layers (room layer -> room layer, 0 at the bottom):\n" + "\n".join(
        violations
    )


def test_layer_check_flags_upward_sideways_and_unplaced_imports() -> None:
    layers = [{ROOT, "errors"}, {"wire", "runtime"}, {"config"}, {"cli"}]
    imports = {
        "relayrl.config": {"relayrl.wire.sampling.temperature_ok", "relayrl.cli.main", "yaml.safe_load"},
        "relayrl.wire.sampling": {"relayrl.runtime.ports", "relayrl.wire.lora", "relayrl.v1"},
        "relayrl.cli": {"relayrl.errors.RelayError", "relayrl"},
    }
    assert layer_violations(imports, layers) == [
        "relayrl.config -> relayrl.cli.main (config 2 -> cli 3)",
        "relayrl.wire.sampling -> relayrl.runtime.ports (wire 1 -> runtime 1)",
        "relayrl.wire.sampling -> relayrl.v1 (wire 1 -> v1 ?)",
    ]


def test_every_room_is_in_exactly_one_layer() -> None:
    rooms = {p.stem for p in PACKAGE.glob("*.py")} | {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    placed = [name for layer in LAYERS for name in layer]
    twice = sorted({name for name in placed if placed.count(name) > 1})
    assert not twice, f"rooms in more than one layer: {twice}"
    assert set(placed) == rooms, (
        f"unplaced rooms: {sorted(rooms - set(placed))}; no such room: {sorted(set(placed) - rooms)}"
    )


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
