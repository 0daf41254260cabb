"""The markers that set unit tests apart from multi-process runs (tests/conftest.py): what marks a
test, that a test starting a process or a server without a marker fails, and that every module of
the suite follows the rule (scripts/run_tests.sh --quick runs only the unmarked tests)."""
from __future__ import annotations

import ast
import json
import socket
import subprocess
import sys
import textwrap
import tomllib
import types
from pathlib import Path

import pytest

from launch import ROOT, env

TESTS = ROOT / "tests"

SYNTHETIC_HELPERS = '''
import subprocess
from launch import free_port, torchrun


def run_job():
    return torchrun("pretrain_gpt.py", [], nproc=2)


def start_directly():
    return subprocess.run(["true"])


def pick_port():
    return free_port()


class Job:
    def start(self):
        return start_directly()


def through_a_class():
    return Job().start()


def import_inside():
    from launch import python
    return python(["-c", "pass"])


def in_a_comprehension(commands):
    return [subprocess.run(command) for command in commands]


def serve():
    from megatron.scope.service import ScopeService
    return ScopeService


def browse():
    import playwright.sync_api
    return playwright.sync_api


def browser_installed():
    import os
    return os.path.exists("/usr/bin/chromium")


def pure(values):
    return sorted(values)
'''


@pytest.fixture
def synthetic_helpers(monkeypatch) -> types.ModuleType:
    """SYNTHETIC_HELPERS as a helper module in tests/ (its file is never written)."""
    module = types.ModuleType("synthetic_helpers")
    module.__file__ = str(TESTS / "synthetic_helpers.py")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    exec(compile(SYNTHETIC_HELPERS, module.__file__, "exec"), module.__dict__)
    return module


@pytest.mark.parametrize("helper, kinds", [
    ("run_job", {"multiprocess"}),  # tests/launch.py's torchrun reaches subprocess
    ("start_directly", {"multiprocess"}),
    ("pick_port", set()),  # tests/launch.py's free_port binds a socket and starts nothing
    ("through_a_class", {"multiprocess"}),
    ("import_inside", {"multiprocess"}),
    ("in_a_comprehension", {"multiprocess"}),
    ("serve", {"server"}),
    ("browse", {"browser"}),
    ("browser_installed", {"browser"}),  # a string naming chromium
    ("pure", set()),
])
def test_a_helper_is_marked_by_what_it_reaches(process_marking, synthetic_helpers, helper, kinds):
    assert process_marking.kinds_reached(getattr(synthetic_helpers, helper)) == kinds


def test_the_checkouts_code_is_read_and_other_code_judged_by_its_name(process_marking):
    import json

    from megatron.app import simulator
    from megatron.scan import load

    assert process_marking.kinds_reached(simulator.simulate) == set()
    assert process_marking.kinds_reached(load.load_directory) == {"multiprocess"}  # a process pool for jobs > 1
    assert process_marking.kinds_reached(json.dumps) == set()
    assert process_marking.kinds_of_name("subprocess.run") == {"multiprocess"}
    assert process_marking.kinds_of_name("torch.multiprocessing.spawn") == {"multiprocess"}
    assert process_marking.kinds_of_name("subprocess_timeout") == set()


@pytest.mark.parametrize("module, function, kinds", [
    ("megatron.scan.load", "read_all", {"multiprocess"}),
    ("megatron.scan.load", "_ranges", set()),
    ("megatron.scan.aggregate", "aggregate", {"multiprocess"}),  # through load.read_all
    ("megatron.app.simulator", "simulate", set()),
    ("megatron.scope.webapp", "check_commit", {"multiprocess"}),  # git ls-tree
    ("megatron.scope.webapp", "compare", set()),
])
def test_a_module_read_from_its_source_is_judged_as_the_imported_one(process_marking, module, function, kinds):
    """Code a test reaches only through an import inside a function may not be imported at
    collection; it is read from its source then, with the same result as the live module."""
    import importlib

    live = getattr(importlib.import_module(module), function)
    unread = process_marking.read_from_source(module).attribute(function)
    assert process_marking.kinds_reached(unread) == process_marking.kinds_reached(live) == kinds


@pytest.fixture
def job_starter():
    """Hands a test the function that starts processes without calling it."""
    return subprocess.run


def test_a_fixture_that_reaches_subprocess_marks_its_tests(request, job_starter):
    assert request.node.get_closest_marker("multiprocess") is not None


def test_a_test_that_reaches_nothing_stays_a_unit_test(request):
    assert [kind for kind in ("multiprocess", "server", "browser") if request.node.get_closest_marker(kind)] == []


def test_the_watch_records_processes_and_listening_sockets_a_test_hides(process_marking, tmp_path):
    """What the marking cannot see (a module looked up by a computed name) the watch still sees;
    the inner recording keeps it from this test's own."""
    hidden = __import__("sub" + "process")
    with process_marking.watch.record() as started:
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen()
            address = listener.getsockname()
        with pytest.raises(FileNotFoundError):
            hidden.Popen([str(tmp_path / "no-such-program")])
    assert started == [f"a listening socket on {address}", f"subprocess {tmp_path / 'no-such-program'}"]


def test_the_quick_selection_is_what_run_tests_sh_passes_and_its_markers_are_registered(process_marking):
    script = (ROOT / "scripts" / "run_tests.sh").read_text()
    assert f'-m "{process_marking.quick_selection}"' in script
    assert process_marking.quick_selection == "not multiprocess and not server and not browser"
    ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    registered = {line.split(":")[0] for line in ini["markers"]}
    assert set(process_marking.kinds) <= registered


UNMARKED_STARTS = '''
import importlib
import subprocess
import sys


def test_pure():
    assert sorted([2, 1]) == [1, 2]


def test_named_start():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_hidden_start():
    getattr(importlib.import_module("sub" + "process"), "run")([sys.executable, "-c", "pass"], check=True)
'''


def _pytest(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """pytest on tmp_path with tests/conftest.py as a plugin."""
    run_env = env()
    run_env["PYTHONPATH"] = str(TESTS) + ":" + run_env["PYTHONPATH"]
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-q", "-rA",
                           "-W", "ignore::pytest.PytestUnknownMarkWarning", "--rootdir", str(tmp_path), *args],
                          cwd=tmp_path, env=run_env, capture_output=True, text=True, timeout=120)


def test_an_unmarked_test_that_starts_a_process_fails_and_quick_leaves_marked_ones_out(tmp_path):
    (tmp_path / "test_synthetic.py").write_text(UNMARKED_STARTS)
    every = _pytest(tmp_path, "test_synthetic.py")
    assert "PASSED test_synthetic.py::test_pure" in every.stdout, every.stdout + every.stderr
    assert "PASSED test_synthetic.py::test_named_start" in every.stdout  # marked multiprocess: not watched
    assert "FAILED test_synthetic.py::test_hidden_start" in every.stdout
    assert "carries none of the markers multiprocess, server, browser" in every.stdout
    assert f"subprocess {sys.executable} -c pass" in every.stdout
    quick = _pytest(tmp_path, "test_synthetic.py", "-m", "not multiprocess and not server and not browser")
    assert "1 deselected" in quick.stdout and "test_named_start" not in quick.stdout, quick.stdout


# ---- the whole suite: what each module imports against how its tests are marked -------------------

PROCESS_MODULES = ("subprocess", "multiprocessing", "torch.multiprocessing", "playwright")
BROWSER_WORDS = ("chromium", "playwright")


def _helper_path(name: str, importer: Path) -> Path | None:
    for candidate in (importer.parent / f"{name}.py", TESTS / f"{name}.py"):
        if candidate.is_file():
            return candidate
    return None


def _used_names(node: ast.AST) -> set[str]:
    return {child.id for child in ast.walk(node) if isinstance(child, ast.Name)}


def process_starters(path: Path, seen: dict[Path, set[str]] | None = None) -> tuple[set[str], set[str]]:
    """Names in the module at `path` that start processes, read from its source alone: imports of
    PROCESS_MODULES, imported helpers (under tests/) that start processes, and functions of its own
    that use any of these. Returns (all such names, the imported ones)."""
    seen = {} if seen is None else seen
    if path in seen:
        return seen[path], set()
    seen[path] = set()
    tree = ast.parse(path.read_text())
    imported: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            imported |= {(alias.asname or alias.name).split(".")[0] for alias in node.names
                         if alias.name.startswith(PROCESS_MODULES)}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith(PROCESS_MODULES):
                imported |= {alias.asname or alias.name for alias in node.names}
            elif (helper := _helper_path(node.module, path)) is not None and helper != path:
                helper_starters = process_starters(helper, seen)[0]
                imported |= {alias.asname or alias.name for alias in node.names if alias.name in helper_starters}
    starters = set(imported)
    functions = [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    changed = True
    while changed:  # a function that calls one of ours that starts processes starts them too
        changed = False
        for function in functions:
            if function.name not in starters and _used_names(function) & starters:
                starters.add(function.name)
                changed = True
    seen[path] = starters
    return starters, imported


@pytest.fixture(scope="module")
def suite_markers(tmp_path_factory) -> dict[str, set[str]]:
    """nodeid -> the markers among multiprocess/server/browser of every test the suite collects."""
    output = tmp_path_factory.mktemp("collected") / "markers.json"
    dump = textwrap.dedent('''
        import json, sys
        import pytest

        class Dump:
            def pytest_collection_finish(self, session):
                kinds = {"multiprocess", "server", "browser"}
                with open(sys.argv[1], "w") as out:
                    json.dump({item.nodeid: sorted({mark.name for mark in item.iter_markers()} & kinds)
                               for item in session.items}, out)

        # a module that fails to import is reported by its own collection error, not here
        sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "--continue-on-collection-errors",
                              "tests"], plugins=[Dump()]))
    ''')
    done = subprocess.run([sys.executable, "-c", dump, str(output)], cwd=ROOT, env=env(), capture_output=True,
                          text=True, timeout=300)
    assert output.is_file(), done.stdout[-3000:] + done.stderr[-3000:]
    return {nodeid: set(kinds) for nodeid, kinds in json.loads(output.read_text()).items()}


def test_no_test_module_starts_processes_in_tests_left_unmarked(suite_markers):
    by_module: dict[str, dict[str, set[str]]] = {}
    for nodeid, kinds in suite_markers.items():
        module, _, rest = nodeid.partition("::")
        function = rest.split("[")[0].split("::")[-1]
        by_module.setdefault(module, {}).setdefault(function, set()).update(kinds or {"unit"})
    assert len(by_module) > 50 and any("unit" in kinds for tests in by_module.values() for kinds in tests.values())
    problems = []
    for module, tests in sorted(by_module.items()):
        path = ROOT / module
        starters, imported = process_starters(path)
        tree = ast.parse(path.read_text())
        bodies = {node.name: node for node in ast.walk(tree)
                  if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
        marked = {name for name, kinds in tests.items() if kinds - {"unit"}}
        if imported and not marked:
            problems.append(f"{module} imports {sorted(imported)} but none of its tests is marked multiprocess")
        for name, kinds in tests.items():
            if "unit" in kinds and name in bodies and _used_names(bodies[name]) & starters:
                problems.append(f"{module}::{name} uses {sorted(_used_names(bodies[name]) & starters)} unmarked")
        text = path.read_text().lower()
        if path != Path(__file__).resolve() and any(word in text for word in BROWSER_WORDS) \
                and not any("browser" in kinds for kinds in tests.values()):  # (this file names the words)
            problems.append(f"{module} drives a browser but none of its tests is marked browser")
    assert not problems, "\n".join(problems)
