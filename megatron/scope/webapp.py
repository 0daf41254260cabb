"""The MegaScope web app as it ships: the built files in `web/dist/` (committed, and installed with
the package, so serving needs no Node.js) and the manifest beside them that names the sources they
were built from. `python -m megatron.scope build-web` rebuilds them with npm and rewrites the
manifest; the checks here say when a working tree or a commit ships a build its sources outgrew."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Callable

WEB_DIR = Path(__file__).resolve().parent / "web"
WEB_DIST = WEB_DIR / "dist"
MANIFEST_NAME = "build-manifest.json"
REBUILD_COMMAND = "python -m megatron.scope build-web"
# What the build reads, relative to the web directory: a file, or a directory taken whole.
BUILD_SOURCES = ("index.html", "package.json", "package-lock.json", "tsconfig.json", "vite.config.ts", "src")


class WebBuildError(RuntimeError):
    """The web app could not be built (no npm, or npm failed); the message says what to do."""


def blob_id(data: bytes) -> str:
    """Git's blob id of `data`, so a commit's files can be checked with `git ls-tree`, unchecked out."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def is_build_source(relative: str) -> bool:
    """Whether the file at this path (relative to the web directory, '/'-separated) is read by the build."""
    return any(relative == source or relative.startswith(source + "/") for source in BUILD_SOURCES)


def _files_under(root: Path) -> dict[str, str]:
    """Blob id of every file under `root`, by '/'-separated path relative to it."""
    found = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        found[path.relative_to(root).as_posix()] = blob_id(path.read_bytes())
    return found


def source_ids(web_dir: Path = WEB_DIR) -> dict[str, str]:
    """Blob id of each build source present under `web_dir`."""
    found = {}
    for source in BUILD_SOURCES:
        path = web_dir / source
        if path.is_dir():
            found.update({f"{source}/{name}": ident for name, ident in _files_under(path).items()})
        elif path.is_file():
            found[source] = blob_id(path.read_bytes())
    return dict(sorted(found.items()))


def built_ids(web_dir: Path = WEB_DIR) -> dict[str, str]:
    """Blob id of each built file under `web_dir/dist`, the manifest excepted."""
    dist = web_dir / "dist"
    return {name: ident for name, ident in _files_under(dist).items() if name != MANIFEST_NAME} if dist.is_dir() else {}


def manifest_text(sources: dict[str, str], built: dict[str, str]) -> str:
    """The manifest's exact text: sorted, no timestamps, so the same build writes the same bytes."""
    manifest = {"about": f"MegaScope's built web app and the sources it was built from (git blob ids); "
                         f"rebuild with `{REBUILD_COMMAND}`",
                "sources": dict(sorted(sources.items())), "built": dict(sorted(built.items()))}
    return json.dumps(manifest, indent=1, sort_keys=True) + "\n"


def write_manifest(web_dir: Path = WEB_DIR) -> Path:
    """Record the present sources and built files in `dist/build-manifest.json`."""
    path = web_dir / "dist" / MANIFEST_NAME
    path.write_text(manifest_text(source_ids(web_dir), built_ids(web_dir)), encoding="utf-8")
    return path


def compare(manifest: dict, sources: dict[str, str], built: dict[str, str]) -> list[str]:
    """What differs between a manifest and the sources and built files it should describe."""
    problems = []
    for kind, recorded, present in (("source", manifest.get("sources", {}), sources),
                                    ("built file", manifest.get("built", {}), built)):
        prefix = "" if kind == "source" else "dist/"
        for name in sorted(recorded.keys() | present.keys()):
            if name not in present:
                problems.append(f"{kind} {prefix}{name} is gone")
            elif name not in recorded:
                problems.append(f"{kind} {prefix}{name} is new")
            elif recorded[name] != present[name]:
                problems.append(f"{kind} {prefix}{name} changed")
    return problems


def check_build(web_dir: Path = WEB_DIR) -> list[str]:
    """What makes the build under `web_dir/dist` differ from one made from the sources in
    `web_dir`: sources changed since it was built, built files missing or edited. Empty when
    they match."""
    path = web_dir / "dist" / MANIFEST_NAME
    if not path.is_file():
        return [f"dist/{MANIFEST_NAME} is missing"]
    return compare(json.loads(path.read_text(encoding="utf-8")), source_ids(web_dir), built_ids(web_dir))


def check_commit(web_dir: Path = WEB_DIR, revision: str = "HEAD") -> list[str] | None:
    """As `check_build`, for the files of a git commit rather than the working tree (a set-up
    that rebuilds the working tree cannot hide a commit that changed the sources alone). None
    when there is no git, no repository or no manifest in that commit."""
    git = ["git", "-C", str(web_dir)]
    try:
        listing = subprocess.run([*git, "ls-tree", "-r", "-z", revision, "--", "."], capture_output=True,
                                 text=True, timeout=30)
        shown = subprocess.run([*git, "show", f"{revision}:./dist/{MANIFEST_NAME}"], capture_output=True,
                               text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if listing.returncode != 0 or shown.returncode != 0:
        return None
    sources, built = {}, {}
    for line in filter(None, listing.stdout.split("\0")):  # "<mode> blob <id>\t<path relative to web_dir>"
        meta, name = line.split("\t", 1)
        ident = meta.split()[2]
        if name.startswith("dist/"):
            if name != f"dist/{MANIFEST_NAME}":
                built[name[len("dist/"):]] = ident
        elif is_build_source(name):
            sources[name] = ident
    return compare(json.loads(shown.stdout), sources, built)


def stale_message(problems: list[str], where: str = "working tree") -> str:
    """The one-line failure for a stale build: what changed (the first few) and the command that fixes it."""
    shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
    return (f"the shipped MegaScope build is stale in the {where} ({shown}): run `{REBUILD_COMMAND}` "
            f"and commit megatron/scope/web/dist/ with the sources")


def _needs_install(web_dir: Path) -> bool:
    marker = web_dir / "node_modules" / ".package-lock.json"  # written last by npm ci
    if not marker.is_file():
        return True
    stamp = marker.stat().st_mtime
    return any((web_dir / name).stat().st_mtime > stamp for name in ("package.json", "package-lock.json"))


def build_web(web_dir: Path = WEB_DIR, log: Callable[[str], None] = print) -> Path:
    """`npm ci` when node_modules is missing or older than the lock file, `npm run build` (type
    check, then vite into dist/), then the manifest. Returns the manifest's path."""
    npm = shutil.which("npm")
    if npm is None:
        raise WebBuildError("npm not found: building the web app needs Node.js 20+ and npm (serving the "
                            "shipped build does not)")
    env = dict(os.environ, npm_config_update_notifier="false", npm_config_fund="false", npm_config_audit="false")
    steps = ([[npm, "ci", "--loglevel=error"]] if _needs_install(web_dir) else []) + [[npm, "run", "build"]]
    for command in steps:
        log(f"[build-web] {' '.join(command[1:])} in {web_dir}")
        done = subprocess.run(command, cwd=web_dir, env=env)
        if done.returncode != 0:
            raise WebBuildError(f"`npm {' '.join(command[1:])}` failed in {web_dir} (exit {done.returncode})")
    path = write_manifest(web_dir)
    log(f"[build-web] wrote {path}; commit megatron/scope/web/dist/ with the sources")
    return path
