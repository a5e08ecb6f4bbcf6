"""The records of W&B offline run files (``offline-run-*/run-<id>.wandb``), for tests.

The file is a LevelDB-style log (``:W&B`` header of 7 bytes, 32 KiB blocks of chunks with a 7-byte
header: CRC32, length, type FULL/FIRST/MIDDLE/LAST) of ``wandb_internal_pb2.Record`` messages.
"""

from __future__ import annotations

import json
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["OfflineRun", "offline_runs"]


@dataclass
class OfflineRun:
    """One offline run folder: a segment of a W&B run."""

    folder: Path
    run_id: str = ""
    resume: bool = False
    """The run record's ``resume`` (``resume="allow"``/``"must"`` was given)."""
    resumed: bool = False
    """The run record's ``resumed``."""
    group: str = ""
    job_type: str = ""
    history: list[dict] = field(default_factory=list)
    """Each history row: key -> value (``_step`` included)."""
    config: bytes = b""
    """The config records' bytes (the run config's keys and values)."""
    settings: dict = field(default_factory=dict)
    """The run config as W&B holds it at the end: key -> value, each later update replacing the key."""
    exited: bool = False
    """The file holds the exit record (``run.finish()``'s last)."""

    @property
    def steps(self) -> list[int]:
        return [int(row["_step"]) for row in self.history]


def _records(path: Path):
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    if len(data) < 7:  # not written yet
        return
    assert data[:4] == b":W&B", path
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if pos + 7 + length > len(data):  # a chunk still being written
            return
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0 and length == 0:
            continue
        buf += chunk
        if kind in (1, 4):  # FULL, LAST
            record = pb.Record()
            record.ParseFromString(buf)
            buf = b""
            yield record


def offline_runs(wandb_dir: Path, *, wait_s: float = 60.0) -> list[OfflineRun]:
    """Every ``offline-run-*`` folder under ``wandb_dir``, oldest first, read once each run file holds its exit
    record (W&B's service writes the file on its own; on a loaded machine it can trail ``run.finish()``),
    or after ``wait_s`` as it is then. A folder without a run file (an attempt that never reached the
    service) is read as it is."""
    deadline = time.monotonic() + wait_s
    while True:
        runs = [_read(folder) for folder in sorted(Path(wandb_dir).glob("offline-run-*"))]
        pending = [r for r in runs if not r.exited and any(r.folder.glob("*.wandb"))]
        if not pending or time.monotonic() > deadline:
            return runs
        time.sleep(0.2)


def _read(folder: Path) -> OfflineRun:
    run = OfflineRun(folder)
    for path in folder.glob("*.wandb"):
        for record in _records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                r = record.run
                run.run_id, run.resume, run.resumed = r.run_id, r.resume, r.resumed
                run.group, run.job_type = r.run_group, r.job_type
                run.config += r.config.SerializeToString()
                _update(run.settings, r.config)
            elif kind == "config":
                run.config += record.config.SerializeToString()
                _update(run.settings, record.config)
            elif kind == "history":
                run.history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                    for item in record.history.item})
            elif kind == "exit":
                run.exited = True
    return run


def _update(settings: dict, config) -> None:
    """A config record's items into ``settings`` (W&B's own keys, ``_wandb``, left out)."""
    for item in config.update:
        key = item.key or "/".join(item.nested_key)
        if key != "_wandb":
            settings[key] = json.loads(item.value_json)
