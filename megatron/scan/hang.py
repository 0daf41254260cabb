"""`python -m megatron.scan hang DIR`: merges the per-rank hang dumps and crash files of a trace dir
into one diagnosis (which ranks wait in which collective, which never joined, merged stacks with
rank ranges) as text and as a self-contained HTML/SVG page."""
from __future__ import annotations

import html
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

# MegaScan's own threads (the watchdog, the trace writer, the metrics port, gathering, online
# detection: every one is named "megascan-...") say nothing about the hang.
_OWN_THREADS = "megascan-"


class HangDiagnosisError(ValueError):
    """No dumps to merge, or unreadable ones; the message says which and why."""


def rank_ranges(ranks: Iterable[int]) -> str:
    """[0, 1, 2, 3, 5] -> '0-3,5'."""
    ordered = sorted(set(int(r) for r in ranks))
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts) or "-"


@dataclass(slots=True)
class GroupWait:
    """One group with a collective in flight on some of its members."""

    name: str
    desc: str
    ranks: list[int]
    op: str
    seq: int
    waiting: list[int]
    never_joined: list[int]
    waiting_s: float
    missing_last: dict[int, str]  # rank -> "op #seq" last completed, or "none"


@dataclass(slots=True)
class StackNode:
    function: str
    file: str
    line: int
    code: str
    ranks: set[int] = field(default_factory=set)
    children: dict[tuple, "StackNode"] = field(default_factory=dict)


@dataclass(slots=True)
class HangReport:
    directory: str
    world_size: int
    dumped: list[int]
    missing: list[int]
    crashed: dict[int, str]  # rank -> one-line description
    terminated: list[int]
    groups: list[GroupWait]
    p2p: list[dict[str, Any]]  # {"rank", "kind", "peer", "open_s"}
    waits_for: dict[int, set[int]]
    culprits: list[int]
    culprit_reason: str
    stacks: StackNode
    dumps: dict[int, dict[str, Any]]

    def as_dict(self) -> dict[str, Any]:
        return {"directory": self.directory, "world_size": self.world_size, "dumped": self.dumped,
                "missing": self.missing, "crashed": {str(k): v for k, v in self.crashed.items()},
                "terminated": self.terminated, "culprits": self.culprits, "culprit_reason": self.culprit_reason,
                "groups": [{k: getattr(g, k) for k in GroupWait.__slots__} for g in self.groups],
                "p2p": self.p2p, "waits_for": {str(k): sorted(v) for k, v in self.waits_for.items()}}


def load_dumps(directory: str | Path) -> tuple[dict[int, dict], dict[int, dict], dict[int, str]]:
    """Hang dumps, exception crash files and fatal-signal texts of a directory, by rank."""
    directory = Path(directory)
    if not directory.is_dir():
        raise HangDiagnosisError(f"{directory}: not a directory")
    dumps: dict[int, dict] = {}
    crashes: dict[int, dict] = {}
    fatals: dict[int, str] = {}
    for path in sorted(directory.glob("hang-rank*.json")):
        dumps[_rank_of(path)] = _read_json(path)
    for path in sorted(directory.glob("crash-rank*.json")):
        crashes[_rank_of(path)] = _read_json(path)
    for path in sorted(directory.glob("crash-rank*-fatal.txt")):
        text = path.read_text(errors="replace")
        if "\n" in text.strip():  # more than the header line: a signal was caught
            fatals[_rank_of(path)] = text
    return dumps, crashes, fatals


def _rank_of(path: Path) -> int:
    match = re.search(r"rank(\d+)", path.name)
    if match is None:
        raise HangDiagnosisError(f"{path}: no rank in the file name")
    return int(match.group(1))


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise HangDiagnosisError(f"{path}: not a readable MegaScan dump ({exc})") from None


def diagnose(directory: str | Path) -> HangReport:
    dumps, crashes, fatals = load_dumps(directory)
    if not dumps and not crashes and not fatals:
        raise HangDiagnosisError(f"{directory}: no hang-rank*.json or crash-rank* files; has a rank stalled "
                                 f"for --hang-timeout seconds yet, and is --trace-dir pointing here?")
    sizes = [int(d.get("world_size") or 0) for d in (*dumps.values(), *crashes.values())]
    world_size = max(sizes + [max([*dumps, *crashes, *fatals], default=-1) + 1])
    crashed: dict[int, str] = {}
    terminated: list[int] = []
    for rank, crash in crashes.items():
        top = crash.get("frames", [{}])[-1] if crash.get("frames") else {}
        crashed[rank] = f"{crash.get('exception')}: {crash.get('message')} at {top.get('file')}:{top.get('line')}"
    for rank, text in fatals.items():
        first = next((line for line in text.splitlines()[1:] if line.strip()), "")
        if "Terminated" in text or "signal 15" in text.lower():
            terminated.append(rank)
        else:
            crashed.setdefault(rank, first.strip())
    groups, waits_for = _collective_waits(dumps)
    p2p = []
    for rank, dump in sorted(dumps.items()):
        for span in dump.get("p2p_in_flight", []):
            peer = span.get("peer")
            if peer is None or peer < 0:
                continue
            p2p.append({"rank": rank, "kind": span["kind"], "peer": int(peer), "open_s": span.get("open_s")})
            waits_for.setdefault(rank, set()).add(int(peer))
    culprits, reason = _culprits(waits_for, set(dumps), set(crashed))
    return HangReport(directory=str(directory), world_size=world_size, dumped=sorted(dumps),
                      missing=[r for r in range(world_size) if r not in dumps and r not in crashed],
                      crashed=crashed, terminated=sorted(terminated), groups=groups, p2p=p2p,
                      waits_for=waits_for, culprits=culprits, culprit_reason=reason,
                      stacks=merge_stacks(dumps), dumps=dumps)


def _collective_waits(dumps: dict[int, dict]) -> tuple[list[GroupWait], dict[int, set[int]]]:
    """For each group, the highest sequence number some member is blocked in; members not in it
    (and not past it) never joined, and every blocked member waits for them."""
    by_group: dict[tuple, dict[int, dict]] = {}
    descs: dict[tuple, str] = {}
    for rank, dump in dumps.items():
        for group in dump.get("groups", []):
            key = (group["name"], tuple(group["ranks"]))
            by_group.setdefault(key, {})[rank] = group
            descs[key] = group.get("desc") or descs.get(key, "")
    waits: list[GroupWait] = []
    waits_for: dict[int, set[int]] = {}
    for (name, ranks), members in sorted(by_group.items(), key=lambda item: item[0][1]):
        blocked = {r: g["in_flight"] for r, g in members.items() if g.get("in_flight")}
        if not blocked:
            continue
        seq = max(f["seq"] for f in blocked.values())
        waiting = sorted(r for r, f in blocked.items() if f["seq"] == seq)
        op = blocked[waiting[0]]["op"]
        never_joined, missing_last = [], {}
        for member in ranks:
            state = members.get(member)
            if member in waiting:
                continue
            last = state.get("last_completed") if state else None
            if last is not None and last["seq"] >= seq:
                continue  # passed it already (an async collective issued and returned)
            never_joined.append(member)
            missing_last[member] = ("no dump" if state is None else
                                    "none" if last is None else f"{last['op']} #{last['seq']}")
        for rank in waiting:
            waits_for.setdefault(rank, set()).update(never_joined)
        waits.append(GroupWait(name=name, desc=descs[(name, ranks)], ranks=list(ranks), op=op, seq=seq,
                               waiting=waiting, never_joined=never_joined,
                               waiting_s=max(blocked[r]["waiting_s"] for r in waiting), missing_last=missing_last))
    return waits, waits_for


def _culprits(waits_for: dict[int, set[int]], dumped: set[int], crashed: set[int]) -> tuple[list[int], str]:
    """Ranks others wait for that wait for nobody; with none (a cycle), the ranks on cycles."""
    waited_on = set().union(*waits_for.values()) if waits_for else set()
    sinks = sorted(r for r in waited_on if not waits_for.get(r))
    if sinks:
        return sinks, "waited for by other ranks, not waiting in any collective or P2P themselves"
    if waits_for:
        on_cycle = sorted(r for r in waits_for if _reaches(waits_for, r, r))
        return on_cycle, "waiting for each other in a cycle (a deadlock: mismatched collective or P2P order)"
    if crashed:
        return sorted(crashed), "crashed"
    return [], "no rank is blocked in a collective or P2P; compare the stacks below"


def _reaches(graph: dict[int, set[int]], start: int, target: int) -> bool:
    seen, stack = set(), list(graph.get(start, ()))
    while stack:
        node = stack.pop()
        if node == target:
            return True
        if node not in seen:
            seen.add(node)
            stack.extend(graph.get(node, ()))
    return False


def merge_stacks(dumps: dict[int, dict], all_threads: bool = False) -> StackNode:
    """One tree of frames (outermost first) over the main threads of all ranks (or all threads
    except MegaScan's own); each node knows the ranks whose stack passes through it."""
    root = StackNode("<all ranks>", "", 0, "")
    for rank, dump in dumps.items():
        root.ranks.add(rank)
        for thread in dump.get("threads", []):
            if thread["name"].startswith(_OWN_THREADS) or not (all_threads or thread.get("main")):
                continue
            node = root
            if all_threads:
                key = ("thread", thread["name"])
                node = node.children.setdefault(key, StackNode(f"[thread {thread['name']}]", "", 0, ""))
                node.ranks.add(rank)
            for frame in thread["frames"]:
                key = (frame["file"], frame["line"], frame["function"])
                node = node.children.setdefault(key, StackNode(frame["function"], frame["file"], frame["line"],
                                                               frame.get("code", "")))
                node.ranks.add(rank)
    return root


def _short(path: str) -> str:
    parts = Path(path).parts
    return "/".join(parts[-2:]) if len(parts) > 1 else path


# ------------------------------------------------------------------------------ rendering


def format_text(report: HangReport, max_depth: int = 60) -> str:
    lines = [f"hang diagnosis of {report.directory}: {len(report.dumped)} of {report.world_size} ranks dumped"
             + (f" (timeout {report.dumps[report.dumped[0]].get('timeout_s'):g} s)" if report.dumped else "")]
    if report.culprits:
        lines.append(f"culprit ranks: {rank_ranges(report.culprits)} ({report.culprit_reason})")
    else:
        lines.append(f"culprit ranks: none identified ({report.culprit_reason})")
    for rank in report.culprits:
        dump = report.dumps.get(rank)
        if dump is None:
            lines.append(f"  rank {rank}: {report.crashed.get(rank, 'no dump (dead, or its watchdog never ran)')}")
            continue
        top = _top_frame(dump)
        lines.append(f"  rank {rank} ({dump.get('host')}, pid {dump.get('pid')}): iteration {dump.get('iteration')}, "
                     f"no progress for {dump.get('stalled_s')} s, last progress {dump.get('last_progress')}; "
                     f"at {top}")
    if report.missing:
        lines.append(f"ranks without a dump: {rank_ranges(report.missing)}")
    for rank, text in sorted(report.crashed.items()):
        lines.append(f"crashed: rank {rank}: {text}")
    if report.terminated:
        lines.append(f"terminated by signal: {rank_ranges(report.terminated)}")
    lines.append("collectives in flight:" if report.groups else "collectives in flight: none")
    for g in report.groups:
        joined = ", ".join(f"{r} (last {g.missing_last[r]})" for r in g.never_joined) or "none"
        lines.append(f"  group {g.name} {g.desc or ''} ranks {rank_ranges(g.ranks)}: {g.op} #{g.seq}; "
                     f"waiting {rank_ranges(g.waiting)} (up to {g.waiting_s:.1f} s); never joined: {joined}")
    if report.p2p:
        lines.append("p2p in flight:")
        for p in report.p2p:
            lines.append(f"  rank {p['rank']} {p['kind']} {'from' if p['kind'] == 'recv' else 'to'} rank {p['peer']} "
                         f"(open {p['open_s']} s)")
    lines.append("merged main-thread stacks (ranks: frame):")
    width = max(8, len(rank_ranges(report.stacks.ranks)) + 2)

    def walk(node: StackNode, depth: int) -> None:
        for child in node.children.values():
            if depth < max_depth:
                label = f"{child.function}  {_short(child.file)}:{child.line}" if child.file else child.function
                code = f"  | {child.code}" if child.code else ""
                lines.append(f"  {rank_ranges(child.ranks):<{width}} {'  ' * depth}{label}{code}")
                walk(child, depth + 1)

    walk(report.stacks, 0)
    return "\n".join(lines)


def _top_frame(dump: dict) -> str:
    for thread in dump.get("threads", []):
        if thread.get("main") and thread.get("frames"):
            frame = thread["frames"][-1]
            return f"{frame['function']} {_short(frame['file'])}:{frame['line']}"
    return "unknown frame"


def format_html(report: HangReport) -> str:
    """A page with no external resources: the verdict, tables, and an icicle SVG of the merged
    stacks (width = number of ranks through a frame; frames on a culprit's path in red)."""
    e = html.escape
    culprits = set(report.culprits)
    rows_groups = "".join(
        f"<tr><td>{e(g.name)} {e(g.desc or '')}</td><td>{rank_ranges(g.ranks)}</td><td>{e(g.op)} #{g.seq}</td>"
        f"<td>{rank_ranges(g.waiting)}</td><td class=bad>{rank_ranges(g.never_joined)}</td><td>{g.waiting_s:.1f}</td></tr>"
        for g in report.groups)
    rows_p2p = "".join(f"<tr><td>{p['rank']}</td><td>{e(p['kind'])}</td><td>{p['peer']}</td><td>{p['open_s']}</td></tr>"
                       for p in report.p2p)
    world = max(1, len(report.stacks.ranks))
    width, row_height = 1200.0, 18
    rects: list[str] = []
    depth_max = [0]

    def draw(node: StackNode, x: float, depth: int) -> None:
        for child in sorted(node.children.values(), key=lambda n: min(n.ranks)):
            w = width * len(child.ranks) / world
            y = depth * row_height
            depth_max[0] = max(depth_max[0], depth + 1)
            colour = "#e0584f" if child.ranks & culprits else "#7fa7d9"
            label = f"{child.function} [{rank_ranges(child.ranks)}]"
            title = f"{child.function} {child.file}:{child.line}\n{child.code}\nranks {rank_ranges(child.ranks)}"
            rects.append(f'<g><title>{e(title)}</title><rect x="{x:.1f}" y="{y}" width="{max(w - 1, 1):.1f}" '
                         f'height="{row_height - 1}" fill="{colour}"/><text x="{x + 3:.1f}" y="{y + 13}" '
                         f'font-size="11">{e(label[: int(w / 6.5)])}</text></g>')
            draw(child, x, depth + 1)
            x += w

    draw(report.stacks, 0.0, 0)
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{depth_max[0] * row_height + 2}" '
           f'font-family="monospace">{"".join(rects)}</svg>')
    verdict = (f"culprit ranks: <b class=bad>{rank_ranges(report.culprits)}</b> ({e(report.culprit_reason)})"
               if report.culprits else f"no culprit identified ({e(report.culprit_reason)})")
    extra = ""
    if report.missing:
        extra += f"<p>ranks without a dump: {rank_ranges(report.missing)}</p>"
    for rank, text in sorted(report.crashed.items()):
        extra += f"<p class=bad>rank {rank} crashed: {e(text)}</p>"
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>MegaScan hang diagnosis</title>
<style>body{{font-family:sans-serif;margin:1em}}table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;
padding:2px 6px}}.bad{{color:#b00}}pre{{background:#f6f6f6;padding:6px;overflow:auto}}</style></head><body>
<h1>Hang diagnosis</h1><p>{e(report.directory)}: {len(report.dumped)} of {report.world_size} ranks dumped</p>
<p>{verdict}</p>{extra}
<h2>Collectives in flight</h2><table><tr><th>group</th><th>ranks</th><th>op #seq</th><th>waiting</th>
<th>never joined</th><th>waiting s</th></tr>{rows_groups}</table>
<h2>P2P in flight</h2><table><tr><th>rank</th><th>kind</th><th>peer</th><th>open s</th></tr>{rows_p2p}</table>
<h2>Merged main-thread stacks</h2><p>outermost frame on top; width = ranks; red = on a culprit's stack</p>{svg}
<h2>Text</h2><pre>{e(format_text(report))}</pre></body></html>"""


def add_arguments(parser) -> None:
    parser.add_argument("directory", help="trace dir holding hang-rank*.json / crash-rank* files")
    parser.add_argument("--html", default=None, metavar="FILE", help="HTML/SVG view (default: DIR/hang-report.html)")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the diagnosis as JSON")
    parser.add_argument("--all-threads", action="store_true", help="merge every thread's stack, not only the main one")


def run(args) -> int:
    import sys

    try:
        report = diagnose(args.directory)
    except HangDiagnosisError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.all_threads:
        report.stacks = merge_stacks(report.dumps, all_threads=True)
    print(format_text(report))
    html_path = Path(args.html) if args.html else Path(args.directory) / "hang-report.html"
    html_path.write_text(format_html(report))
    print(f"wrote {html_path}")
    if args.json:
        Path(args.json).write_text(json.dumps(report.as_dict(), indent=1))
    return 0
