"""The package's imports run one way (docs/architecture.md, "The map"): each module imports only
modules of its own layer or below, nothing imports the package root, and no import chain comes
back to where it started.

Read from the source with ``ast``, so the test needs no import of the package. Imports under
``if TYPE_CHECKING:`` name a type for annotations and never run: they keep to the layers too, but
the circle check leaves them out (the same rule as import-linter's
``exclude_type_checking_imports``), so an owned object may name its owner's type.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "megatron_fsdp"
PACKAGE_DIR = Path(__file__).resolve().parents[1] / PACKAGE

ENGINE_FOOT = "megatron_fsdp.engine.config"
# Top to bottom. A module belongs to the first layer one of whose prefixes names it or a package
# holding it. Modules of one layer may import each other (without a circle).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("megatron_fsdp.integrations", "megatron_fsdp.convert"),  # switches into other programs; offline conversion
    ("megatron_fsdp.utils",),  # upstream's face; finds the wrapper
    ("megatron_fsdp.experimental",),  # upstream v2 names over fsdp2
    ("megatron_fsdp.fully_shard", "megatron_fsdp.plan_memory", "megatron_fsdp.simulate", "megatron_fsdp.fsdp2"),  # the public APIs
    ("megatron_fsdp.megatron_fsdp",),  # the wrapper
    ("megatron_fsdp.param_and_grad_buffer",),  # the face megatron-core reaches through the wrapper
    ("megatron_fsdp.uneven_dtensor", "megatron_fsdp.distributed_data_parallel_config"),
    ("megatron_fsdp.optim",),
    ("megatron_fsdp.checkpoint",),
    # The engine's rooms, top to bottom (docs/architecture.md, "The engine's rooms").
    ("megatron_fsdp.engine.planning",),  # checked arguments to a plan, memory plans
    ("megatron_fsdp.engine.step",),  # units, the schedule, its hooks
    ("megatron_fsdp.engine.buckets",),  # flat buffers and their memory
    ("megatron_fsdp.engine.params",),  # a parameter's layout, pieces and faces
    ("megatron_fsdp.engine.groups",),  # process groups, meshes, collectives
    (ENGINE_FOOT, "megatron_fsdp.engine"),  # the settings every room reads
    ("megatron_fsdp.mixed_precision", "megatron_fsdp._ops", "megatron_fsdp._fake_bucket_pool", "megatron_fsdp.package_info"),
)
# The extension module: compiled, below everything.
EXTENSION = "megatron_fsdp._C"
MAX_LINES = 600


def module_files() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    modules = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _is_type_checking_block(node: ast.AST) -> bool:
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, type_checking: bool) -> list[ast.Import | ast.ImportFrom]:
    """The imports of ``tree``; those under ``if TYPE_CHECKING:`` only with ``type_checking``."""
    found: list[ast.Import | ast.ImportFrom] = []
    pending = list(ast.iter_child_nodes(tree))
    while pending:
        node = pending.pop()
        if _is_type_checking_block(node) and not type_checking:
            pending.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        pending.extend(ast.iter_child_nodes(node))
    return found


def imported_modules(name: str, path: Path, modules: dict[str, Path], type_checking: bool = False) -> set[str]:
    """The package's modules that ``name`` imports when it runs (the extension left out); with
    ``type_checking``, also those it names for annotations."""
    targets: set[str] = set()
    for node in _imports(ast.parse(path.read_text(), str(path)), type_checking):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:
            package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
            package = package[: len(package) - (node.level - 1)]
            base = ".".join(package + ([base] if base else []))
        for alias in node.names:
            candidate = f"{base}.{alias.name}"
            # `from package import submodule` imports the submodule; `from module import name`, the module.
            targets.add(candidate if candidate in modules or candidate == EXTENSION else base)
    resolved = set()
    for target in targets:
        if not (target == PACKAGE or target.startswith(PACKAGE + ".")) or target == EXTENSION:
            continue
        while target not in modules and "." in target:
            target = target.rsplit(".", 1)[0]
        if target != name:
            resolved.add(target)
    return resolved


def import_graph(type_checking: bool = False) -> dict[str, set[str]]:
    modules = module_files()
    return {name: imported_modules(name, path, modules, type_checking) for name, path in modules.items()}


def layer_of(module: str) -> int:
    for index, prefixes in enumerate(LAYERS):
        if any(module == prefix or module.startswith(prefix + ".") for prefix in prefixes):
            return index
    raise AssertionError(f"{module} is in no layer: add it to LAYERS in {Path(__file__).name}")


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in sorted(graph[module]):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_every_module_has_a_layer() -> None:
    for module in import_graph():
        if module != PACKAGE:
            layer_of(module)


def test_every_engine_module_is_in_a_room() -> None:
    """Only the settings sit at the engine's foot; every other engine module is in a room."""
    foot = layer_of(ENGINE_FOOT)
    loose = [m for m in import_graph() if m.startswith("megatron_fsdp.engine.") and m != ENGINE_FOOT and layer_of(m) == foot]
    assert not loose, f"engine modules outside the rooms (move each into the room of its concern): {loose}"


def test_no_module_imports_a_layer_above_it() -> None:
    upward = [
        f"{module} (layer {layer_of(module)}) imports {target} (layer {layer_of(target)})"
        for module, targets in import_graph(type_checking=True).items()
        if module != PACKAGE
        for target in sorted(targets)
        if target != PACKAGE and layer_of(target) < layer_of(module)
    ]
    assert not upward, "imports that run up the layers:\n" + "\n".join(upward)


def test_no_module_imports_the_package_root() -> None:
    importers = [module for module, targets in import_graph().items() if PACKAGE in targets]
    assert not importers, f"import from the module that holds the name, not from {PACKAGE}: {importers}"


def test_imports_form_no_circle() -> None:
    found = circles(import_graph())
    assert not found, f"import circles: {found}"


def test_no_module_outgrows_one_concern() -> None:
    long_files = {
        str(path.relative_to(PACKAGE_DIR.parent)): lines
        for path in module_files().values()
        if (lines := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long_files, f"files over {MAX_LINES} lines (split by concern): {long_files}"


def test_the_checker_sees_an_upward_import(tmp_path: Path) -> None:
    """The rules above can fail: a made-up engine module importing the wrapper is caught."""
    modules = module_files()
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from typing import TYPE_CHECKING\n"
        "from megatron_fsdp.megatron_fsdp import MegatronFSDP\n"
        "if TYPE_CHECKING:\n"
        "    from megatron_fsdp.fully_shard import fully_shard\n"
    )
    targets = imported_modules("megatron_fsdp.engine.step.probe", probe, modules)
    assert targets == {"megatron_fsdp.megatron_fsdp"}
    annotated = imported_modules("megatron_fsdp.engine.step.probe", probe, modules, type_checking=True)
    assert annotated == {"megatron_fsdp.megatron_fsdp", "megatron_fsdp.fully_shard"}
    assert layer_of("megatron_fsdp.megatron_fsdp") < layer_of("megatron_fsdp.engine.step.probe")
    assert layer_of("megatron_fsdp.engine.step.units") < layer_of("megatron_fsdp.engine.buckets.buffer")
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]
