"""Terminal output: tables and a progress bar, with rich where it is installed and aligned plain text where not."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

try:  # rich is in the `bench` extra; the GPU box may not have it
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    RICH = True
except ImportError:
    RICH = False

__all__ = ["RICH", "say", "print_table", "ProgressBar"]

# Piped output (a log file, CI) gets a wide console: rich would otherwise squeeze the tables into 80 columns.
_console = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 220) if RICH else None
_STYLES = {"PASS": "green", "pass": "green", "FAIL": "bold red", "ERROR": "bold red", "n/a": "yellow"}


def say(text: str = "", style: str | None = None) -> None:
    """Prints a line (styled with rich when available)."""
    if _console is not None:
        _console.print(text, style=style, markup=False)
    else:
        print(text, flush=True)


def print_table(
    title: str,
    columns: Sequence[str],
    rows: Sequence[Sequence[object]],
    note: str = "",
    left: int = 2,
    *,
    wrap_last: bool = False,
) -> None:
    """A table whose first ``left`` columns are left-aligned (labels) and the rest right-aligned (numbers); cells that
    start with PASS/FAIL/ERROR/n/a are colored under rich. ``wrap_last``: the last column is prose (a method's
    implementation) and wraps under rich, left-aligned, so that a long sentence never squeezes the labels before it
    into ellipses."""
    cells = [["" if c is None else str(c) for c in row] + [""] * (len(columns) - len(row)) for row in rows]
    if _console is not None:
        table = Table(title=title, caption=note or None, show_lines=False, header_style="bold")
        for i, col in enumerate(columns):
            prose = wrap_last and i == len(columns) - 1
            table.add_column(col, justify="left" if i < left or prose else "right", no_wrap=not prose)
        for row in cells:
            table.add_row(*(_styled(c) for c in row))
        _console.print(table)
        return
    widths = [max([len(col)] + [len(r[i]) for r in cells]) for i, col in enumerate(columns)]
    line = "  ".join(col.ljust(w) for col, w in zip(columns, widths))
    print(f"\n{title}\n{line}\n{'-' * len(line)}")
    for row in cells:
        print("  ".join(c.rjust(w) if i >= left else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))))
    if note:
        print(note)
    sys.stdout.flush()


def _styled(cell: str):
    for key, style in _STYLES.items():
        if cell.startswith(key):
            from rich.text import Text

            return Text(cell, style=style)
    return cell


class ProgressBar:
    """A progress bar over the sweep on stderr: rich's when available, else a line every few seconds."""

    def __init__(self, total: int, label: str = "sweep"):
        self.total, self.label, self.done = total, label, 0
        self._last = 0.0
        self._progress = None
        if RICH:
            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.fields[item]}"),
                console=Console(stderr=True),
                transient=False,
            )
            self._task = self._progress.add_task(label, total=total, item="")

    def __enter__(self) -> ProgressBar:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()
        else:
            print(f"[{self.label}] {self.done}/{self.total} done", file=sys.stderr, flush=True)

    def describe(self, item: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, item=item)

    def advance(self, item: str = "", steps: int = 1) -> None:
        self.done += steps
        if self._progress is not None:
            self._progress.update(self._task, advance=steps, item=item)
            return
        now = time.monotonic()
        if now - self._last > 2.0 or self.done >= self.total:
            self._last = now
            print(f"[{self.label}] {self.done}/{self.total} {item}", file=sys.stderr, flush=True)
