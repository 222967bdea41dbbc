"""The package's shape: its layers in one declared order with no import against it, no import cycle, every module
importable alone, the root holds only entry points."""

from __future__ import annotations

import ast
import gc
import importlib
import os
import pickle
import sys
import traceback
from collections.abc import Callable
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
    {"controller", "rollout", "trainer", "models"},  # the roles' logic; models: the built-in demo assets
    {"scorer"},  # reward models, judges and teachers: a judge generates on the rollout workers' engine
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


def imported_names(path: Path, at_import: bool = False) -> set[str]:
    """The dotted names a module imports anywhere in its body (function-level and TYPE_CHECKING imports included),
    or with ``at_import`` only those outside function bodies (what loading the module runs):
    ``from a.b import c`` gives ``a.b.c``."""
    names = set()
    nodes: list[ast.AST] = [ast.parse(path.read_text())]
    while nodes:
        node = nodes.pop()
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
        if not (at_import and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))):
            nodes.extend(ast.iter_child_nodes(node))
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


def preload(dotted: str) -> None:
    """Import the longest importable prefix of ``dotted`` and look the rest up as attributes (so a lazy module's
    ``from transformers import X`` loads X's module); a name that does not import is left to the child to report."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:end]))
            for attr in parts[end:]:
                found = getattr(found, attr)
        except Exception:  # not importable here (an optional engine), or an attribute that is no module
            continue
        return


def fork_with_pipe(body: Callable[[], object]) -> tuple[int, int]:
    """(pid, read end) of a forked child that runs ``body`` and writes its pickled result to the pipe."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            result = body()
        except BaseException:
            result = traceback.format_exc(limit=-3)
        with os.fdopen(write, "wb") as pipe:
            pipe.write(pickle.dumps(result))
        os._exit(0)
    os.close(write)
    return pid, read


def wait_result(pid: int, read: int) -> object:
    """What ``fork_with_pipe``'s child wrote; read to the end first: a child blocked on a full pipe never exits."""
    with os.fdopen(read, "rb") as pipe:
        data = pipe.read()
    os.waitpid(pid, 0)  # this pid only: os.wait() could reap a child an earlier test left to this process
    return pickle.loads(data) if data else "child died"


def import_alone(name: str) -> str:
    """Import ``name`` with no relayrl module loaded: '' or the error's traceback."""
    for loaded in [m for m in sys.modules if m == "relayrl" or m.startswith("relayrl.")]:
        del sys.modules[loaded]
    try:
        __import__(name)
    except BaseException:
        return traceback.format_exc(limit=-3)
    return ""


def import_each_alone(modules: dict[str, Path]) -> dict[str, str]:
    """module -> error for each module that fails to import in a child of its own, forked from a process that
    preloaded every third-party module the package imports at load (so each child costs milliseconds) and no
    relayrl module; as many children at a time as there are CPUs."""
    for dotted in sorted({n for path in modules.values() for n in imported_names(path, at_import=True)}):
        if room(dotted) is None:
            preload(dotted)
    gc.freeze()  # the children's collectors never walk (and so never copy) the preloaded heap
    failures = {}
    running: dict[int, tuple[str, int]] = {}  # pid -> (module, read end of its pipe)
    for name in [*modules, None]:
        while running and (name is None or len(running) >= max(1, len(os.sched_getaffinity(0)))):
            pid = next(iter(running))  # the oldest child
            done, read = running.pop(pid)
            if error := wait_result(pid, read):
                failures[done] = error
        if name is not None:
            pid, read = fork_with_pipe(lambda name=name: import_alone(name))
            running[pid] = (name, read)
    return failures


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_every_module_imports_alone() -> None:
    """Each module in a child that sees only what it imports itself (``import_each_alone``); the preloading runs
    in a forked process, so this test's process does not keep the libraries it loads."""
    failures = wait_result(*fork_with_pipe(lambda: import_each_alone(module_files())))
    assert failures == {}, (
        "\n".join(f"{n}: {e}" for n, e in failures.items()) if isinstance(failures, dict) else failures
    )
