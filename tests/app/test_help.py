"""Every flag of every command line here carries a help text, and `pretrain_gpt.py --help` groups
the trainer's flags under Megatron-LM's group titles, with one group per plugin.

The parsers are built programmatically: the trainer's by build_parser with the built-in plugins,
the others by calling their module's main() with ArgumentParser.parse_args stopped before it
parses (scripts, benchmarks and examples in a subprocess, so that their sys.path changes and
imports stay out of this process). New files with a parser are found by grepping for
`ArgumentParser(`, so a tool added later is checked too.
"""
from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from launch import env, python

ROOT = Path(__file__).resolve().parents[2]

# Titles as Megatron-LM's arguments.py names its groups, in its order.
MEGATRON_LM_GROUPS = ["network size", "regularization", "training", "initialization", "learning rate",
                      "checkpointing", "mixed precision", "distributed", "validation", "data and dataloader",
                      "tokenizer", "logging"]
TRAINER_FILE = "megatron/app/arguments.py"


def walk(parser: argparse.ArgumentParser, name: str) -> tuple[int, list[str]]:
    """(actions checked, the ones without a help text) of a parser and all its subparsers; the
    subcommands themselves need a help too. Formats each parser's help, which fails on a bad %."""
    parser.format_help()
    checked, missing = 0, []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                checked += 1
                if not (choice.help or "").strip():
                    missing.append(f"{name}: subcommand {choice.dest}")
            for sub_name, sub in action.choices.items():
                sub_checked, sub_missing = walk(sub, f"{name} {sub_name}")
                checked += sub_checked
                missing += sub_missing
            continue
        checked += 1
        if not (action.help or "").strip() or action.help == argparse.SUPPRESS:
            missing.append(f"{name}: {'/'.join(action.option_strings) or action.dest}")
    return checked, missing


def builtin_plugins() -> list:
    """The built-in plugins (not ones a test registered in this process) plus the memory probe
    benchmarks/fbd.py loads through MEGATRON_APP_PLUGINS."""
    from megatron.app import plugins as registry

    found = [p for p in registry.available_plugins() if type(p).__module__.startswith("megatron.")]
    had_probe = "memory_probe" in registry._REGISTRY
    from megatron.fbd.memory_probe import MemoryProbe

    if not had_probe:
        registry.unregister_plugin("memory_probe")
    return found + [MemoryProbe()]


def parser_files() -> list[str]:
    files = [path for pattern in ("megatron/**/*.py", "scripts/*.py", "benchmarks/*.py", "examples/**/*.py",
                                  "tools/*.py", "*.py")
             for path in ROOT.glob(pattern) if "ArgumentParser(" in path.read_text()]
    return sorted(str(path.relative_to(ROOT)) for path in files)


class _Built(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def captured_parser(main, monkeypatch) -> argparse.ArgumentParser:
    """The parser main() builds, stopped at its parse_args (no work is done)."""
    def stop(self, *args, **kwargs):
        raise _Built(self)

    with monkeypatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", stop)
        with pytest.raises(_Built) as built:
            main()
    return built.value.parser


# Run in a subprocess on each script: load it without running it as __main__, call main()
# with parse_args stopped, and report what `walk` finds.
_SCRIPT_CHECK = r"""
import argparse, json, os, runpy, sys
parse_args = argparse.ArgumentParser.parse_args
sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
sys.path.insert(0, os.path.join(os.getcwd(), "tests", "app"))
from test_help import walk

class Built(Exception):
    pass

def stop(self, *args, **kwargs):
    raise Built(self)

report = {}
for path in sys.argv[1:]:
    saved = list(sys.path)
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    try:
        main = runpy.run_path(path, run_name="help_check").get("main")
        argparse.ArgumentParser.parse_args = stop
        try:
            main()
            report[path] = {"error": "main() returned without building a parser"}
        except Built as built:
            checked, missing = walk(built.args[0], path)
            report[path] = {"checked": checked, "missing": missing}
    except Exception as exc:
        report[path] = {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        argparse.ArgumentParser.parse_args = parse_args
        sys.path[:] = saved
print("HELP-REPORT " + json.dumps(report))
"""


def test_every_trainer_flag_has_help_and_a_group():
    from megatron.app.arguments import build_parser

    plugins = builtin_plugins()
    parser = build_parser(plugins)
    checked, missing = walk(parser, "pretrain_gpt.py")
    assert checked > 150 and not missing, missing
    # No flag is left in argparse's default group: each sits under a titled group.
    ungrouped = [a.option_strings for a in parser._optionals._group_actions if not isinstance(a, argparse._HelpAction)]
    assert not ungrouped and not parser._positionals._group_actions, ungrouped
    titles = [g.title for g in parser._action_groups]
    assert titles[2:2 + len(MEGATRON_LM_GROUPS)] == MEGATRON_LM_GROUPS, titles


def test_every_plugin_flag_has_help_in_its_own_group():
    plugins = builtin_plugins()
    assert {"scan", "dpp", "fbd", "scope", "memory_probe"} <= {p.name for p in plugins}
    for plugin in plugins:
        parser = argparse.ArgumentParser()
        plugin.add_arguments(parser)
        checked, missing = walk(parser, plugin.name)
        assert checked and not missing, missing
        assert not parser._optionals._group_actions[1:], f"{plugin.name} adds flags outside its own argument group"
        assert len(parser._action_groups) > 2, plugin.name


def test_trainer_help_shows_the_group_titles():
    proc = python(["pretrain_gpt.py", "--help"], timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    headings = [line[:-1] for line in proc.stdout.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert [h for h in headings if h in MEGATRON_LM_GROUPS] == MEGATRON_LM_GROUPS, headings
    plugin_titles = set()
    for plugin in builtin_plugins():
        if plugin.name == "memory_probe":
            continue  # only with MEGATRON_APP_PLUGINS=megatron.fbd.memory_probe
        parser = argparse.ArgumentParser()
        plugin.add_arguments(parser)
        plugin_titles.update(g.title for g in parser._action_groups[2:])
    assert {"MegaScan tracing", "MegaDPP dynamic pipeline"} <= plugin_titles
    assert plugin_titles <= set(headings), sorted(plugin_titles - set(headings))


def test_every_megatron_command_line_flag_has_help(monkeypatch):
    """`python -m megatron.scan ...` (every subcommand), `python -m megatron.scope serve` and the
    other `python -m megatron....` entry points."""
    # Entry points are the modules with a main(); a module that only parses flags it documents
    # elsewhere (MegaScan's session reading a launched worker's variables) is not one.
    files = [f for f in parser_files() if f.startswith("megatron/") and f != TRAINER_FILE
             and "\ndef main(" in (ROOT / f).read_text()]
    assert {"megatron/scan/cli.py", "megatron/scope/cli.py"} <= set(files), files
    missing, checked = [], {}
    for path in files:
        module = importlib.import_module(path[:-3].replace("/", "."))
        parser = captured_parser(module.main, monkeypatch)
        checked[path], found = walk(parser, path)
        missing += found
    assert not missing, missing
    assert all(checked.values()), checked
    scan = captured_parser(importlib.import_module("megatron.scan.cli").main, monkeypatch)
    commands = next(a for a in scan._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert {"aggregate", "detect", "hang", "launch", "synthesize", "fault"} <= set(commands)


def test_every_script_flag_has_help():
    """scripts/, benchmarks/, examples/ and tools/: each file with a parser, built by its main()."""
    files = [f for f in parser_files() if not f.startswith("megatron/")]
    assert {"scripts/aggregate.py", "benchmarks/trace_overhead.py", "examples/scan/plain_ddp.py"} <= set(files)
    run_env = env()
    run_env["PYTHONPATH"] = str(ROOT / "tests") + ":" + run_env["PYTHONPATH"]
    proc = subprocess.run([sys.executable, "-c", _SCRIPT_CHECK, *files], cwd=ROOT, env=run_env,
                          capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("HELP-REPORT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    report = json.loads(lines[-1].removeprefix("HELP-REPORT "))
    assert set(report) == set(files)
    errors = {path: r["error"] for path, r in report.items() if "error" in r}
    assert not errors, errors
    assert all(r["checked"] for r in report.values()), report
    missing = [flag for r in report.values() for flag in r["missing"]]
    assert not missing, missing


def test_walk_finds_a_flag_without_help():
    parser = argparse.ArgumentParser()
    parser.add_argument("--documented", help="has one")
    sub = parser.add_subparsers(dest="command").add_parser("run", help="a subcommand")
    sub.add_argument("--bare")
    assert walk(parser, "p") == (3, ["p run: --bare"])
