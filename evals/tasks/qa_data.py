"""The rows of ``qa.jsonl`` (beside this file) as the ``test`` split, for the tasks' ``custom_dataset``.

lm-eval hands ``dataset_kwargs: {data_files: ...}`` to ``datasets.load_dataset`` unchanged, so a relative
path there is read from the current directory; ``!function`` imports this file from the YAML's folder, so
the tasks find their rows whatever directory ``lm_eval --include_path`` runs from. The rows are read with
the standard library and held in memory: nothing is downloaded or written to the datasets cache.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ROWS = Path(__file__).resolve().parent / "qa.jsonl"


def rows() -> list[dict[str, Any]]:
    """``qa.jsonl``: ``question``, ``answer``, ``choices`` (4, the answer among them), ``label`` (the
    answer's index in ``choices``)."""
    with ROWS.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load(**_metadata: Any) -> dict[str, Any]:
    """``{"test": datasets.Dataset}`` of :func:`rows`. lm-eval passes the task's metadata and the model
    arguments as keyword arguments; none of them changes the rows."""
    import datasets

    return {"test": datasets.Dataset.from_list(rows())}
