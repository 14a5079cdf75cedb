"""CSV files a spreadsheet opens: ``<run_dir>/csv/<kind>.csv``, one row per record."""

from __future__ import annotations

import csv
import io
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ampddp.observe.loggers.base import MetricLogger
from ampddp.rundir.beneath import checked_folder, read_beneath
from ampddp.rundir.files import open_for_append, replace_file, run_file_errors

MAX_CSV_BYTES = 256 * 2**20
"""The largest CSV file read back at a start (a million rows of a dozen values is about 100 MiB)."""


class CsvLogger(MetricLogger):
    """One file per kind (train, eval, compile) with a ``step`` column and one column per value.

    Rows are appended; a value first seen later adds a column (the file is read back and written
    whole, as at a start, so nothing is held in memory between records). A resumed run drops the
    rows of steps after the one it resumes at, which the run that died logged but never kept.
    """

    name = "csv"

    def __init__(self) -> None:
        self._run_dir = self._folder = Path()
        self._columns: dict[str, list[str]] = {}

    def start(self, run_dir: Path, config: Mapping[str, Any] | None, run_id: str | None, step: int) -> str | None:
        self._run_dir = run_dir
        self._folder = checked_folder(run_dir, run_dir / "csv")  # no link on the way: the run's files stay in it
        self._columns = {}
        for path in sorted(self._folder.glob("*.csv")):
            columns, rows = self._read(path)
            self._columns[path.stem] = columns
            self._write(path.stem, [row for row in rows if row.get("step", "").isdigit() and int(row["step"]) <= step])
        return None

    def log(self, kind: str, values: Mapping[str, float], step: int) -> None:
        row = {"step": step, **values}
        path = self._folder / f"{kind}.csv"
        columns = self._columns.get(kind)
        if columns is None or any(key not in columns for key in row):
            kept = self._read(path)[1] if columns is not None else []
            self._columns[kind] = [*(columns or ["step"]), *(key for key in row if key not in (columns or ["step"]))]
            self._write(kind, [*kept, row])  # the header changes: the file is written whole
            return
        text = io.StringIO()
        csv.DictWriter(text, fieldnames=columns, restval="").writerow(row)
        with run_file_errors(path), open_for_append(path, self._run_dir) as file:
            file.write(text.getvalue())

    def _write(self, kind: str, rows: list[Mapping[str, Any]]) -> None:
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=self._columns[kind], restval="")
        writer.writeheader()
        writer.writerows(rows)
        path = self._folder / f"{kind}.csv"
        with run_file_errors(path):
            replace_file(path, text.getvalue().encode(), self._run_dir)

    def _read(self, path: Path) -> tuple[list[str], list[dict[str, str]]]:
        """A CSV file's columns and rows (none when it is missing); a link, a special file or one
        beyond ``MAX_CSV_BYTES`` is refused (ConfigError) before it is read."""
        try:
            data = read_beneath(self._run_dir, path, MAX_CSV_BYTES, "a CSV file of this logger")
        except FileNotFoundError:
            return ["step"], []
        reader = csv.DictReader(io.StringIO(data.decode("utf-8", errors="replace"), newline=""))
        rows = list(reader)
        return list(reader.fieldnames or ["step"]), rows
