"""The shape of the code in megatron/ (node_modules aside); each rule's analysis is first shown to
catch a small synthetic violation, then run on the real tree:

- No import circle between modules. Imports inside functions count, and so do imports under
  `if TYPE_CHECKING:`: two modules that name each other's types still need each other.
- No module reads or writes another module's private names: `from megatron.x import _name`
  (relative imports too), `module._name` on one of our modules, or `obj._name` (also through
  getattr/setattr/hasattr with the name as a string), obj being neither self, cls nor super(),
  where `_name` is defined by other modules of ours (def, class, module- or class-level name,
  `self._name = ...`, or set on objects there) and not by the reading module. Left alone: privates
  of other packages (the base is bound to an import from outside megatron/, e.g. megatron-core's
  parallel_state or torch), compiled extensions (`_C`), dunder names.
- No module over about 400 lines without saying why in its docstring."""
from __future__ import annotations

import ast
import functools
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[2]
LONG = 420  # "about 400 lines"


def _modules(root: Path = ROOT) -> dict[str, Path]:
    modules = {}
    for path in (root / "megatron").rglob("*.py"):
        if "node_modules" in path.parts:
            continue
        name = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = path
    return modules


@functools.lru_cache(maxsize=None)
def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _imported_from(node: ast.ImportFrom, name: str, path: Path) -> str:
    """The absolute name of the module `from ... import` reads, relative imports resolved."""
    base = node.module or ""
    if node.level:
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        parts = package.split(".")
        base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
    return base


def _compiled(root: Path, module: str, member: str) -> bool:
    """`member` of `module` is a compiled extension (`_C`), not a module of ours."""
    return any((root / module.replace(".", "/")).glob(f"{member}*.so"))


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the modules of ours it imports anywhere (functions and TYPE_CHECKING blocks too)."""
    modules = _modules(root)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(_parse(path)):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _imported_from(node, name, path)
                # `from pkg import name`: a submodule if there is one, else something of pkg itself
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names if not _compiled(root, base, alias.name)]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


# --- private names ----------------------------------------------------------------------------
def _is_private(name: str) -> bool:
    return name.startswith("_") and name.strip("_") != "" and not (name.startswith("__") and name.endswith("__"))


def _is_own(base: ast.expr) -> bool:
    """`self`, `cls` or `super()`: the object's own attributes, wherever its classes live."""
    if isinstance(base, ast.Name):
        return base.id in ("self", "cls")
    return isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super"


def _dotted(expr: ast.expr) -> str | None:
    if isinstance(expr, ast.Name):
        return expr.id
    if isinstance(expr, ast.Attribute):
        base = _dotted(expr.value)
        return None if base is None else f"{base}.{expr.attr}"
    return None


Use = tuple[ast.AST, ast.expr, str, bool]  # node, base, attribute name, written (not read)


def _attribute_uses(nodes: list[ast.AST]) -> Iterator[Use]:
    """(node, base, name, is_write) for each `base.name` and `getattr/setattr/hasattr(base, "name")`."""
    for node in nodes:
        if isinstance(node, ast.Attribute):
            yield node, node.value, node.attr, isinstance(node.ctx, (ast.Store, ast.Del))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) >= 2
              and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            yield node, node.args[0], node.args[1].value, node.func.id in ("setattr", "delattr")


def _definitions(tree: ast.Module, nodes: list[ast.AST], uses: list[Use]) -> set[str]:
    """Private names the module defines itself: defs and classes, module- and class-level names,
    and attributes it sets on self/cls."""
    defined = {node.name for node in nodes
               if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    outside_functions = [tree]
    while outside_functions:
        for child in ast.iter_child_nodes(outside_functions.pop()):
            if isinstance(child, ast.Name) and isinstance(child.ctx, ast.Store):
                defined.add(child.id)
            elif not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                outside_functions.append(child)
    defined.update(name for _, base, name, is_write in uses if is_write and _is_own(base))
    return {name for name in defined if _is_private(name)}


class _Module:
    """What one module imports, defines, and sets on other objects."""

    def __init__(self, modules: dict[str, Path], name: str) -> None:
        self.name, self.path, self.modules = name, modules[name], modules
        tree = _parse(self.path)
        self.nodes = list(ast.walk(tree))
        self.uses = list(_attribute_uses(self.nodes))
        self.imports: dict[str, str] = {}  # bound name -> the dotted thing it stands for
        for node in self.nodes:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    bound = alias.asname or alias.name.partition(".")[0]
                    self.imports[bound] = alias.name if alias.asname else bound
            elif isinstance(node, ast.ImportFrom):
                base = _imported_from(node, name, self.path)
                for alias in node.names:
                    self.imports[alias.asname or alias.name] = f"{base}.{alias.name}"
        self.defined = _definitions(tree, self.nodes, self.uses)
        self.sets_on_others = {n for _, base, n, is_write in self.uses
                               if is_write and _is_private(n) and self.whose(base)[0] == "ours-object"}

    def ours(self, dotted: str) -> bool:
        parts = dotted.split(".")
        return any(".".join(parts[:i]) in self.modules for i in range(len(parts), 0, -1))

    def whose(self, base: ast.expr) -> tuple[str, str]:
        """("own" | "ours-module" | "ours-object" (or unknown) | "theirs", the dotted name imported)
        for the object `base` stands for; "theirs" is bound to another package's import."""
        if _is_own(base):
            return "own", ""
        dotted = _dotted(base)
        root, _, rest = (dotted or "").partition(".")
        if root not in self.imports:
            return "ours-object", ""
        full = self.imports[root] + (f".{rest}" if rest else "")
        if full in self.modules:
            return "ours-module", full
        return ("ours-object" if self.ours(full) else "theirs"), full


def private_reads(root: Path = ROOT) -> list[tuple[str, str, str]]:
    """(module, private name, "path:line: what") for each use of another module's private name."""
    modules = _modules(root)
    facts = {name: _Module(modules, name) for name in modules}
    owners: dict[str, set[str]] = {}
    for name, module in facts.items():
        for private in module.defined | module.sets_on_others:
            owners.setdefault(private, set()).add(name)
    found = []
    for name, module in facts.items():
        where = module.path.relative_to(root)
        for node in module.nodes:
            if isinstance(node, ast.ImportFrom):
                base = _imported_from(node, name, module.path)
                for alias in node.names:
                    if _is_private(alias.name) and module.ours(base) and not _compiled(root, base, alias.name):
                        found.append((name, alias.name, f"{where}:{node.lineno}: from {base} import {alias.name}"))
        for node, base, private, _ in module.uses:
            if not _is_private(private):
                continue
            kind, imported = module.whose(base)
            if kind == "ours-module" and not _compiled(root, imported, private):
                found.append((name, private, f"{where}:{node.lineno}: {ast.unparse(node)} (a private of that module)"))
            elif kind == "ours-object" and private not in module.defined and owners.get(private, set()) - {name}:
                others = ", ".join(sorted(owners[private] - {name}))
                found.append((name, private, f"{where}:{node.lineno}: {ast.unparse(node)} (defined in {others})"))
    return found


# --- the analysis on synthetic trees ----------------------------------------------------------
def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for relative, text in files.items():
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_the_analysis_finds_a_circle_through_an_import_inside_a_function():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    real = import_graph()
    assert "megatron.app.executor" in real["megatron.dpp.order"]


def test_the_analysis_finds_a_circle_hidden_behind_type_checking(tmp_path):
    """The shape Handle and Endpoint had: one imports the other, which names it back only for
    type checking. A compiled extension imported from the package is no edge to its __init__."""
    root = _tree(tmp_path, {
        "megatron/pkg/__init__.py": "",
        "megatron/pkg/handle.py": ("from typing import TYPE_CHECKING\n"
                                   "if TYPE_CHECKING:\n    from .endpoint import Endpoint\n"),
        "megatron/pkg/endpoint.py": "from megatron.pkg.handle import Handle\nfrom . import _C\n",
        "megatron/pkg/_C.cpython-311-x86_64-linux-gnu.so": "",
    })
    assert cycles(import_graph(root)) == [["megatron.pkg.endpoint", "megatron.pkg.handle"]]


def test_the_analysis_finds_reads_of_another_modules_private_names(tmp_path):
    """Each form of reading or writing another module's private name, by line of reader.py, and
    what is left alone: a module's own attributes, other packages' privates, `_C`, dunders."""
    root = _tree(tmp_path, {
        "megatron/pkg/__init__.py": "",
        "megatron/pkg/_C.cpython-311-x86_64-linux-gnu.so": "",
        "megatron/pkg/owner.py": ("_LIMIT = 3\n"
                                  "def _helper(): pass\n"
                                  "class Engine:\n"
                                  "    _slots = 4\n"
                                  "    def __init__(self):\n        self._state = 0\n        self.__dict__\n"
                                  "    def _settle(self): self._state = 1\n"),
        "megatron/pkg/reader.py": ("from megatron.pkg.owner import _LIMIT\n"                        # 1 (i)
                                   "from .owner import _helper, Engine\n"                           # 2 (i)
                                   "from megatron.pkg import owner as o, _C\n"                     # 3 compiled
                                   "from megatron.core import parallel_state\n"
                                   "import torch\n"
                                   "def use(engine, other):\n"
                                   "    o._LIMIT\n"                                               # 7 (ii)
                                   "    engine._settle()\n"                                       # 8 (iii)
                                   "    other._state = 2\n"                                       # 9 (iii) a write
                                   "    getattr(engine, '_slots')\n"                              # 10 (iii)
                                   "    parallel_state._GLOBAL_MEMORY_BUFFER\n"                   # third-party
                                   "    torch._C._get_tracing_state\n"                            # third-party
                                   "    _C.Engine, engine.__dict__, engine._own\n"                # nothing to flag
                                   "class Reader:\n"
                                   "    def __init__(self): self._own = 1\n"
                                   "    def read(self): return self._state, super()._settle()\n"),  # own
        "megatron/pkg/tagger.py": "def tag(fn): fn._tagged = True\n",                             # sets, nobody reads
        "megatron/pkg/state_user.py": "class Local:\n    def __init__(self): self._state = 0\n"
                                      "def peek(local): return local._state\n",                  # defines it too
    })
    found = sorted((module, private, text.split(":")[1]) for module, private, text in private_reads(root))
    assert found == [("megatron.pkg.reader", "_LIMIT", "1"), ("megatron.pkg.reader", "_LIMIT", "7"),
                     ("megatron.pkg.reader", "_helper", "2"), ("megatron.pkg.reader", "_settle", "8"),
                     ("megatron.pkg.reader", "_slots", "10"), ("megatron.pkg.reader", "_state", "9")]


def test_an_attribute_one_module_sets_on_objects_is_private_to_it(tmp_path):
    """A private attribute stuck on objects (here: functions) by one module is read nowhere else."""
    root = _tree(tmp_path, {
        "megatron/pkg/__init__.py": "",
        "megatron/pkg/wrap.py": "def wrap(fn):\n    fn._original = fn\n    return fn\n",
        "megatron/pkg/unwrap.py": "def unwrap(fn):\n    return fn._original\n",
    })
    assert [text for _, _, text in private_reads(root)] == [
        "megatron/pkg/unwrap.py:2: fn._original (defined in megatron.pkg.wrap)"]


# --- the real tree -----------------------------------------------------------------------------
def test_no_import_circle_in_megatron():
    assert cycles(import_graph()) == []


def test_no_module_reads_another_modules_private_names():
    found = [text for _, _, text in private_reads()]
    assert found == [], "\n".join(found)


def test_long_modules_say_why():
    unexplained = []
    for name, path in _modules().items():
        lines = path.read_text().count("\n")
        docstring = " ".join((ast.get_docstring(_parse(path)) or "").split())
        if lines > LONG and "over 400 lines" not in docstring.lower():
            unexplained.append(f"{name}: {lines} lines")
    assert not unexplained, unexplained
