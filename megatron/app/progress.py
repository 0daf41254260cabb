"""Progress lines for the long steps of our tools (aggregating traces, detection, building the
demo corpus), always on stderr so that what a tool prints on stdout (summaries, --json) stays as
it was. On a terminal one line is redrawn in place, at most 4 times a second; to a file or a pipe
a plain line is written every few seconds while a step runs, and one when it ends:

    [aggregate] loading rank files 512/1024 (3.1 s)

`MEGATRON_PROGRESS=0` turns them off everywhere; a tool's `--quiet` turns off its own. Library
calls are silent unless a caller hands them a `Reporter` (the CLIs do), so code that aggregates
inside a training job (online detection) never writes these lines."""
from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import IO, TypeVar

ENV = "MEGATRON_PROGRESS"
TTY_INTERVAL_S = 0.25  # redraws of the in-place line on a terminal
LINE_INTERVAL_S = 2.0  # plain lines to a file or pipe while one step runs
_BAR = 20
T = TypeVar("T")


def progress_enabled(quiet: bool = False) -> bool:
    """Whether progress is wanted: not with --quiet, nor with MEGATRON_PROGRESS=0/false/no/off."""
    if quiet:
        return False
    return os.environ.get(ENV, "").strip().lower() not in ("0", "false", "no", "off")


def _isatty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError, OSError):
        return False


class Progress:
    """One step: `update(n)` as work is done (cheap: a clock read, a line at most every interval),
    `close()` or the end of its `with` block when the step ends (writes the final line)."""

    def __init__(self, reporter: Reporter, what: str, total: int | None = None, *, unit: str = "",
                 scale: float = 1.0) -> None:
        self.reporter, self.what, self.total = reporter, what, total
        self.unit, self.scale = unit, scale
        self.done = 0
        self._shown: int | None = None  # `done` of the last line written
        self.started = time.monotonic()
        self._next = self.started + reporter.interval
        self._closed = not reporter.enabled

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, n: int = 1) -> None:
        self.done += n
        if not self._closed and time.monotonic() >= self._next:
            self._show(final=False)

    def set(self, done: int) -> None:
        self.update(done - self.done)

    def add_total(self, n: int) -> None:
        self.total = (self.total or 0) + n

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self.reporter.tty or self._shown != self.done:  # a plain line already saying it all is enough
                self._show(final=True)

    def line(self) -> str:
        elapsed = time.monotonic() - self.started
        if self.scale != 1.0:
            count = f"{self.done / self.scale:.1f}" + (f"/{self.total / self.scale:.1f}" if self.total else "")
        else:
            count = f"{self.done}" + (f"/{self.total}" if self.total is not None else "")
        count = f" {count}{self.unit}" if self.done or self.total else ""
        bar = ""
        if self.reporter.tty and self.total:
            filled = min(_BAR, int(_BAR * self.done / self.total))
            bar = " [" + "#" * filled + "." * (_BAR - filled) + "]"
        return f"[{self.reporter.tool}] {self.what}{bar}{count} ({elapsed:.1f} s)"

    def _show(self, final: bool) -> None:
        self._next = time.monotonic() + self.reporter.interval
        self._shown = self.done
        text = self.line()
        if self.reporter.tty:
            text = "\r" + text + "\x1b[K" + ("\n" if final else "")
        else:
            text += "\n"
        try:
            self.reporter.stream.write(text)
            self.reporter.stream.flush()
        except (OSError, ValueError):  # a closed or broken stderr must not fail the work
            self._closed = True


class Reporter:
    """Makes the `Progress` of each step of one tool (`tool` names it in every line)."""

    def __init__(self, tool: str, *, enabled: bool = True, stream: IO[str] | None = None,
                 interval: float | None = None) -> None:
        self.tool = tool
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.tty = enabled and _isatty(self.stream)
        self.interval = interval if interval is not None else TTY_INTERVAL_S if self.tty else LINE_INTERVAL_S

    def step(self, what: str, total: int | None = None, *, unit: str = "", scale: float = 1.0) -> Progress:
        return Progress(self, what, total, unit=unit, scale=scale)

    def iterate(self, what: str, items: Iterable[T], total: int | None = None) -> Iterator[T]:
        """Yield `items`, counting them; the step ends when they do."""
        if total is None and hasattr(items, "__len__"):
            total = len(items)  # type: ignore[arg-type]
        with self.step(what, total) as progress:
            for item in items:
                yield item
                progress.update()


def reporter(tool: str, *, quiet: bool = False, stream: IO[str] | None = None) -> Reporter:
    """The reporter a command-line tool uses: on unless --quiet or MEGATRON_PROGRESS=0."""
    return Reporter(tool, enabled=progress_enabled(quiet), stream=stream)


SILENT = Reporter("", enabled=False)
