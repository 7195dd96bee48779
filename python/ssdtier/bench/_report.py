"""What a bench shows: progress on stderr while it runs, then a table, or JSON for machines."""

from __future__ import annotations

import enum
import json
import sys
from typing import Any

__all__ = ["Progress", "emit", "jsonable", "table"]


class Progress:
    """A progress bar on stderr: tqdm's where it is installed, else a line per update."""

    def __init__(self, total: int, desc: str, unit: str = "it") -> None:
        self.total, self.desc, self.done = total, desc, 0
        try:
            from tqdm import tqdm

            self._bar: Any = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False)
        except ImportError:
            self._bar = None

    def update(self, n: int = 1, note: str = "") -> None:
        self.done += n
        if self._bar is not None:
            if note:
                self._bar.set_postfix_str(note, refresh=False)
            self._bar.update(n)
        else:
            print(f"{self.desc}: {self.done}/{self.total}{'  ' + note if note else ''}", file=sys.stderr, flush=True)

    def write(self, line: str) -> None:
        """A line on stderr that the bar does not overwrite."""
        if self._bar is not None:
            self._bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def table(headers: list[str], rows: list[list[str]]) -> str:
    """Columns aligned: text to the left, numbers to the right."""
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]

    def line(cells: list[str]) -> str:
        out = []
        for i, cell in enumerate(cells):
            cell = str(cell)
            numeric = cell[:1].isdigit() or cell[:1] in "-." and cell[1:2].isdigit()
            out.append(cell.rjust(widths[i]) if numeric else cell.ljust(widths[i]))
        return "  ".join(out).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def jsonable(o: Any) -> Any:
    """JSON for what ``off.stats()`` may hold beside numbers: an enum by its value, else its text."""
    return o.value if isinstance(o, enum.Enum) else str(o)


def emit(result: dict[str, Any], text: str, as_json: bool) -> None:
    """Print the result: its JSON (``--json``) or the text made for people."""
    print(json.dumps(result, indent=2, default=jsonable) if as_json else text)
