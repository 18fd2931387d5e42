"""Request traces (CSV logs of real traffic) → one token length per request."""

from __future__ import annotations

import csv
import re
from pathlib import Path

from pipeline.errors import EmptyTraceError, TraceColumnError, TraceNotFoundError, TraceValueError

# Strict: int() would also take "1_000" and "١٢" (other scripts' digits).
_INT = re.compile(r"[+-]?[0-9]+")


def read_lengths(path: Path | str, column: str, plus_column: str | None = None) -> list[int]:
    """One length per request: ``column``, plus ``plus_column`` when given.

    Prompt + generated tokens is the length a decode bucket's KV cache must hold. Raises a
    TraceError subclass naming the file (and line) for a missing file or column, a cell
    that is not a whole number ≥ 0, or a trace without requests.
    """
    path = Path(path)
    try:
        # utf-8-sig: spreadsheets often prepend a byte-order mark to the header.
        with open(path, newline="", encoding="utf-8-sig") as f:
            return _read(path, csv.reader(f), column, plus_column)
    except FileNotFoundError:
        raise TraceNotFoundError(str(path), "no such file", "check the path") from None
    except IsADirectoryError:
        raise TraceNotFoundError(str(path), "is a directory", "give a CSV file") from None
    except UnicodeDecodeError as e:
        raise TraceValueError(
            str(path), f"not UTF-8 text ({e.reason})", "give a CSV file with a header row"
        ) from None
    except csv.Error as e:
        raise TraceValueError(str(path), f"malformed CSV ({e})", "check quoting") from None


def _read(path: Path, rows, column: str, plus_column: str | None) -> list[int]:
    header = next(rows, None)
    if not header or not any(h.strip() for h in header):
        raise EmptyTraceError(
            str(path), "empty file", "expected a header row, then one request a row"
        )
    names = [h.strip() for h in header]
    wanted = [column] if plus_column is None else [column, plus_column]
    idx = [_column_index(path, names, c) for c in wanted]
    lengths = []
    for row in rows:
        if not row:  # blank line (e.g. a trailing newline)
            continue
        total = 0
        for c, i in zip(wanted, idx, strict=True):
            total += _cell(path, rows.line_num, c, row[i] if i < len(row) else "")
        lengths.append(total)
    if not lengths:
        raise EmptyTraceError(str(path), "no requests after the header", "one request a row")
    return lengths


def _column_index(path: Path, names: list[str], column: str) -> int:
    if column not in names:
        raise TraceColumnError(
            str(path),
            f"no column '{column}'",
            f"columns are: {', '.join(names)}",
            columns=names,
        )
    return names.index(column)


def _cell(path: Path, line: int, column: str, text: str) -> int:
    s = text.strip()
    if not _INT.fullmatch(s):
        why = "missing value" if not s else f"'{s}' is not an integer"
        raise TraceValueError(
            f"{path}:{line}", f"{column}: {why}", "token counts are whole numbers ≥ 0", line=line
        )
    n = int(s)
    if n < 0:
        raise TraceValueError(
            f"{path}:{line}", f"{column}: {n} is negative", "token counts are ≥ 0", line=line
        )
    return n
