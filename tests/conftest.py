"""The checkout on sys.path, and the markers that set unit tests apart from multi-process runs.

A test is marked `multiprocess`, `server` or `browser` by what it reaches, not by hand: at
collection the code of the test, of its fixtures and of the functions they call in this checkout
(tests/launch.py, megatron/, tools/; not torch or megatron-core) is followed, and a reference to
subprocess, multiprocessing, os.fork, one of our servers, a browser driver or a string naming
chromium marks the test. A module of the checkout that is not imported yet is read from its source,
never imported, so the marks do not depend on which test files were collected. A module may also
mark its tests with `pytestmark`. While a test carrying none of the three runs, whatever starts a
process or opens a listening socket is recorded and fails the test: a way of starting processes the
marking does not see is named by the first run that meets it, not skipped silently.
`scripts/run_tests.sh --quick` runs the tests with none of these markers (the unit tests).
Over 400 lines: the marking, the reading of unimported modules it needs and the watch that checks
it are one mechanism, kept beside the hooks that apply it.
"""
import ast
import functools
import multiprocessing.process
import os
import socket
import subprocess
import sys
import threading
import types
from contextlib import contextmanager
from pathlib import Path

import pytest

try:
    from _pytest.fixtures import FixtureFunctionDefinition as _FixtureFunction  # what @pytest.fixture returns
except ImportError:  # pytest < 8.4 returns the function itself
    _FixtureFunction = None

# Tests import the checkout's packages (megatron.app, ...) and the helpers in tests/.
ROOT = Path(__file__).resolve().parents[1]
for path in (str(ROOT), str(ROOT / "tests")):
    if path not in sys.path:
        sys.path.insert(0, path)

TESTS = ROOT / "tests"

# What a reference marks a test as: a dotted name equal to one of these, or inside one of them.
STARTERS: dict[str, tuple[str, ...]] = {
    "multiprocess": (
        "subprocess", "multiprocessing", "torch.multiprocessing", "concurrent.futures.process",
        "concurrent.futures.ProcessPoolExecutor", "asyncio.subprocess", "pty", "posix.fork", "posix.forkpty",
        "posix.system", "posix.posix_spawn", "posix.posix_spawnp", "os.popen", "os.spawnl", "os.spawnle",
        "os.spawnlp", "os.spawnlpe", "os.spawnv", "os.spawnve", "os.spawnvp", "os.spawnvpe",
    ),
    "server": (
        "http.server", "socketserver", "aiohttp.web", "megatron.scope.server.ScopeServer",
        "megatron.scope.service.ScopeService", "megatron.scan.control.http_server",
    ),
    "browser": ("playwright", "selenium", "pyppeteer", "chromium"),
}
# A string constant naming one of these (a path, a command line) counts as a reference to it.
BROWSER_NAMES = ("playwright", "chromium")
KINDS = tuple(STARTERS)
# The pytest -m expression of scripts/run_tests.sh --quick.
QUICK_SELECTION = " and ".join(f"not {kind}" for kind in KINDS)


@functools.lru_cache(maxsize=None)
def kinds_of_name(dotted: str) -> frozenset[str]:
    """The markers a reference to `dotted` (e.g. "subprocess.run") implies by itself."""
    return frozenset(kind for kind, prefixes in STARTERS.items()
                     if any(dotted == prefix or dotted.startswith(prefix + ".") for prefix in prefixes))


@functools.lru_cache(maxsize=None)
def _in_checkout(filename: str) -> bool:
    """Whether `filename` is this checkout's code (tests/, megatron/, tools/, ...; not .venv)."""
    try:
        path = Path(filename).resolve()
    except (OSError, ValueError):
        return False
    return path.is_relative_to(ROOT) and not path.is_relative_to(ROOT / ".venv")


class _Unread:
    """What code of the checkout names but nothing has imported: a module read from its source
    (`namespace` maps its names lazily), one of its functions (`code`) or classes (`members`), or
    a module outside the checkout known by its name only."""

    def __init__(self, dotted: str, *, path: Path | None = None, code: types.CodeType | None = None,
                 namespace: dict | None = None, members: dict | None = None) -> None:
        self.dotted, self.path, self.code, self.members = dotted, path, code, members
        self._namespace = namespace

    @property
    def namespace(self) -> dict:
        if self._namespace is None:
            self._namespace = _SourceNamespace(self)
        return self._namespace

    def attribute(self, name: str) -> object:
        if self.members is not None:
            return self.members.get(name)
        if self.path is None:
            return _Unread(f"{self.dotted}.{name}")
        return self.namespace.get(name) or _source_module(f"{self.dotted}.{name}")


class _Import(tuple):
    """An import not resolved yet: ("module", name) or ("from", module, name). Its own type, so
    that a resolved value which is itself a tuple (`from m import SOME_TUPLE`) is not taken for one."""


class _SourceNamespace(dict):
    """A module's names from its source, each resolved when first read: imports to modules or
    their attributes, functions to their compiled code, classes to their methods."""

    def __init__(self, module: _Unread) -> None:
        super().__init__()
        try:
            tree = ast.parse(module.path.read_text())
            code = compile(tree, str(module.path), "exec")
        except (OSError, SyntaxError, ValueError):  # a file being edited: judged by its name only
            return
        nested = {constant.co_name: constant for constant in code.co_consts if isinstance(constant, types.CodeType)}
        package = module.dotted if module.path.name == "__init__.py" else module.dotted.rpartition(".")[0]
        for node in _module_level(tree.body):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    bound = alias.asname or alias.name.split(".")[0]
                    dict.__setitem__(self, bound, _Import(("module", alias.name if alias.asname else bound)))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # from . import x, from ..y import z
                    parts = package.split(".")
                    base = ".".join([*parts[:len(parts) - node.level + 1], *([node.module] if node.module else [])])
                for alias in node.names:
                    dict.__setitem__(self, alias.asname or alias.name, _Import(("from", base, alias.name)))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name in nested:
                dotted, code = f"{module.dotted}.{node.name}", nested[node.name]
                members = None if not isinstance(node, ast.ClassDef) else {  # a class: its methods
                    member.co_name: _Unread(f"{dotted}.{member.co_name}", code=member, namespace=self)
                    for member in code.co_consts if isinstance(member, types.CodeType)}
                dict.__setitem__(self, node.name, _Unread(dotted, code=code if members is None else None,
                                                          namespace=self, members=members))

    def __getitem__(self, name: str) -> object:
        value = dict.__getitem__(self, name)
        if isinstance(value, _Import):
            # Known by name while it resolves: two modules re-exporting a name from each other end here.
            dict.__setitem__(self, name, _Unread(".".join(value[1:])))
            owner = _module(value[1])
            value = owner if value[0] == "module" else _attribute(owner, value[2]) or _Unread(".".join(value[1:]))
            dict.__setitem__(self, name, value)
        return value

    def get(self, name: str, default: object = None) -> object:
        return self[name] if name in self else default


def _module_level(statements: list[ast.stmt]):
    """The statements run at import, inside `if`, `try` and `with` blocks too."""
    for statement in statements:
        yield statement
        if isinstance(statement, (ast.If, ast.Try, ast.With)):
            for block in ("body", "orelse", "finalbody", "handlers"):
                for inner in getattr(statement, block, []):
                    yield from _module_level(inner.body if isinstance(inner, ast.ExceptHandler) else [inner])


@functools.lru_cache(maxsize=None)
def _source_module(dotted: str) -> _Unread | None:
    """The checkout's module `dotted` read from its source, if there is one."""
    base = ROOT.joinpath(*dotted.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file() and _in_checkout(str(path)):
            return _Unread(dotted, path=path)
    return None


def _module(dotted: str) -> object:
    """The module `dotted`: imported, else read from the checkout's source, else known by name."""
    return sys.modules.get(dotted) or _source_module(dotted) or _Unread(dotted)


def _own_attributes(obj: object) -> dict:
    """obj.__dict__, read without calling a class's __getattr__ (torch.ops and lazy modules create
    or import what they are asked for)."""
    try:
        own = object.__getattribute__(obj, "__dict__")
    except Exception:  # noqa: BLE001 - no __dict__ at all
        return {}
    return own if hasattr(own, "get") else {}  # a dict, or a class's mappingproxy


def _attribute(owner: object, name: str) -> object:
    """owner.name as it stands, or the submodule owner.name from source; None where only a
    __getattr__ would make it (nothing is imported here)."""
    if isinstance(owner, _Unread):
        return owner.attribute(name)
    for namespace in (owner.__mro__ if isinstance(owner, type) else (owner,)):
        if name in _own_attributes(namespace):
            return _own_attributes(namespace)[name]
    places = _own_attributes(owner).get("__path__") or () if isinstance(owner, types.ModuleType) else ()
    return _source_module(f"{owner.__name__}.{name}") if any(_in_checkout(str(p)) for p in places) else None


def _dotted_name(obj: object) -> str | None:
    if isinstance(obj, _Unread):
        return obj.dotted
    if isinstance(obj, types.ModuleType):
        return obj.__name__
    own = obj if isinstance(obj, (type, types.FunctionType, types.BuiltinFunctionType)) else None
    module = getattr(own, "__module__", None) if own is not None else _own_attributes(obj).get("__module__")
    qualname = getattr(own, "__qualname__", None) if own is not None else _own_attributes(obj).get("__qualname__")
    return f"{module}.{qualname}" if isinstance(module, str) and isinstance(qualname, str) else None


_REFERENCES: dict[int, tuple[types.CodeType, list[tuple[str, object]]]] = {}


def _references(code: types.CodeType, namespace: dict) -> list[tuple[str, object]]:
    """(dotted name, object or None) of the globals, modules, their attributes and the browsers
    that `code` and the code nested in it (closures, comprehensions, lambdas) name. Read from the
    names the code uses, not its instructions: `x.run` beside a global module `subprocess` counts
    as subprocess.run, which only ever marks more."""
    cached = _REFERENCES.get(id(code))
    if cached is not None:
        return cached[1]
    found: list[tuple[str, object]] = []
    names = code.co_names
    for name in names:
        if name in namespace:
            owner: object = namespace[name]
        elif name in sys.modules or "." in name:  # imported inside a function
            owner = _module(name)
        else:
            continue
        found.append((_dotted_name(owner) or name, owner))
        owners, visited = [owner], set()
        while owners:  # owner.attribute (or `from owner import attribute`), down through submodules
            owner = owners.pop()
            if id(owner) in visited or not _has_attributes(owner):
                continue
            visited.add(id(owner))
            for attribute in names:
                target = _attribute(owner, attribute)
                if target is None:
                    if not isinstance(owner, type):  # a lazy attribute (concurrent.futures.ProcessPoolExecutor)
                        found.append((f"{_dotted_name(owner)}.{attribute}", None))
                    continue
                found.append((_dotted_name(target) or f"{_dotted_name(owner)}.{attribute}", target))
                if isinstance(target, types.ModuleType) or (isinstance(target, _Unread) and target.path is not None):
                    owners.append(target)
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            found.extend(_references(constant, namespace))
        elif isinstance(constant, str):
            found.extend((name, None) for name in BROWSER_NAMES if name in constant.lower())
    _REFERENCES[id(code)] = (code, found)
    return found


def _has_attributes(owner: object) -> bool:
    """A module or a class (live or read from source), whose attributes code names as owner.name."""
    if isinstance(owner, _Unread):
        return owner.code is None
    return isinstance(owner, (types.ModuleType, type))


def _expand(obj: object, readable) -> tuple[list[tuple[types.CodeType, dict]], list[object]]:
    """The code to read in `obj` if its file is `readable` (with its globals), and the objects it
    holds that may have more (a class's methods, a partial's function, a fixture's function)."""
    if isinstance(obj, _Unread):
        return ([(obj.code, obj.namespace)] if obj.code is not None else []), list((obj.members or {}).values())
    if isinstance(obj, functools.partial):
        return [], [obj.func, *obj.args, *obj.keywords.values()]
    if isinstance(obj, (staticmethod, classmethod, types.MethodType)):
        return [], [obj.__func__]
    if isinstance(obj, property):
        return [], [obj.fget, obj.fset, obj.fdel]
    if _FixtureFunction is not None and isinstance(obj, _FixtureFunction):
        return [], [obj._get_wrapped_function()]
    if isinstance(obj, type):
        module = sys.modules.get(obj.__module__)
        if module is None or not readable(_own_attributes(module).get("__file__") or ""):
            return [], []
        return [], [*vars(obj).values(), *obj.__bases__]
    wrapped = _own_attributes(obj).get("__wrapped__")  # functools.wraps, lru_cache
    if isinstance(obj, types.FunctionType) and readable(obj.__code__.co_filename):
        return [(obj.__code__, obj.__globals__)], [wrapped]
    return [], [wrapped]


def kinds_reached(*roots: object) -> set[str]:
    """The markers implied by everything `roots` (test functions, fixtures, helpers) reach through
    code in the roots' own files and in the checkout; other code (torch, megatron-core, the
    standard library) is judged by its name only."""
    root_files = {root.__code__.co_filename for root in roots if isinstance(root, types.FunctionType)}
    readable = lambda filename: filename in root_files or _in_checkout(filename)  # noqa: E731
    kinds: set[str] = set()
    stack = [(_dotted_name(root) or "", root) for root in roots]
    seen: set[int] = set()
    while stack:
        dotted, obj = stack.pop()
        kinds |= kinds_of_name(dotted)
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        bodies, children = _expand(obj, readable)
        stack.extend((_dotted_name(child) or "", child) for child in children if child is not None)
        for code, namespace in bodies:
            stack.extend(_references(code, namespace))
    return kinds


def kinds_of_item(item: pytest.Function) -> set[str]:
    """The markers `item` gets: what its function, its fixtures and its parameters reach."""
    roots: list[object] = [item.function]
    for name in item.fixturenames:
        for definition in item._fixtureinfo.name2fixturedefs.get(name, ()):
            roots.append(definition.func)
    callspec = getattr(item, "callspec", None)
    if callspec is not None:
        roots.extend(value for value in callspec.params.values() if callable(value))
    kinds: set[str] = set()
    for root in roots:  # a fixture or a parametrized function is read once per session
        cached = _KINDS_OF_ROOT.get(id(root))
        if cached is None:
            cached = _KINDS_OF_ROOT[id(root)] = (root, frozenset(kinds_reached(root)))
        kinds |= cached[1]
    return kinds


_KINDS_OF_ROOT: dict[int, tuple[object, frozenset[str]]] = {}  # the root is kept so that its id stays its own


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if isinstance(item, pytest.Function):
            for kind in sorted(kinds_of_item(item)):
                if item.get_closest_marker(kind) is None:
                    item.add_marker(kind)


class StartWatch:
    """Records, while `record()` is open, the processes started and the sockets put in listening
    state in this interpreter (threads that were running before it opened are not counted)."""

    def __init__(self) -> None:
        self._recordings: list[tuple[list[str], set[int]]] = []
        self._originals: list[tuple[object, str, object | None]] = []
        self._starting = threading.local()

    @contextmanager
    def record(self):
        main = threading.main_thread().ident
        earlier = {thread.ident for thread in threading.enumerate() if thread.ident != main}
        started: list[str] = []
        self._recordings.append((started, earlier))
        try:
            yield started
        finally:
            self._recordings.remove((started, earlier))

    def _note(self, what: str) -> None:
        if self._recordings:
            started, earlier = self._recordings[-1]
            if threading.get_ident() not in earlier:
                started.append(what)

    def install(self) -> None:
        def wrap(owner: object, name: str, describe) -> None:
            original = getattr(owner, name)

            @functools.wraps(original)
            def noted(*args, **kwargs):
                outer = getattr(self._starting, "what", None)  # os.fork inside Process.start: noted once
                if outer is None:
                    self._note(describe(*args, **kwargs))
                self._starting.what = outer or name
                try:
                    return original(*args, **kwargs)
                finally:
                    self._starting.what = outer

            own = name in vars(owner)  # else inherited (socket.socket.listen): deleted again on uninstall
            self._originals.append((owner, name, original if own else None))
            setattr(owner, name, noted)

        wrap(subprocess.Popen, "_execute_child", lambda popen, args, *rest, **kw: f"subprocess {_command(args)}")
        wrap(multiprocessing.process.BaseProcess, "start", lambda process: f"multiprocessing {process.name}")
        for name in ("fork", "forkpty", "system", "posix_spawn", "posix_spawnp"):
            if hasattr(os, name):
                wrap(os, name, lambda *args, _name=name, **kw: f"os.{_name} {_command(args[:2])}".rstrip())
        wrap(socket.socket, "listen", lambda sock, *args: f"a listening socket on {_address(sock)}")

    def uninstall(self) -> None:
        while self._originals:
            owner, name, original = self._originals.pop()
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


def _command(args: object) -> str:
    text = " ".join(map(str, args)) if isinstance(args, (list, tuple)) else str(args)
    return text if len(text) <= 160 else text[:157] + "..."


def _address(sock: socket.socket) -> str:
    try:
        return str(sock.getsockname())
    except OSError:  # not bound
        return "an unbound socket"


WATCH = StartWatch()


def pytest_configure(config: pytest.Config) -> None:
    WATCH.install()


def pytest_unconfigure(config: pytest.Config) -> None:
    WATCH.uninstall()


@contextmanager
def _unit_test_phase(item: pytest.Item):
    if any(item.get_closest_marker(kind) for kind in KINDS):
        yield
        return
    with WATCH.record() as started:
        yield
    if started:
        listing = "\n".join(f"  - {what}" for what in dict.fromkeys(started))
        pytest.fail(f"{item.nodeid} carries none of the markers {', '.join(KINDS)}, so it counts as a unit test "
                    f"(scripts/run_tests.sh --quick runs it), but it started:\n{listing}\n"
                    "tests/conftest.py marks a test by what its code, its fixtures and the checkout's functions "
                    "they call name; this one got there another way. Mark it (@pytest.mark.multiprocess, .server "
                    "or .browser, or `pytestmark = pytest.mark.multiprocess` for the module).", pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    with _unit_test_phase(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    with _unit_test_phase(item):
        return (yield)


@pytest.fixture
def process_marking() -> types.SimpleNamespace:
    """The marking rules of this file, for the tests that check them (tests/test_process_markers.py)."""
    return types.SimpleNamespace(kinds_reached=kinds_reached, kinds_of_name=kinds_of_name, watch=WATCH,
                                 kinds=KINDS, quick_selection=QUICK_SELECTION, read_from_source=_source_module)
