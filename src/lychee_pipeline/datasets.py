"""Custom Kedro datasets: Arrow tables stored as Parquet, JSON-lines files of dicts, and typed (pydantic) JSON."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from kedro.io.core import AbstractDataset, DatasetError


@contextmanager
def _atomic_file(path: Path) -> Iterator[Path]:
    """Yield a temporary path next to ``path`` and move it into place when the block succeeds.

    On any failure (disk full, interrupted) the half-written file is dropped and the previous output stays.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class ArrowTableDataset(AbstractDataset[pa.Table, pa.Table]):
    """A ``pyarrow.Table`` stored as one Parquet file (memory-mapped on load, atomic on save).

    With ``missing_ok: true`` loading a file that does not exist returns ``None`` instead of
    failing, so a node can take a previous run's output (for example the image manifest).
    """

    def __init__(
        self,
        filepath: str,
        missing_ok: bool = False,
        load_args: dict[str, Any] | None = None,
        save_args: dict[str, Any] | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        self._filepath = Path(filepath)
        self._missing_ok = missing_ok
        self._load_args = {"memory_map": True, **(load_args or {})}
        self._save_args = {"compression": "zstd", **(save_args or {})}
        self.metadata = metadata

    def load(self) -> pa.Table | None:
        """Read the Parquet file (``None`` when absent and ``missing_ok``)."""
        if not self._filepath.exists():
            if self._missing_ok:
                return None
            raise DatasetError(f"no Parquet file at {self._filepath}")
        return pq.read_table(self._filepath, **self._load_args)

    def save(self, data: pa.Table) -> None:
        """Write ``data`` to a temporary file, then move it into place."""
        if not isinstance(data, pa.Table):
            raise DatasetError(f"ArrowTableDataset saves a pyarrow.Table, got {type(data).__name__}")
        with _atomic_file(self._filepath) as tmp:
            pq.write_table(data, tmp, **self._save_args)

    def _exists(self) -> bool:
        return self._filepath.exists()

    def _describe(self) -> dict[str, Any]:
        return {"filepath": str(PurePosixPath(self._filepath)), "missing_ok": self._missing_ok}

    def preview(self, nrows: int = 5) -> dict[str, Any]:
        """The first rows as a table (kedro-viz's dataset preview); nested columns as JSON text."""
        if not self._filepath.exists():
            return {"index": [], "columns": [], "data": []}
        head = pq.ParquetFile(self._filepath).iter_batches(batch_size=nrows)
        rows = next(head, pa.record_batch([])).to_pylist()[:nrows]
        return _table_preview(rows)


class JSONLinesDataset(AbstractDataset[list[dict[str, Any]], list[dict[str, Any]]]):
    """A list of JSON objects, one per line (UTF-8, no ASCII escaping), saved atomically."""

    def __init__(self, filepath: str, metadata: dict[str, Any] | None = None) -> None:
        self._filepath = Path(filepath)
        self.metadata = metadata

    def load(self) -> list[dict[str, Any]]:
        """Read every line as a JSON object."""
        if not self._filepath.exists():
            raise DatasetError(f"no JSON-lines file at {self._filepath}")
        with self._filepath.open(encoding="utf-8") as handle:
            return [json.loads(line) for line in handle if line.strip()]

    def save(self, data: list[dict[str, Any]]) -> None:
        """Write one JSON object per line."""
        with _atomic_file(self._filepath) as tmp, tmp.open("w", encoding="utf-8") as handle:
            for row in data:
                handle.write(json.dumps(row, ensure_ascii=False) + "\n")

    def _exists(self) -> bool:
        return self._filepath.exists()

    def _describe(self) -> dict[str, Any]:
        return {"filepath": str(PurePosixPath(self._filepath))}

    def preview(self, nrows: int = 5) -> dict[str, Any]:
        """The first lines as a table (kedro-viz's dataset preview)."""
        rows: list[dict[str, Any]] = []
        if self._filepath.exists():
            with self._filepath.open(encoding="utf-8") as handle:
                for line in handle:
                    if line.strip():
                        rows.append(json.loads(line))
                    if len(rows) >= nrows:
                        break
        return _table_preview(rows)


def _table_preview(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Rows as kedro-viz's table preview (pandas' "split" layout), nested values as JSON text."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    cell = lambda v: v if isinstance(v, (str, int, float, bool, type(None))) else json.dumps(v, ensure_ascii=False)  # noqa: E731
    return {"index": list(range(len(rows))), "columns": columns, "data": [[cell(r.get(c)) for c in columns] for r in rows]}


class PydanticJSONDataset(AbstractDataset[Any, Any]):
    """A pydantic model stored as one JSON file (atomic on save), loaded back as the same typed model.

    ``model`` is the model's import path (``lychee_pipeline.training.planning.TrainingPlan``), so the nodes on
    either side of the catalog pass typed objects and no node re-validates a dict.
    """

    def __init__(self, filepath: str, model: str, metadata: dict[str, Any] | None = None) -> None:
        import importlib

        module, _, name = model.rpartition(".")
        self._filepath = Path(filepath)
        self._model_path = model
        self._model = getattr(importlib.import_module(module), name)
        self.metadata = metadata

    def load(self) -> Any:
        if not self._filepath.exists():
            raise DatasetError(f"no JSON file at {self._filepath}")
        return self._model.model_validate_json(self._filepath.read_text(encoding="utf-8"))

    def save(self, data: Any) -> None:
        data = self._model.model_validate(data)  # a dict saved here is checked on the way in, too
        with _atomic_file(self._filepath) as tmp:
            tmp.write_text(data.model_dump_json(indent=1), encoding="utf-8")

    def _exists(self) -> bool:
        return self._filepath.is_file()

    def _describe(self) -> dict[str, Any]:
        return {"filepath": str(PurePosixPath(self._filepath)), "model": self._model_path}
