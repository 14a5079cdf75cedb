"""CSV files a spreadsheet opens: ``<run_dir>/csv/<kind>.csv``, one row per record."""

from __future__ import annotations

import csv
import io
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ampddp.loggers.base import MetricLogger
from ampddp.run_files import open_for_append, replace_file, run_file_errors


class CsvLogger(MetricLogger):
    """One file per kind (train, eval, compile) with a ``step`` column and one column per value.

    Rows are appended; a value first seen later adds a column (the file is rewritten whole, as at a
    start). A resumed run drops the rows of steps after the one it resumes at, which the run that
    died logged but never kept.
    """

    name = "csv"

    def __init__(self) -> None:
        self._folder = Path()
        self._rows: dict[str, list[dict[str, Any]]] = {}
        self._columns: dict[str, list[str]] = {}

    def start(self, run_dir: Path, config: Mapping[str, Any] | None, run_id: str | None, step: int) -> str | None:
        self._folder = run_dir / "csv"
        self._rows, self._columns = {}, {}
        if self._folder.is_dir():
            for path in sorted(self._folder.glob("*.csv")):
                with path.open(newline="", encoding="utf-8") as file:
                    reader = csv.DictReader(file)
                    rows = [row for row in reader if row.get("step", "").isdigit() and int(row["step"]) <= step]
                    self._columns[path.stem] = list(reader.fieldnames or ["step"])
                self._rows[path.stem] = rows
                self._write(path.stem)
        return None

    def log(self, kind: str, values: Mapping[str, float], step: int) -> None:
        columns = self._columns.setdefault(kind, ["step"])
        new_columns = [key for key in values if key not in columns]
        row = {"step": step, **values}
        self._rows.setdefault(kind, []).append(row)
        if new_columns or len(self._rows[kind]) == 1:
            columns.extend(new_columns)
            self._write(kind)  # the header changes: the file is written whole
            return
        path = self._folder / f"{kind}.csv"
        text = io.StringIO()
        csv.DictWriter(text, fieldnames=columns, restval="").writerow(row)
        with run_file_errors(path), open_for_append(path) as file:
            file.write(text.getvalue())

    def _write(self, kind: str) -> None:
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=self._columns[kind], restval="")
        writer.writeheader()
        writer.writerows(self._rows[kind])
        path = self._folder / f"{kind}.csv"
        with run_file_errors(path):
            self._folder.mkdir(parents=True, exist_ok=True)
            replace_file(path, text.getvalue().encode())
