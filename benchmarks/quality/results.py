"""The results file: one JSON object per line, appended as soon as a batch finishes, so a killed run
loses at most the batch it was in and continues where it stopped (``done`` tells the runner what to skip).

A record's key is (backend, model, dtype, setting, length, task, index, method, ratio): ``ratio`` is the
compression ratio asked for (0.0 for the full cache). The realised ratio (``realised_ratio``) is what
eviction actually removed from the compressed span, from the engine's per-request stats or kvpress's kept
count. Runs of another model or dtype can share a file; reports filter by them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

KEY_FIELDS = ("backend", "model", "dtype", "setting", "length", "task", "index", "method", "ratio")


def key_of(record: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(record[name] for name in KEY_FIELDS)


def read(path: Path) -> list[dict[str, Any]]:
    """Every record of ``path`` (a missing file has none). A torn last line (the run was killed while
    writing it) is skipped; any other bad line is an error."""
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(lines):
                continue
            raise ValueError(f"{path}:{number}: not a JSON record") from None
    return records


def _ends_with_newline(path: Path) -> bool:
    """True for a missing or empty file, or one whose last byte is a newline."""
    if not path.exists() or path.stat().st_size == 0:
        return True
    with path.open("rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


@dataclass
class Store:
    path: Path

    def __post_init__(self) -> None:
        self.path = Path(self.path)
        self._drop_torn_line()
        self.records = read(self.path)
        self._done = {key_of(r) for r in self.records}

    def _drop_torn_line(self) -> None:
        """A run killed while writing leaves a last line that is not a whole record: cut it off, so that
        the next record does not land after it."""
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        body = data.rstrip(b"\n")
        start = body.rfind(b"\n") + 1
        last = body[start:]
        if not last.strip():
            return
        try:
            json.loads(last)
        except json.JSONDecodeError:
            self.path.write_bytes(data[:start])

    def done(self, key: tuple[Any, ...]) -> bool:
        return key in self._done

    def add(self, records: Iterable[dict[str, Any]]) -> None:
        """Append and flush to disk (fsync: a record on disk is a record the next run skips)."""
        new = [r for r in records if key_of(r) not in self._done]
        if not new:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # A torn last line from a killed run would glue onto the next record: start on a fresh line.
        prefix = "" if _ends_with_newline(self.path) else "\n"
        with self.path.open("a") as f:
            f.write(prefix + "".join(json.dumps(r, sort_keys=True) + "\n" for r in new))
            f.flush()
            os.fsync(f.fileno())
        self.records.extend(new)
        self._done.update(key_of(r) for r in new)

    def select(self, **where: Any) -> Iterator[dict[str, Any]]:
        return (r for r in self.records if all(r.get(k) == v for k, v in where.items()))
