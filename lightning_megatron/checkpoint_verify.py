"""What a lightning_megatron checkpoint directory must prove before anything reads it.

:func:`verify_checkpoint` is THE check of every path that reads our checkpoints (``--ckpt_path`` of
fit/validate/test/predict through :func:`lightning_megatron.checkpoint.load`, ``init_from``,
``export hf`` and ``load_from_checkpoint`` through ``read_model_checkpoint``): the marker, every file's
size and sha256, and DCP metadata that names only checksummed files, unpickled with an allow-list.
A checkpoint without checksums (format 1, or a marker whose checksums were removed) loads only with
the user's explicit opt-in (:data:`ALLOW_UNVERIFIED_ENV`, ``--allow-unverified-checkpoint``).

:func:`recover_last`: ``ckpt_path="last"`` when ``last.ckpt`` is missing but an interrupted save left a
complete ``last.ckpt.tmp-<id>`` (a file system without an atomic exchange rename): that temporary if
it verifies, else an error; never a silent restart from step 0.

:func:`checkpoint_identity`: the run that wrote a checkpoint (the ``run_id`` of its marker; before
markers recorded it, the W&B run id in its ``extra.pt``) and its step, which the save guard and the
CLI's run-folder rules read (one run's checkpoints per folder; a save never replaces another run's).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_megatron import dcp_io
from lightning_megatron.dcp_io import CheckpointError

__all__ = ["ALLOW_UNVERIFIED_ENV", "FORMAT_VERSION", "MARKER", "READABLE_FORMATS", "TMP_INFIX", "allow_unverified",
           "checkpoint_identity", "file_sha256", "load_plain", "loadable_bytes", "newer_than_last", "read_marker",
           "recover_last", "validate_checkpoint_dir", "verify_checkpoint"]

FORMAT_VERSION = 2
READABLE_FORMATS = (1, 2)
MARKER = "lightning_megatron.json"
TMP_INFIX = ".tmp-"


# ---------------------------------------------------------------------- collectives


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gather(obj: Any) -> list[Any]:
    _, world = _rank_world()
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


def _agree(error: str | None) -> None:
    """Every rank raises the first error any rank reported (no rank goes on alone into a collective)."""
    errors = [e for e in _gather(error) if e]
    if errors:
        raise CheckpointError(errors[0])


# ---------------------------------------------------------------------- files


def file_sha256(path: Path, sync: bool = False) -> str:
    """The sha256 of a file, streamed; ``sync`` also flushes it to disk (a file this rank wrote)."""
    digest, chunk = hashlib.sha256(), bytearray(1 << 20)  # hashlib.file_digest's way; it needs Python 3.11
    view = memoryview(chunk)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(chunk):
            digest.update(view[:n])
        if sync:
            os.fsync(f.fileno())
    return digest.hexdigest()


def _files(path: Path) -> list[str]:
    """Every file of a checkpoint directory a loader may read, relative, sorted: the DCP metadata and shards,
    ``extra.pt``, the ranks' RNG states (``rng/rank_<r>.pt``). Others (``notes.txt``, a desktop's ``.DS_Store``,
    an NFS ``.nfs*`` file) are no part of it: nothing reads them."""
    return sorted(name for p in path.rglob("*") if p.is_file() and p.name != MARKER
                  and _read_by_loaders(name := str(p.relative_to(path))))


def _read_by_loaders(name: str) -> bool:
    parts = Path(name).parts
    return (name in (".metadata", "extra.pt") or (len(parts) == 1 and name.endswith(".distcp"))
            or (len(parts) == 2 and parts[0] == "rng" and parts[1].startswith("rank_") and parts[1].endswith(".pt")))


ALLOW_UNVERIFIED_ENV = "LIGHTNING_MEGATRON_ALLOW_UNVERIFIED_CHECKPOINT"
"""Set to 1 (or ``--allow-unverified-checkpoint`` on the command line) to load a checkpoint whose
marker has no checksums (format 1, or checksums removed). A checksum that does not match is refused
regardless."""


def allow_unverified() -> bool:
    """Whether the user opted in to loading checkpoints without checksums (:data:`ALLOW_UNVERIFIED_ENV`)."""
    return os.environ.get(ALLOW_UNVERIFIED_ENV, "").strip().lower() not in ("", "0", "false", "no")


def read_marker(path: Path) -> dict[str, Any]:
    """The marker of a complete checkpoint directory, its format and its file sizes checked."""
    if not path.exists():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    if not path.is_dir():
        raise CheckpointError(
            f"checkpoint {str(path)!r} is a file, not a lightning_megatron sharded checkpoint directory "
            f"(was it written by another strategy?)")
    marker = path / MARKER
    if not marker.is_file():
        raise CheckpointError(
            f"checkpoint {str(path)!r} is incomplete: {MARKER} is missing (the save was interrupted "
            f"or the directory is not a lightning_megatron checkpoint)")
    try:
        info = json.loads(marker.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(f"checkpoint {str(path)!r} has a corrupt {MARKER}: {e}") from e
    if not isinstance(info, dict) or info.get("format_version") not in READABLE_FORMATS:
        version = info.get("format_version") if isinstance(info, dict) else None
        raise CheckpointError(f"checkpoint {str(path)!r} has format_version={version}, "
                              f"this lightning_megatron reads {list(READABLE_FORMATS)}")
    for name in (".metadata", "extra.pt"):
        if not (path / name).is_file():
            raise CheckpointError(f"checkpoint {str(path)!r} is incomplete: {name} is missing")
    files = info.get("files")
    if not isinstance(files, dict):
        raise CheckpointError(f"checkpoint {str(path)!r} has a corrupt {MARKER}: no 'files' table")
    for name, size in files.items():
        f = path / name
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise CheckpointError(f"checkpoint {str(path)!r}: {MARKER} names a file outside it: {name!r}")
        if not f.is_file():
            raise CheckpointError(f"checkpoint {str(path)!r} is incomplete: {name} is missing")
        if f.stat().st_size != size:
            raise CheckpointError(f"checkpoint {str(path)!r} is corrupt: {name} has {f.stat().st_size} bytes, "
                                  f"expected {size} (truncated?)")
    return info


def _unverified(path: Path, info: dict[str, Any]) -> str | None:
    """Why (part of) ``path`` cannot be verified, or None when every file has a checksum."""
    if info["format_version"] < 2:
        return f"it is format {info['format_version']}, written before checkpoints carried checksums"
    sums = info.get("sha256")
    if not isinstance(sums, dict) or not sums:
        return f"its {MARKER} has no sha256 checksums (format {info['format_version']} always records them)"
    unlisted = [n for n in _files(path) if n not in sums] + sorted(set(info["files"]) - set(sums))
    if unlisted:
        return f"its {MARKER} has no checksum for {sorted(set(unlisted))}"
    return None


def load_plain(file: Path, checkpoint: Path) -> Any:
    """``torch.load(file, weights_only=True)`` of a checkpoint's file (``extra.pt``, ``rng/rank_<r>.pt``); what it
    refuses (a pickled global, a damaged file) is a :class:`CheckpointError` naming the file and the refused
    global, without torch's advice to load it unsafely."""
    try:
        return torch.load(file, weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - name the file and the cause
        advice = ("weights_only", "Weights only load failed", "Please file an issue", "Check the documentation")
        lines = [line.strip() for line in str(e).replace("WeightsUnpickler error:", "\n").splitlines()
                 if line.strip() and not any(a in line for a in advice)]  # torch's advice to load it unsafely
        reason = lines[0].split(" was not an allowed global")[0] if lines else type(e).__name__
        raise CheckpointError(f"checkpoint {str(checkpoint)!r}: {file.relative_to(checkpoint)} cannot be read safely "
                              f"(weights_only=True; nothing in it ran): {reason}") from None


def loadable_bytes(extra: dict[str, Any], final: Path) -> bytes:
    """``extra`` serialized as ``extra.pt``, checked to load back under ``torch.load(weights_only=True)`` (how
    every load reads it); a value that would not (a callback's ``timedelta`` or ``Path`` state, a lambda) is
    refused, naming where it is, rather than saved into a checkpoint no load could read."""
    try:
        buffer = io.BytesIO()
        torch.save(extra, buffer)
        torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
        return buffer.getvalue()
    except Exception:  # noqa: BLE001 (pickling and unpickling raise many kinds): found and named below
        bad = _unloadable(extra, "")
    raise CheckpointError(
        f"refusing to save {str(final)!r}: torch.load(weights_only=True), which reads every checkpoint, could not "
        f"read back {'; '.join(bad[:5])}. Make that state plain data (str, int, float, bool, None, lists, dicts, "
        f"tensors), e.g. a callback's state_dict returning str(path) or seconds as a float")


def _unloadable(value: Any, where: str) -> list[str]:
    """Where in ``value`` something does not survive ``torch.save`` + ``torch.load(weights_only=True)``:
    ``"callbacks['Clock'] (a timedelta: ...)"``, down to the innermost dict entry or list item that fails."""
    try:
        buffer = io.BytesIO()
        torch.save(value, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
        return []
    except Exception as e:  # noqa: BLE001 (pickling and unpickling raise many kinds)
        reason = e
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    inner = [bad for k, v in items for bad in _unloadable(v, f"{where}[{k!r}]" if where else str(k))]
    if inner:
        return inner
    if isinstance(reason, pickle.UnpicklingError):  # torch's message is advice to load unsafely: not ours to give
        why = "not a type weights_only loads"
    else:
        why = str(reason).strip().splitlines()[0][:160] if str(reason).strip() else type(reason).__name__
    return [f"{where or 'the checkpoint'} (a {type(value).__name__}: {why})"]


def verify_checkpoint(path: str | os.PathLike, *, collective: bool = False) -> dict[str, Any]:
    """THE check of every path that reads a lightning_megatron checkpoint (``--ckpt_path`` of
    fit/validate/test/predict, ``init_from``, ``export hf``, ``load_from_checkpoint``); returns the marker.

    Checks the marker, every file's size and sha256 (a mismatch is always refused), and that the DCP
    metadata (unpickled with an allow-list) names only checksummed files. A checkpoint without
    checksums (format 1, or a marker whose checksums are missing) is refused unless the user opted in
    (:data:`ALLOW_UNVERIFIED_ENV` / ``--allow-unverified-checkpoint``); then a warning says what was
    not verified. ``collective``: every rank of the process group calls it and hashes a share of the
    files; otherwise this process hashes them all.
    """
    path = Path(path)
    info = read_marker(path)
    rank, world = _rank_world() if collective else (0, 1)
    reason = _unverified(path, info)
    if reason is not None:
        if not allow_unverified():
            raise CheckpointError(
                f"checkpoint {str(path)!r} cannot be verified: {reason}. A corrupted or altered file would load "
                f"without a word. If you trust it, load it with --allow-unverified-checkpoint (or "
                f"{ALLOW_UNVERIFIED_ENV}=1); saving it again writes checksums")
        if rank == 0:
            warnings.warn(f"checkpoint {str(path)!r} is loaded UNVERIFIED: {reason} ({ALLOW_UNVERIFIED_ENV} / "
                          f"--allow-unverified-checkpoint is set)", UserWarning, stacklevel=2)
    sums = info.get("sha256") if isinstance(info.get("sha256"), dict) else {}
    error = None
    for name in sorted(sums)[rank::world]:
        f = path / name
        try:  # a read error (EIO, a stale NFS handle) on this rank's share reaches _agree: the others wait there
            if Path(name).is_absolute() or ".." in Path(name).parts or not f.is_file():
                error = f"checkpoint {str(path)!r}: {MARKER} has a checksum for {name!r}, which is not a file in it"
            elif file_sha256(f) != sums[name]:
                error = (f"checkpoint {str(path)!r} is corrupt: {name} does not match the sha256 recorded "
                         f"in {MARKER} (the file changed after it was saved)")
        except OSError as e:
            error = f"checkpoint {str(path)!r}: reading {name} failed on this rank: {e}"
        if error:
            break
    if error is None:
        try:
            metadata = dcp_io.read_metadata(path)
            if reason is None:
                unknown = sorted({s.relative_path for s in metadata.storage_data.values()} - set(sums))
                if unknown:
                    error = f"checkpoint {str(path)!r}: .metadata refers to files without checksums: {unknown}"
        except CheckpointError as e:
            error = f"checkpoint {str(path)!r}: {e}"
    if collective:
        _agree(error)
    elif error:
        raise CheckpointError(error)
    return info


def newer_than_last(last: str | os.PathLike) -> Path | None:
    """For ``ckpt_path="last"`` resolved to ``last``: the complete checkpoint of its run at a later step, written
    after it, in its folder (newest step first), with a warning; None when there is none. A launcher killed, or
    Ctrl-C pressed twice, during the ``last`` save that follows a step checkpoint leaves ``last.ckpt`` a save interval
    behind. Passed over: one written *before* ``last`` (the branch a run leaves when it resumes from an earlier
    checkpoint), another run's, one that holds less training state than ``last`` (a ``save_weights_only``
    callback's: no optimizer or schedule to resume), and one that does not verify."""
    last = Path(last)
    run, step = checkpoint_identity(last)
    try:
        written = (last / MARKER).stat().st_mtime
    except OSError:
        return None
    if run is None or step is None:
        return None
    later = []
    for path in last.parent.iterdir():
        if path == last or not (path.suffix == ".ckpt" or ".ckpt" + TMP_INFIX in path.name):
            continue
        other_run, other_step = checkpoint_identity(path)
        try:
            newer = path.is_dir() and (path / MARKER).stat().st_mtime > written
        except OSError:  # a temporary renamed meanwhile (a save in progress)
            continue
        if newer and other_run == run and other_step is not None and other_step > step:
            later.append((other_step, path))
    wanted = _training_state(last)
    for other_step, path in sorted(later, key=lambda p: -p[0]):
        try:
            verify_checkpoint(path)  # (a recovery's one-off cost: passed over when damaged, last.ckpt resumed)
        except (CheckpointError, OSError):
            continue
        if not wanted <= _training_state(path):
            continue
        warnings.warn(f"ckpt_path='last': {str(last)!r} is step {step}, and this run's complete checkpoint "
                      f"{str(path)!r} (step {other_step}) was written after it: its last save was interrupted; "
                      f"resuming from step {other_step}", UserWarning, stacklevel=2)
        return path
    return None


def _training_state(path: Path) -> set[str]:
    """What of a run's training state a checkpoint's ``extra.pt`` holds (optimizers, schedules, loops)."""
    try:
        extra = load_plain(path / "extra.pt", path)
    except (CheckpointError, OSError):  # unreadable: holds nothing that can be resumed
        return set()
    keys = ("megatron_optimizers", "optimizer_states", "lr_schedulers", "loops", "callbacks")
    return {k for k in keys if isinstance(extra, dict) and extra.get(k)}


validate_checkpoint_dir = verify_checkpoint
"""The former name of :func:`verify_checkpoint` (the same function: a call verifies everything)."""


def recover_last(dirpath: str | os.PathLike, name: str = "last") -> Path | None:
    """For ``ckpt_path="last"``: ``None`` when ``<dirpath>/<name>*.ckpt`` exists (or nothing was ever
    saved there), else, with a warning, the newest checkpoint there that verifies:

    - an interrupted save ``<name>.ckpt.tmp-<id>`` (a crash between the two renames of a file system without
      ``RENAME_EXCHANGE`` leaves the complete new checkpoint there and no ``<name>.ckpt``), newest first;
    - else the run's newest step checkpoint (``epoch=0-step=200.ckpt``: the ``last`` save failed, on a full
      disk, or the job was killed between Lightning's step save and its ``last`` save), by the step its marker
      records; the step checkpoints of several runs there are a :class:`CheckpointError` naming them.

    None verifying is a :class:`CheckpointError` listing why: resuming from step 0 instead would be silent."""
    d = Path(dirpath)
    if not d.is_dir():
        return None
    entries = list(d.iterdir())
    if any(p.name.startswith(name) and p.suffix == ".ckpt" for p in entries):
        return None
    temps = [p for p in entries if p.is_dir() and p.name.startswith(f"{name}.ckpt{TMP_INFIX}")]
    saved = [p for p in entries if p.is_dir() and p.suffix == ".ckpt"]
    if not temps and not saved:
        return None

    def newest_first(p: Path) -> tuple[bool, float]:
        marker = p / MARKER
        return (p.name.endswith(f"{TMP_INFIX}old"), -(marker.stat().st_mtime if marker.is_file() else 0.0))

    reasons = []
    for temp in sorted(temps, key=newest_first):
        try:
            verify_checkpoint(temp)
        except CheckpointError as e:
            reasons.append(str(e))
            continue
        warnings.warn(f"ckpt_path='last': {str(d / (name + '.ckpt'))!r} is missing, but the interrupted save "
                      f"{str(temp)!r} is complete and its checksums verify: resuming from it", UserWarning,
                      stacklevel=2)
        return temp
    identities = {p: checkpoint_identity(p) for p in saved}
    runs = sorted({run for run, _ in identities.values()}, key=str)
    if len(runs) > 1:
        raise CheckpointError(
            f"ckpt_path='last': {str(d / (name + '.ckpt'))!r} is missing and {str(d)!r} holds the checkpoints of "
            f"{len(runs)} runs ({', '.join(f'{p.name}: run {run}' for p, (run, _) in sorted(identities.items()))}): "
            f"pass --ckpt_path to the one to continue")
    for path in sorted(saved, key=lambda p: (-(identities[p][1] or -1), *newest_first(p))):
        try:
            verify_checkpoint(path)
        except CheckpointError as e:
            reasons.append(str(e))
            continue
        step = identities[path][1]
        warnings.warn(f"ckpt_path='last': {str(d / (name + '.ckpt'))!r} is missing (its save failed or was "
                      f"interrupted): resuming from this run's newest complete checkpoint {str(path)!r}"
                      f"{f' (step {step})' if step is not None else ''}", UserWarning, stacklevel=2)
        return path
    raise CheckpointError(
        f"ckpt_path='last': {str(d / (name + '.ckpt'))!r} is missing and no checkpoint there can be used "
        f"({'; '.join(reasons)}); refusing to start again from step 0. Pass --ckpt_path to a complete "
        f"checkpoint, or remove {[p.name for p in temps + saved]} to start anew")


def checkpoint_identity(path: str | os.PathLike) -> tuple[str | None, int | None]:
    """``(run id, global_step)`` of the checkpoint directory ``path``, each None when unknown.

    The run id is the ``run_id`` its marker records (the W&B run id when the run logged to W&B, else a
    random one: ``MegatronStrategy.run_id``); a checkpoint written before markers recorded it has the
    W&B run id in its ``extra.pt`` (read with ``weights_only=True``), or none. Nothing is verified here:
    it names a checkpoint in a message or decides whether a save may replace it, never what is loaded.
    """
    path = Path(path)
    try:
        info = json.loads((path / MARKER).read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        info = None
    info = info if isinstance(info, dict) else {}
    run_id, step = info.get("run_id"), info.get("global_step")
    if not isinstance(run_id, str) or not isinstance(step, int):
        try:
            extra = torch.load(path / "extra.pt", weights_only=True, map_location="cpu", mmap=True)
        except Exception:  # noqa: BLE001 - not a readable checkpoint: nothing known about it
            extra = None
        if isinstance(extra, dict):
            run_id = run_id if isinstance(run_id, str) else extra.get("wandb_run_id")
            step = step if isinstance(step, int) else extra.get("global_step")
    return (run_id if isinstance(run_id, str) else None), (step if isinstance(step, int) else None)
