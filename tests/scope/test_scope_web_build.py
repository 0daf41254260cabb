"""The web app ships built: megatron/scope/web/dist matches the sources its manifest names (in the
working tree and in the commit under test), is not git-ignored, goes into the package's build,
and a copy of what git holds serves the page and its script with no Node.js on PATH."""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from launch import ROOT
from megatron.scope import webapp
from scope_helpers import ctrl_c_reaches_child, fresh_job_env

GIT = shutil.which("git")


def _git(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def _in_git_checkout() -> bool:
    return GIT is not None and _git("rev-parse", "--is-inside-work-tree").stdout.strip() == "true"


needs_git = pytest.mark.skipif(not _in_git_checkout(), reason="needs git and a git checkout of this repository")


def _copy_web(destination: Path) -> Path:
    """The build's sources and the shipped build, as a web directory of its own."""
    for source in webapp.BUILD_SOURCES + ("dist",):
        path = webapp.WEB_DIR / source
        if path.is_dir():
            shutil.copytree(path, destination / source)
        else:
            destination.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, destination / source)
    return destination


# --- the shipped build and its sources ------------------------------------------------------
def test_shipped_build_matches_its_sources():
    problems = webapp.check_build()
    assert not problems, webapp.stale_message(problems)
    shipped = (webapp.WEB_DIST / webapp.MANIFEST_NAME).read_text(encoding="utf-8")
    expected = webapp.manifest_text(webapp.source_ids(), webapp.built_ids())
    assert shipped == expected, f"dist/{webapp.MANIFEST_NAME} was edited by hand: run `{webapp.REBUILD_COMMAND}`"


@needs_git
def test_committed_build_matches_committed_sources():
    """A set-up that rebuilds the working tree cannot hide a commit that changed the sources alone."""
    problems = webapp.check_commit(webapp.WEB_DIR, "HEAD")
    if problems is None:
        pytest.skip(f"HEAD holds no dist/{webapp.MANIFEST_NAME} yet (the working tree's build is checked above)")
    assert not problems, webapp.stale_message(problems, where="commit HEAD")


def test_changed_sources_and_edited_builds_are_named(tmp_path):
    web = _copy_web(tmp_path / "web")
    assert webapp.check_build(web) == []
    (web / "src" / "main.ts").write_text("// changed\n" + (web / "src" / "main.ts").read_text())
    (web / "src" / "extra.ts").write_text("export const extra = 1;\n")
    (web / "tsconfig.json").unlink()
    (web / "dist" / "index.html").write_text("<!doctype html>\n")
    (web / "dist" / "assets" / "stray.js").write_text("0;\n")
    problems = webapp.check_build(web)
    assert problems == ["source src/extra.ts is new", "source src/main.ts changed", "source tsconfig.json is gone",
                        "built file dist/assets/stray.js is new", "built file dist/index.html changed"]
    message = webapp.stale_message(problems)
    assert message.startswith("the shipped MegaScope build is stale") and "src/main.ts changed" in message
    assert f"run `{webapp.REBUILD_COMMAND}` and commit megatron/scope/web/dist/" in message
    (web / "dist" / webapp.MANIFEST_NAME).unlink()
    assert webapp.check_build(web) == [f"dist/{webapp.MANIFEST_NAME} is missing"]


def test_manifest_is_the_same_for_the_same_build(tmp_path):
    web = _copy_web(tmp_path / "web")
    first = webapp.write_manifest(web).read_bytes()
    assert webapp.write_manifest(web).read_bytes() == first


def test_build_web_check_and_its_message_without_npm(tmp_path, monkeypatch, capsys):
    from megatron.scope.cli import main

    assert main(["build-web", "--check"]) == 0
    assert "matches its sources" in capsys.readouterr().out
    monkeypatch.setenv("PATH", str(tmp_path))  # no npm
    with pytest.raises(webapp.WebBuildError, match="npm not found: building the web app needs Node.js"):
        webapp.build_web(_copy_web(tmp_path / "web"))


@needs_git
def test_commit_check_catches_sources_committed_without_their_build(tmp_path):
    web = _copy_web(tmp_path / "repo" / "megatron" / "scope" / "web")
    repo = tmp_path / "repo"
    identity = ["-c", "user.name=MegaScope test", "-c", "user.email=test@example.invalid", "-c", "commit.gpgsign=false"]
    assert _git("init", "-q", cwd=repo).returncode == 0
    assert _git("add", "-A", cwd=repo).returncode == 0
    assert _git(*identity, "commit", "-q", "-m", "build", cwd=repo).returncode == 0
    assert webapp.check_commit(web, "HEAD") == []
    (web / "src" / "style.css").write_text((web / "src" / "style.css").read_text() + "\nbody { margin: 0; }\n")
    assert _git("add", "megatron/scope/web/src/style.css", cwd=repo).returncode == 0
    assert _git(*identity, "commit", "-q", "-m", "sources only", cwd=repo).returncode == 0
    webapp.write_manifest(web)  # what a set-up's rebuild does to the working tree: the commit stays stale
    assert webapp.check_build(web) == []
    assert webapp.check_commit(web, "HEAD") == ["source src/style.css changed"]
    assert webapp.check_commit(web, "HEAD~1") == []
    assert webapp.check_commit(tmp_path, "HEAD") is None  # not a repository


# --- what ships -------------------------------------------------------------------------------
def _built_paths() -> list[str]:
    names = sorted(webapp.built_ids()) + [webapp.MANIFEST_NAME]
    return [(webapp.WEB_DIST / name).relative_to(ROOT).as_posix() for name in names]


@needs_git
def test_built_files_are_not_git_ignored():
    paths = _built_paths()
    assert any(p.endswith(".js") for p in paths) and any(p.endswith("index.html") for p in paths), paths
    # --no-index: the rules alone, so a rebuild's new (untracked) file names are covered too
    ignored = _git("check-ignore", "--no-index", "--verbose", *paths)
    assert ignored.returncode == 1 and not ignored.stdout, f"git ignores shipped build files:\n{ignored.stdout}"


@pytest.fixture(scope="module")
def fresh_copy(tmp_path_factory) -> Path:
    """What a commit of this working tree holds (tracked files and untracked ones git does not
    ignore) under megatron/, with the packaging files: no node_modules, no compiled extension."""
    if not _in_git_checkout():
        pytest.skip("needs git and a git checkout of this repository")
    listed = _git("ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", "megatron", "pyproject.toml",
                  "setup.py").stdout
    copy = tmp_path_factory.mktemp("fresh") / "checkout"
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():  # a deleted but still tracked file is not in the next commit
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, copy / name)
    return copy


def test_the_package_build_includes_the_web_app(fresh_copy, tmp_path):
    """setuptools' build_py (what `pip install .` runs for Python files and package data)."""
    built = subprocess.run([sys.executable, "-c", "from setuptools import setup; setup()", "-q", "build_py",
                            "--build-lib", str(tmp_path / "lib")], cwd=fresh_copy, capture_output=True, text=True,
                           timeout=120)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    installed = tmp_path / "lib" / "megatron" / "scope" / "web" / "dist"
    for path in _built_paths():
        name = path.split("/dist/", 1)[1]
        assert (installed / name).is_file(), f"dist/{name} is not in the package build (pyproject.toml package-data)"
        assert (installed / name).read_bytes() == (webapp.WEB_DIST / name).read_bytes(), name


def _without_node(path: str) -> str:
    def has_node(directory: str) -> bool:
        return any(os.path.exists(os.path.join(directory, tool)) for tool in ("node", "npm", "npx"))
    return os.pathsep.join(d for d in path.split(os.pathsep) if d and not has_node(d))


def test_a_fresh_copy_serves_the_app_without_node(fresh_copy):
    env = fresh_job_env()
    env.update(PYTHONPATH=str(fresh_copy), PATH=_without_node(env.get("PATH", "")))
    assert shutil.which("node", path=env["PATH"]) is None and shutil.which("npm", path=env["PATH"]) is None
    find_scope = "import importlib.util as u; print(u.find_spec('megatron.scope').origin)"  # no torch import
    where = subprocess.run([sys.executable, "-c", find_scope], cwd=fresh_copy, env=env, capture_output=True,
                           text=True, timeout=120)
    assert where.stdout.strip() == str(fresh_copy / "megatron" / "scope" / "__init__.py"), where.stderr[-2000:]
    process = subprocess.Popen([sys.executable, "-m", "megatron.scope", "serve", "--random-model", "--port", "0",
                                "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2"],
                               cwd=fresh_copy, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               preexec_fn=ctrl_c_reaches_child)
    try:
        deadline, url, seen = time.monotonic() + 120, None, []
        while url is None and time.monotonic() < deadline:
            line = process.stdout.readline()
            assert line, "serve exited without printing its URL:\n" + "".join(seen[-30:])
            seen.append(line)
            match = re.search(r"open (http://127\.0\.0\.1:\d+/)\?token=", line)
            url = match.group(1) if match else None
        assert url, "no URL printed:\n" + "".join(seen[-30:])
        with urllib.request.urlopen(url, timeout=10) as page:
            assert page.status == 200 and page.headers.get_content_type() == "text/html"
            html = page.read().decode()
        scripts = re.findall(r'<script[^>]*\ssrc="\./([^"]+)"', html)
        assert scripts, f"the page references no script:\n{html}"
        for name in scripts + re.findall(r'<link[^>]*\shref="\./([^"]+\.css)"', html):
            with urllib.request.urlopen(url + name, timeout=10) as asset:
                assert asset.status == 200
                wanted = "text/css" if name.endswith(".css") else ("application/javascript", "text/javascript")
                assert asset.headers.get_content_type() in wanted, (name, asset.headers["Content-Type"])
                assert asset.read() == (fresh_copy / "megatron" / "scope" / "web" / "dist" / name).read_bytes()
        process.send_signal(signal.SIGINT)
        process.communicate(timeout=60)
        assert process.returncode == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
