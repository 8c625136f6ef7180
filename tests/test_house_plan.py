"""The house plan (docs/architecture.md): every import in ``specprefill_rag``
points down a floor, the HTTP transport is the server backend's own, and no function runs long.

Read with ``ast`` (imports inside functions and under ``TYPE_CHECKING`` count as well), nothing is
imported. A module on no floor fails the test: place a new module before adding it.

The draft wing (``specprefill_rag/draft/``) is one entry on its floor and has one narrow door:
outside it, the library, the examples and the integrations import ``specprefill_rag.draft`` itself
(a handful of names), never a module inside it; the benchmarks may use its research hooks too
(``specprefill_rag.draft.probe``, unstable); the unit tests of a wing module may import that module.
Nothing outside a wing (a top-level module or package of the library) but its unit tests uses a
private name of it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = "specprefill_rag"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

# Floors, lowest first: a module may import modules on its own floor or below, never above.
FLOORS: list[set[str]] = [
    {"errors", "types", "durable", "loading", "caches", "detokenize", "grammar", "schema_limits"},
    {"prompt", "config", "streams", "wire", "toolcalls"},  # prompt: segments, render, length guard (a package)
    {"draft", "selection", "payoff", "compress"},  # draft: the wing (``specprefill_rag/draft/``), one entry
    {"vllm_plugin"},
    {"backends"},
    {"engine", "decoding", ""},  # "": the package's __init__, the public face over the engine
    {"gateway", "testing"},
    {"tools", "adapters"},  # adapters: the integrations' one door into the core (a leaf, as tools is)
]
MAX_FUNCTION_LINES = 60
WING = "draft"
MAX_WING_MODULE_LINES = 500
MAX_WING_CLASS_LINES = 300
# Outside the package, what must enter the wing through its door (tests/ may reach inside).
DOOR_USERS = ("benchmarks", "examples", "integrations", "client_tests")
PROBE = f"{WING}.probe"  # the wing's research hooks: the benchmarks' second door
PROBE_USERS = ("benchmarks",)
MAX_DOOR_NAMES = 6
REPO = ROOT.parent


def _modules() -> dict[str, Path]:
    """Dotted name (without the package) → file, for every module of the package."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _floor(module: str) -> int:
    top = module.split(".")[0]
    for level, names in enumerate(FLOORS):
        if top in names:
            return level
    raise AssertionError(f"{PACKAGE}.{module} is on no floor of the house plan: add it to FLOORS")


def _is_package(module: str) -> bool:
    return MODULES[module].name == "__init__.py"


def _imports(module: str) -> set[str]:
    """The package modules ``module`` imports (relative or absolute, anywhere in the file)."""
    tree = ast.parse(MODULES[module].read_text())
    here = module.split(".") if module else []
    package = here if _is_package(module) else here[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bases = [alias.name for alias in node.names]
            names: list[str] = []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = package[: len(package) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            elif node.module == PACKAGE or (node.module or "").startswith(PACKAGE + "."):
                base = (node.module or "")[len(PACKAGE) + 1:]
            else:
                continue
            bases, names = [base], [alias.name for alias in node.names]
        else:
            continue
        for base in bases:
            if isinstance(node, ast.Import):
                if base != PACKAGE and not base.startswith(PACKAGE + "."):
                    continue
                base = base[len(PACKAGE) + 1:]
            submodules = [f"{base}.{n}".lstrip(".") for n in names if f"{base}.{n}".lstrip(".") in MODULES]
            found.update(submodules or [base])
    found.discard(module)
    return {name for name in found if name in MODULES}


@pytest.mark.parametrize("module", sorted(MODULES), ids=lambda m: m or PACKAGE)
def test_imports_point_down(module):
    floor = _floor(module)
    upward = sorted(f"{PACKAGE}.{name}".rstrip(".") for name in _imports(module) if _floor(name) > floor)
    assert not upward, f"{PACKAGE}.{module} (floor {floor}) imports a higher floor: {upward}"


def test_the_plan_catches_an_upward_import():
    """The check itself: a core module importing tools, or the plugin importing a backend, fails."""
    assert _floor("tools.cli") > _floor("draft") and _floor("backends.base") > _floor("vllm_plugin.runner")
    assert _floor("wire") < _floor("vllm_plugin") < _floor("backends") < _floor("engine") < _floor("gateway")


def test_the_http_transport_is_the_server_backends_own():
    users = sorted(m for m in MODULES if "backends.vllm_http" in _imports(m))
    assert users == ["backends.vllm_server"]


def test_backends_reach_the_plugin_only_to_host_vllm_in_process():
    """The wire format is ``wire``; only the offline backend, which runs vLLM in this process,
    imports the plugin (to register it there)."""
    users = sorted(m for m in MODULES if m.startswith("backends") and any(
        name.startswith("vllm_plugin") for name in _imports(m)))
    assert users == ["backends.vllm_offline"]


def test_nothing_in_the_library_imports_tools_gateway_or_testing():
    for leaf in ("tools", "gateway", "testing"):
        users = sorted(m for m in MODULES if not m.startswith(leaf) and m.split(".")[0] not in ("tools", "adapters")
                       and any(name.split(".")[0] == leaf for name in _imports(m)))
        assert users == [], f"{leaf} is imported by {users}"


def test_no_function_is_longer_than_the_limit():
    long = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{PACKAGE}.{module}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def _wing_submodules_imported(path: Path, module: str | None = None) -> set[str]:
    """The wing's inner modules (``draft.<name>``) that the file at ``path`` imports: by an
    absolute import, or, for a module of the package (``module``), by a relative one too."""
    if module is not None:
        return {name for name in _imports(module) if name.startswith(WING + ".")}
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            dotted = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            dotted = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in dotted:
            if name.startswith(f"{PACKAGE}.{WING}.") and name[len(PACKAGE) + 1:] in MODULES:
                found.add(name[len(PACKAGE) + 1:])
    return found


def test_nothing_outside_the_wing_imports_a_module_inside_it():
    """``specprefill_rag.draft`` is the wing's one door (its ``__all__``)."""
    inside = sorted(
        f"{PACKAGE}.{module}: {sorted(found)}" for module in MODULES
        if module != WING and not module.startswith(WING + ".")
        and (found := _wing_submodules_imported(MODULES[module], module))
    )
    outside = sorted(
        f"{path.relative_to(REPO)}: {sorted(found)}" for folder in DOOR_USERS for path in _python_files(folder)
        if (found := _wing_submodules_imported(path) - ({PROBE} if folder in PROBE_USERS else set()))
    )
    assert not inside and not outside, f"wing modules imported past the door: {inside + outside}"


def _python_files(folder: str) -> list[Path]:
    return [path for path in sorted((REPO / folder).rglob("*.py")) if ".venv" not in path.parts]


def test_the_wings_door_is_narrow():
    """``specprefill_rag.draft`` exports what the engine and a user need, at most ``MAX_DOOR_NAMES``
    names, and each is there; the research hooks are the probe's."""
    import specprefill_rag.draft as door

    tree = ast.parse(MODULES[WING].read_text())
    exported = next(ast.literal_eval(node.value) for node in tree.body
                    if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "__all__")
    assert 0 < len(exported) <= MAX_DOOR_NAMES, exported
    assert all(hasattr(door, name) for name in exported)
    assert {"DraftModel", "DraftScorer"} <= set(exported)


def _wing_of(module: str) -> str:
    return module.split(".")[0]


def _resolve(node: ast.ImportFrom, module: str | None) -> str | None:
    """The package module (dotted, without the package) an import names, or None if outside."""
    if node.level:
        if module is None:
            return None
        here = module.split(".") if module else []
        package = here if _is_package(module) else here[:-1]
        anchor = package[: len(package) - (node.level - 1)]
        return ".".join(anchor + ([node.module] if node.module else []))
    if node.module == PACKAGE or (node.module or "").startswith(PACKAGE + "."):
        return (node.module or "")[len(PACKAGE) + 1:]
    return None


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_uses(path: Path, module: str | None = None) -> list[str]:
    """Private names of another wing the file at ``path`` uses: imported (``from m import _x``) or
    read off an imported module (``m._x``). ``module``: the file's own name if it is in the package."""
    mine = None if module is None else _wing_of(module)
    tree = ast.parse(path.read_text())
    modules: dict[str, str] = {}  # local name → package module it is bound to
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(PACKAGE + ".") and alias.asname:
                    modules[alias.asname] = alias.name[len(PACKAGE) + 1:]
        elif isinstance(node, ast.ImportFrom) and (base := _resolve(node, module)) is not None:
            for alias in node.names:
                target = f"{base}.{alias.name}".lstrip(".")
                if target in MODULES:
                    modules[alias.asname or alias.name] = target
                elif _is_private(alias.name) and _wing_of(base) != mine:
                    found.append(f"{base}.{alias.name}")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and _is_private(node.attr)
                and (target := modules.get(node.value.id)) is not None and _wing_of(target) != mine):
            found.append(f"{target}.{node.attr}")
    return sorted(set(found))


def test_nothing_outside_a_wing_uses_its_private_names():
    """A leading underscore means "this wing's own": the library's other wings, the benchmarks, the
    examples and the integrations reach a wing through its public names only (a wing's unit tests
    may test its private helpers, as they may import its inner modules)."""
    inside = [f"{PACKAGE}.{module}: {found}" for module, path in MODULES.items()
              if (found := _private_uses(path, module))]
    outside = [f"{path.relative_to(REPO)}: {found}" for folder in DOOR_USERS for path in _python_files(folder)
               if (found := _private_uses(path))]
    assert not inside + outside, f"private names used outside their wing: {inside + outside}"


def test_the_private_name_check_catches_both_forms(tmp_path):
    path = tmp_path / "bench.py"
    path.write_text("from specprefill_rag.tools.cli import _parser\n"
                    "from specprefill_rag.vllm_plugin import runner as plugin_runner\n"
                    "from specprefill_rag.config.checks import check as _check\n"
                    "plugin_runner._wrap(plugin_runner.MARK)\n")
    assert _private_uses(path) == ["tools.cli._parser", "vllm_plugin.runner._wrap"]


def test_the_door_check_catches_a_module_imported_past_it(tmp_path):
    path = tmp_path / "bench.py"
    path.write_text("from specprefill_rag.draft import DraftModel, scoring\nimport specprefill_rag.draft.capture\n")
    assert _wing_submodules_imported(path) == {"draft.scoring", "draft.capture"}


ADAPTERS = "adapters"  # the integrations' one door into the core


def _core_modules_imported(path: Path) -> set[str]:
    """The ``specprefill_rag`` modules a file outside the package imports (``""``: the package)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
        found.update(name[len(PACKAGE) + 1:] for name in names if name == PACKAGE or name.startswith(PACKAGE + "."))
    return found


def test_the_integrations_enter_the_core_through_the_adapters_only():
    """The integration packages' code (not their tests) imports ``specprefill_rag.adapters`` and
    nothing else of the core: what they share is said there once."""
    found = {f"{path.relative_to(REPO)}: {sorted(used)}" for path in _python_files("integrations")
             if "tests" not in path.relative_to(REPO).parts
             and (used := _core_modules_imported(path) - {ADAPTERS})}
    assert not found, f"integrations past the adapters: {sorted(found)}"


def test_the_adapters_check_catches_a_core_import(tmp_path):
    path = tmp_path / "chat.py"
    path.write_text("from specprefill_rag import Passage\nimport specprefill_rag.engine\n"
                    "from specprefill_rag.adapters import option\n")
    assert _core_modules_imported(path) == {"", "engine", ADAPTERS}


def test_the_wings_modules_and_classes_stay_small():
    """A module over ~400 lines is usually two concepts (the house style): the wing keeps each under
    ``MAX_WING_MODULE_LINES`` and each class under ``MAX_WING_CLASS_LINES``."""
    long = []
    for module, path in MODULES.items():
        if module != WING and not module.startswith(WING + "."):
            continue
        text = path.read_text()
        if len(text.splitlines()) > MAX_WING_MODULE_LINES:
            long.append(f"{PACKAGE}.{module} ({len(text.splitlines())} lines)")
        for node in ast.walk(ast.parse(text)):
            lines = (getattr(node, "end_lineno", None) or 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, ast.ClassDef) and lines > MAX_WING_CLASS_LINES:
                long.append(f"{PACKAGE}.{module}.{node.name} ({lines} lines)")
    assert not long, f"too long for the wing: {long}"


MAX_MODULE_LINES = 500
MAX_CLASS_LINES = 300
MAX_PARAMETERS = 8  # self/cls not counted; *args and **kwargs count one each


def _too_long(module: str, path: Path) -> list[str]:
    """The module, if over ``MAX_MODULE_LINES``, and its classes over ``MAX_CLASS_LINES``."""
    text = path.read_text()
    name = f"{PACKAGE}.{module}".rstrip(".")
    found = [f"{name} ({len(text.splitlines())} lines)"] if len(text.splitlines()) > MAX_MODULE_LINES else []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef):
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if lines > MAX_CLASS_LINES:
                found.append(f"{name}.{node.name} ({lines} lines)")
    return found


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Parameters a caller can give: self/cls not counted, ``*args`` and ``**kwargs`` one each."""
    args = node.args
    names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
    if names and names[0] in ("self", "cls"):
        names = names[1:]
    return len(names) + (args.vararg is not None) + (args.kwarg is not None)


def _too_many_parameters(module: str, path: Path) -> list[str]:
    name = f"{PACKAGE}.{module}".rstrip(".")
    return [f"{name}.{node.name} ({count} parameters)" for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and (count := _parameters(node)) > MAX_PARAMETERS]


def test_no_module_or_class_is_too_long():
    """A module over ~400 lines is usually two concepts (the house style): every module stays within
    ``MAX_MODULE_LINES`` and every class within ``MAX_CLASS_LINES``."""
    found = {entry for module, path in MODULES.items() for entry in _too_long(module, path)}
    assert not found, f"too long: {sorted(found)}"


def test_no_function_takes_too_many_parameters():
    """A function taking more than ``MAX_PARAMETERS`` wants a frozen spec object (the house style)."""
    found = {entry for module, path in MODULES.items() for entry in _too_many_parameters(module, path)}
    assert not found, f"more than {MAX_PARAMETERS} parameters: {sorted(found)}"


# Room to grow: nothing in the package sits within 5% of a limit, so that a fix or a docstring never
# lands a module, class or function over one; a change that needs more splits by concept first.
ROOM_PERCENT = 95  # of each limit, rounded down


def _roomy(limit: int) -> int:
    """The most a module, class or function may hold under ``limit`` with the margin left."""
    return limit * ROOM_PERCENT // 100


def _near_a_limit(module: str, path: Path) -> list[str]:
    """What of the module sits within 5% of a limit (``_roomy``): the module's lines, a class's,
    a function's lines or its parameters."""
    text = path.read_text()
    name = f"{PACKAGE}.{module}".rstrip(".")
    n_lines = len(text.splitlines())
    found = [f"{name} ({n_lines} lines)"] if n_lines > _roomy(MAX_MODULE_LINES) else []
    for node in ast.walk(ast.parse(text)):
        lines = (getattr(node, "end_lineno", None) or 0) - getattr(node, "lineno", 0) + 1
        if isinstance(node, ast.ClassDef) and lines > _roomy(MAX_CLASS_LINES):
            found.append(f"{name}.{node.name} ({lines} lines)")
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if lines > _roomy(MAX_FUNCTION_LINES):
                found.append(f"{name}.{node.name} ({lines} lines)")
            if _parameters(node) > _roomy(MAX_PARAMETERS):
                found.append(f"{name}.{node.name} ({_parameters(node)} parameters)")
    return found


def test_nothing_sits_within_five_percent_of_a_limit():
    """Modules within 475 lines, classes 285, functions 57 lines and 7 parameters: a margin under
    every limit above, so that the next change finds room (split by concept, never by squeezing)."""
    roomy = [_roomy(limit) for limit in (MAX_MODULE_LINES, MAX_CLASS_LINES, MAX_FUNCTION_LINES, MAX_PARAMETERS)]
    assert roomy == [475, 285, 57, 7]
    found = {entry for module, path in MODULES.items() for entry in _near_a_limit(module, path)}
    assert not found, f"within 5% of a limit: {sorted(found)}"


# The same limits, with the same room, for the code beside the package.
BESIDE = ("benchmarks", "examples", "integrations", "client_tests")


def test_the_code_beside_the_package_keeps_the_same_limits_with_room():
    """The benchmarks, examples, integrations and client tests: no module over 475 lines, class
    over 285, function over 57 lines or 7 parameters (the package's limits less 5%)."""
    found = sorted(entry.removeprefix(f"{PACKAGE}.") for folder in BESIDE for path in _python_files(folder)
                   for entry in _near_a_limit(".".join(path.relative_to(REPO).with_suffix("").parts), path))
    assert not found, f"within 5% of a limit, or over it: {found}"


def test_the_margin_check_catches_what_sits_near_a_limit(tmp_path):
    path = tmp_path / "near.py"
    classes = _roomy(MAX_CLASS_LINES)
    body = "\n".join(f"    x{i} = {i}" for i in range(classes))
    path.write_text(f"class Near:\n{body}\n\n\ndef f(a, b, c, d, e, f, g, h):\n    pass\n")
    assert _near_a_limit("near", path) == [f"{PACKAGE}.near.Near ({classes + 1} lines)",
                                           f"{PACKAGE}.near.f (8 parameters)"]


def test_the_size_checks_catch_an_offender(tmp_path):
    path = tmp_path / "big.py"
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_CLASS_LINES))
    path.write_text(f"class Big:\n{body}\n\n\ndef f(self, a, b, c, d, e, f, g, h, *rest, **more):\n    pass\n")
    assert _too_long("big", path) == [f"{PACKAGE}.big.Big ({MAX_CLASS_LINES + 1} lines)"]
    assert _too_many_parameters("big", path) == [f"{PACKAGE}.big.f (10 parameters)"]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle of ``graph`` (module → modules it imports), each once, as a path that
    starts at its smallest name; a package and its own modules (``__init__`` re-exports) do not count."""
    found: set[tuple[str, ...]] = set()

    def walk(path: list[str]) -> None:
        for name in sorted(graph.get(path[-1], ())):
            if name == path[0]:
                found.add(tuple(path))
            elif name not in path and name > path[0]:
                walk([*path, name])

    for start in sorted(graph):
        walk([start])
    return [list(cycle) for cycle in sorted(found)]


def test_no_import_circles_between_modules():
    """Modules of one floor may import one another, but never round in a circle (``TYPE_CHECKING``
    imports count: a type-only circle still ties two modules into one concept)."""
    def related(a: str, b: str) -> bool:
        return a == b or a.startswith(b + ".") or b.startswith(a + ".") or not a or not b

    graph = {m: {n for n in _imports(m) if not related(m, n)} for m in MODULES}
    assert _cycles(graph) == []


def test_the_circle_check_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
