"""Sharded, reshardable, verified checkpoints on ``torch.distributed.checkpoint`` (DCP).

A checkpoint is a directory (format 2; format 1, written before checksums, loads only when the user
opts in to unverified checkpoints):

    <path>/                    appears (or replaces the previous one) in one atomic rename
      .metadata, __*.distcp    DCP: every tensor as chunks of a GLOBAL tensor (model and optimizer)
      extra.pt                 Lightning's non-tensor state (loops, callbacks, schedulers, ...),
                               written by rank 0, loaded with ``torch.load(weights_only=True)``
      rng/rank_<r>.pt          RNG states of each rank (restored when the layout is unchanged)
      lightning_megatron.json  format version, the layout it was saved at, the size and sha256 of
                               every other file, the run id and global step; written last

Tensors are described by :mod:`lightning_megatron.sharded_state` as chunks of global tensors, so
DCP loads them into any TP / PP / DP layout and into either optimizer (see docs/checkpoints.md).

Saving (:func:`save`): every rank writes into ``<path>.tmp-<id>`` (stale temporaries of earlier
interrupted saves are removed first), hashes the files it wrote, and rank 0 writes the marker and
swaps the directory in with ``renameat2(RENAME_EXCHANGE)``: ``<path>`` never disappears. A failed
write (a full disk) is a ``CheckpointError`` on every rank naming the directory and its free space.
A save never replaces a checkpoint of another run: ``<path>`` holding a checkpoint whose run id
(:func:`~lightning_megatron.checkpoint_verify.checkpoint_identity`) differs from the saving run's is a
``CheckpointError`` before anything is written.

Verifying (:func:`verify_checkpoint`, in :mod:`lightning_megatron.checkpoint_verify`, the one check
of EVERY path that reads a checkpoint: ``--ckpt_path``, ``init_from``, ``export hf``,
``load_from_checkpoint``): before any tensor is read, the marker and file sizes are checked, every
file's checksum is verified, and the DCP metadata is unpickled with an allow-list
(:mod:`lightning_megatron.dcp_io`). A checkpoint without checksums (format 1, or a marker whose
checksums were removed) is refused unless the user opts in (:data:`ALLOW_UNVERIFIED_ENV`).

Loading (:func:`load`): verified with the files split over the ranks, then the saved hyper-parameters
and global tensor shapes are compared with the model's: every difference is listed in one ``CheckpointError``.
"""

from __future__ import annotations

import errno
import inspect
import json
import os
import shutil
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lightning_megatron import dcp_io
from lightning_megatron.atomic_files import finalize_directory, fsync_dir, remove_path
from lightning_megatron.checkpoint_verify import (  # the one verification of every load path, and its names
    ALLOW_UNVERIFIED_ENV,
    FORMAT_VERSION,
    MARKER,
    READABLE_FORMATS,
    TMP_INFIX,
    _agree,
    _files,  # noqa: F401 - re-exported (tests list a directory's files with it)
    _gather,
    _rank_world,
    allow_unverified,
    checkpoint_identity,
    file_sha256,
    load_plain,
    loadable_bytes,
    read_marker,
    newer_than_last,
    recover_last,
    validate_checkpoint_dir,
    verify_checkpoint,
)
from lightning_megatron.communicator import peer_lost
from lightning_megatron.dcp_io import CheckpointError, Chunks
from lightning_megatron.parallel_dims import ParallelDims
from lightning_megatron.sharded_state import (ShardedStateMapper, optimizer_class_name, optimizer_class_problem,
                                              optimizer_extra, plain, rng_state, set_rng_state)

__all__ = [
    "CheckpointError",
    "FORMAT_VERSION",
    "CONFIG_HPARAM",
    "HPARAMS_MAY_DIFFER",
    "HPARAMS_UNUSED_ON_LOAD",
    "MARKER",
    "READABLE_FORMATS",
    "check_shared_storage",
    "compare_hparams",
    "does_not_fit",
    "file_sha256",
    "hparam_problems",
    "init_defaults",
    "ALLOW_UNVERIFIED_ENV",
    "allow_unverified",
    "checkpoint_identity",
    "load",
    "newer_than_last",
    "recover_last",
    "remove",
    "save",
    "save_temporary",
    "saved_extra",
    "validate_checkpoint_dir",
    "verify_checkpoint",
]


CONFIG_HPARAM = "config"
"""The hyper-parameter a module's configuration record is saved under, as a plain dict of its fields
(``BertLightningModule(config=BertConfig(...))``: ``hyper_parameters["config"] = {"num_layers": ...}``)."""

HPARAMS_MAY_DIFFER = frozenset({
    "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",  # a layout, as TP / PP
    "defer_embedding_wgrad_compute", "wgrad_deferral_limit",  # when the same weight gradient is computed
    "lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "sgd_momentum", "fused_optimizer",
    "hidden_dropout", "attention_dropout", "dropout",  # "dropout": the LoRA record's (RECORDS_BY_FIELD)
    "recompute_granularity", "recompute_method", "recompute_num_layers",
    "attention_backend", "lm_head_on_masked_only", "init_seed", "init_method_std", "params_dtype",
    "make_vocab_size_divisible_by", "compile", "optimizer_kwargs", "calculate_per_token_loss",
    "tensor_model_parallel_size", "sequence_parallel",  # a config record's layout fields: the strategy's
    "cp_comm_type", "moe_token_dispatcher_type",  # how context parallelism and the experts' tokens communicate
})
"""Hyper-parameters that do not change what the saved tensors mean: a difference is a warning, any
other differing hyper-parameter is an error. (Optimizer hyper-parameters are restored from the
checkpoint's optimizer state; the others take the current value.) A field of a config record saved as a
dict (``config.hidden_dropout``) is named by its own name here."""

RECORDS_BY_FIELD = ("lora",)
"""Hyper-parameters saved as a dict that :func:`compare_hparams` compares field by field when both sides have one
(``lora.rank`` an error, ``lora.dropout`` allowed); one side without it (a LoRA checkpoint, a model without
adapters) differs as a whole."""

HPARAMS_UNUSED_ON_LOAD = frozenset({
    "init_from",  # where the weights first came from
    "predict_output", "predict_top_k",  # what `predict` writes, and a decoder's generation
    "predict_max_new_tokens", "predict_greedy", "predict_temperature", "predict_top_p", "predict_stop_at_eod",
    "predict_stop_strings", "predict_seed",
})
"""Hyper-parameters that are not the weights' and not the training's: where a model's weights first came from (a
loaded checkpoint's replace them) and what ``predict`` does with them (the command's own options). :func:`compare_hparams`
does not report them: a fine-tuned run predicted without its ``--model.init_from``, or sampled from with
``--model.predict_greedy false``, says nothing of it."""


def save_temporary(final: Path, run_id: str | None) -> Path:
    """Where a save of ``final`` writes before it is complete: ``<final>.tmp-<run>.<random>`` (the saving run's
    first 8 characters), ``<final>.tmp-<random>`` without a run id."""
    tag = f"{run_id[:8]}." if run_id else ""
    return final.parent / f"{final.name}{TMP_INFIX}{tag}{uuid.uuid4().hex[:8]}"


def _clean_stale_temporaries(final: Path, run_id: str | None = None) -> None:
    """Remove ``<final>.tmp-*`` left by earlier interrupted saves of this path: this run's and those naming no
    run; another run's (two runs started into one folder at once) is its save in progress, left alone."""
    if final.parent.is_dir():
        for p in final.parent.iterdir():
            if p.name.startswith(final.name + TMP_INFIX):
                rest = p.name[len(final.name + TMP_INFIX):]
                owner = rest.split(".", 1)[0] if "." in rest else None
                if owner is None or run_id is None or owner == run_id[:8]:
                    remove_path(p)


def _write_error(e: BaseException, final: Path, directory: Path) -> str:
    """One line for a failed write; names the directory and the free space (another rank's death: said so)."""
    try:
        free = shutil.disk_usage(directory if directory.exists() else directory.parent).free
    except OSError:
        free = -1
    lost = peer_lost(e)
    if lost is not None:
        return (f"saving checkpoint {str(final)!r} failed: another rank died or stopped answering during the save "
                f"({lost}); the disk is not the cause ({free / 2**30:.2f} GiB free in {str(directory)!r})")
    full = _is_disk_full(e) or 0 <= free < (1 << 20)
    what = "the disk is full" if full else "a write failed"
    return (f"saving checkpoint {str(final)!r} failed: {what} in {str(directory)!r} "
            f"({free / 2**30:.2f} GiB free there): {str(e).splitlines()[0] if str(e) else type(e).__name__}")


def _is_disk_full(e: BaseException | None, depth: int = 0) -> bool:
    if e is None or depth > 8:
        return False
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    if "No space left" in str(e):
        return True
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict):
        for err in failures.values():
            if _is_disk_full(err[0] if isinstance(err, tuple) else err, depth + 1):
                return True
    return _is_disk_full(e.__cause__ or e.__context__, depth + 1)


# ---------------------------------------------------------------------- save


def other_run_problem(final: Path, run_id: str | None) -> str | None:
    """Why saving run ``run_id`` at ``final`` would replace another run's checkpoint, or something that is not a
    checkpoint (a file, a folder without our marker: it was swapped out and deleted); None when it would not
    (nothing there, an empty folder, the same run, or a run id unknown on either side)."""
    if (final.exists() or final.is_symlink()) and not (final / MARKER).is_file() and not (
            final.is_dir() and not final.is_symlink() and not any(final.iterdir())):
        what = "a file" if final.is_file() else "a link" if final.is_symlink() else "a folder that is no checkpoint"
        return (f"refusing to save {str(final)!r}: it is {what} (no {MARKER} in it), which a save would replace and "
                f"delete; move it away, or save the checkpoint under another name")
    if run_id is None or not final.is_dir():
        return None
    owner, step = checkpoint_identity(final)
    if owner is None or owner == run_id:
        return None
    at = "" if step is None else f" at step {step}"
    return (f"refusing to save {str(final)!r}: it holds the checkpoint of another run (run {owner}{at}) and this "
            f"run is {run_id}; a save never replaces another run's checkpoint. Keep one run's checkpoints per folder "
            f"(a new --trainer.default_root_dir for a new run), or resume run {owner} from that checkpoint")


def save(mapper: ShardedStateMapper, checkpoint: dict[str, Any], filepath: str | os.PathLike,
         layout: dict[str, int | None], run_id: str | None = None) -> None:
    """Collective: write ``checkpoint`` (Lightning's dict; model and optimizer state come from
    ``mapper``) as a sharded checkpoint directory at ``filepath``, recording ``run_id`` (the saving
    run: a checkpoint of another run at ``filepath`` is never replaced, see :func:`other_run_problem`)."""
    rank, _ = _rank_world()
    final = Path(filepath)
    tmp, error = None, None
    if rank == 0:
        tmp = save_temporary(final, run_id)
        error = other_run_problem(final, run_id)
        try:
            if error is None:
                final.parent.mkdir(parents=True, exist_ok=True)
                _clean_stale_temporaries(final, run_id)
                (tmp / "rng").mkdir(parents=True)
        except OSError as e:
            error = _write_error(e, final, final.parent)
    tmp, error = _gather((tmp, error))[0]
    _agree(error)
    try:
        _write(mapper, checkpoint, final, tmp, layout, run_id)
    except CheckpointError:
        if rank == 0:
            remove_path(tmp)
        raise


def _write(mapper: ShardedStateMapper, checkpoint: dict[str, Any], final: Path, tmp: Path,
           layout: dict[str, int | None], run_id: str | None) -> None:
    rank, _ = _rank_world()
    error = None
    include_optimizer = "optimizer_states" in checkpoint
    written: dict[str, str] = {}
    try:
        dcp_io.save(mapper.save_state(include_optimizer), tmp)
    except CheckpointError as e:
        raise CheckpointError(_write_error(e, final, tmp)) from e
    try:
        torch.save(rng_state(), tmp / "rng" / f"rank_{rank}.pt")
        mine = [f"rng/rank_{rank}.pt"] + sorted(p.name for p in tmp.glob(f"__{rank}_*.distcp"))
        if rank == 0:
            extra = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
            if include_optimizer:
                extra["megatron_optimizers"] = [optimizer_extra(opt) for opt in mapper.optimizers]
            records = ("hyper_parameters", "datamodule_hyper_parameters")
            extra.update({k: plain(extra[k]) for k in records if k in extra})
            (tmp / "extra.pt").write_bytes(loadable_bytes(extra, final))
            mine += [".metadata", "extra.pt"]
        written = {name: file_sha256(tmp / name, sync=True) for name in mine}
    except CheckpointError as e:
        error = str(e)
    except Exception as e:  # any failure reaches the gather below: the other ranks wait there
        error = _write_error(e, final, tmp)
    gathered = _gather((written, error))
    _agree(next((err for _, err in gathered if err), None))
    if rank == 0:
        try:
            sums = {k: v for w, _ in gathered for k, v in w.items()}
            files = {name: (tmp / name).stat().st_size for name in sums}
            marker = {"format_version": FORMAT_VERSION, "layout": layout, "files": files, "sha256": sums}
            if run_id is not None:
                marker["run_id"] = run_id
            if isinstance(checkpoint.get("global_step"), int):
                marker["global_step"] = checkpoint["global_step"]
            with open(tmp / (MARKER + ".tmp"), "w") as f:
                f.write(json.dumps(marker, indent=1, sort_keys=True))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp / (MARKER + ".tmp"), tmp / MARKER)
            fsync_dir(tmp)
            error = other_run_problem(final, run_id)  # again: another run may have saved there meanwhile
            if error is None:
                finalize_directory(tmp, final)
            else:
                remove_path(tmp)
        except OSError as e:
            error = _write_error(e, final, tmp)
    _agree(error)


def check_shared_storage(folders: list[str | os.PathLike | None], nodes: list[int] | None) -> None:
    """Collective, where the ranks span nodes (``nodes``: the node of each rank, None: unknown): every rank must see
    a file rank 0 writes into each local checkpoint folder, as rank 0 names it (the path :func:`save` has every rank
    write into). A folder on a node's own disk (its ``/tmp``, a local NVMe) would hold that node's shards only: the
    run trained to its first save and died there. Raises :class:`CheckpointError` on every rank, naming the folder,
    the nodes that cannot see it and the fix."""
    if nodes is None or len(set(nodes)) < 2:
        return
    rank, _ = _rank_world()
    probes: list[tuple[str, str]] = []
    token, error = uuid.uuid4().hex, None  # rank 0's is the one written and read
    if rank == 0:
        for folder in dict.fromkeys(os.fspath(f) for f in folders if f and "://" not in os.fspath(f)):
            probe = Path(folder) / f".shared-{token}"
            try:
                probe.parent.mkdir(parents=True, exist_ok=True)
                with open(probe, "w") as f:
                    f.write(token)
                    f.flush()
                    os.fsync(f.fileno())
            except OSError as e:
                error = _write_error(e, Path(folder), Path(folder))
                break
            probes.append((folder, str(probe)))
    token, probes, error = _gather((token, probes, error))[0]
    _agree(error)

    def sees(probe: str) -> bool:
        try:
            return Path(probe).read_text() == token
        except OSError:
            return False

    unseen = _gather([folder for folder, probe in probes if not sees(probe)])
    if rank == 0:
        for _, probe in probes:
            Path(probe).unlink(missing_ok=True)
    for folder, _ in probes:
        ranks = [r for r, folders in enumerate(unseen) if folder in folders]
        if ranks:
            blind = ", ".join(f"node {n} (ranks {[r for r in ranks if nodes[r] == n]})"
                              for n in sorted({nodes[r] for r in ranks}))
            raise CheckpointError(
                f"the checkpoint folder {folder!r} is not shared by every node: {blind} cannot see a file rank 0 "
                f"wrote there, so each node would keep only its own shards of every checkpoint and the first save "
                f"would fail after the steps before it. Put trainer.default_root_dir (or ModelCheckpoint's dirpath) "
                f"on a filesystem every node mounts at the same path")


def remove(filepath: str | os.PathLike) -> None:
    """Delete a checkpoint directory (rank 0's job; ModelCheckpoint's top-k rotation)."""
    remove_path(Path(filepath))


# ---------------------------------------------------------------------- load


def init_defaults(module_class: type) -> dict[str, Any]:
    """The keyword defaults of ``module_class.__init__`` and of the ``__init__`` s it passes its
    ``**kwargs`` to (its bases'; the class's own win): the value of a hyper-parameter that a checkpoint
    predates (see :func:`compare_hparams`)."""
    defaults: dict[str, Any] = {}
    for klass in reversed(module_class.__mro__):
        if "__init__" in vars(klass):
            defaults.update({name: p.default for name, p in inspect.signature(klass.__init__).parameters.items()
                             if p.default is not inspect.Parameter.empty})
    return defaults


def _fields(hparams: dict[str, Any]) -> dict[str, Any]:
    """A config record saved as a dict compared field by field: ``{"config": {"num_layers": 2}}`` ->
    ``{"config.num_layers": 2}``."""
    out = {}
    for key, value in hparams.items():
        if key == CONFIG_HPARAM and isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            out[key] = value
    return out


def compare_hparams(saved: dict[str, Any] | None, current: dict[str, Any] | None,
                    defaults: dict[str, Any] | None = None, *,
                    free: frozenset[str] = frozenset()) -> tuple[list[str], list[str]]:
    """(errors, allowed differences): one ``"name: checkpoint X, model Y"`` per differing field
    (a config record's fields as ``config.<field>``).

    A field the checkpoint does not record (written before the field existed) counts as its default
    in ``defaults`` (the module's ``__init__`` defaults): the model it saved behaved that way. ``free``: the
    names that size no weight of either model (``MegatronLightningModule.free_arguments``), allowed as
    :data:`HPARAMS_MAY_DIFFER`."""
    saved, current = _fields(plain(dict(saved or {}))), _fields(plain(dict(current or {})))
    defaults = _fields(plain(dict(defaults or {})))
    for key in RECORDS_BY_FIELD:  # a record on both sides: field by field (an adapter's dropout may differ)
        if isinstance(saved.get(key), dict) and isinstance(current.get(key), dict):
            saved.update({f"{key}.{k}": v for k, v in saved.pop(key).items()})
            current.update({f"{key}.{k}": v for k, v in current.pop(key).items()})
    errors, allowed = [], []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key, defaults.get(key, "<absent>")), current.get(key, "<absent>")
        name = key.rpartition(".")[2]
        if a != b and name not in HPARAMS_UNUSED_ON_LOAD:
            may_differ = name in HPARAMS_MAY_DIFFER or name in free
            (allowed if may_differ else errors).append(f"{key}: checkpoint {a!r}, model {b!r}")
    return errors, allowed


def _shape_errors(state: dict[str, Any], metadata: Any) -> list[str]:
    out = []
    for key, obj in state.items():
        md = metadata.get(key)
        shape = obj.global_shape if isinstance(obj, Chunks) else tuple(obj.shape)
        if md is None:
            out.append(f"{key}: missing from the checkpoint, model shape {tuple(shape)}")
        elif tuple(md.size) != tuple(shape):
            out.append(f"{key}: checkpoint shape {tuple(md.size)}, model shape {tuple(shape)}")
    return out


def _same_ranks(saved: dict[str, Any], current: dict[str, Any]) -> bool:
    """Whether every global rank has the same coordinates in both layouts (the RNG states of the ranks
    then carry over); a record older than a dimension has it at its default."""
    try:
        a, b = ParallelDims.from_record(saved), ParallelDims.from_record(current)
        sizes = (a.sizes(), b.sizes())
    except (TypeError, ValueError):
        return False
    return sizes[0] == sizes[1]


def _optimizer_class_errors(mapper: ShardedStateMapper, saved: list[dict[str, Any]], path: Path) -> list[str]:
    """One error per optimizer whose class is not the one the checkpoint's state was written by."""
    return [problem for opt, record in zip(mapper.optimizers, saved)
            if (problem := optimizer_class_problem(record, optimizer_class_name(opt.optimizer), str(path)))]


def hparam_problems(saved: dict[str, Any], hparams: dict[str, Any] | None, *,
                    hparam_defaults: dict[str, Any] | None = None,
                    upgrade_hparams: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
                    free_arguments: Callable[[dict[str, Any]], frozenset[str]] | None = None
                    ) -> tuple[list[str], list[str]]:
    """(errors, allowed differences) of a checkpoint's saved hyper-parameters against a model's: :func:`compare_hparams`
    after ``upgrade_hparams``, the names free in both (``free_arguments``) allowed. The keywords are :func:`load`'s
    (``module.checkpoint_rules`` gives a module's)."""
    if upgrade_hparams is not None:
        saved = upgrade_hparams(saved)
    free = (free_arguments(saved) & free_arguments(dict(hparams or {}))) if free_arguments else frozenset()
    return compare_hparams(saved, hparams, hparam_defaults, free=free)


def does_not_fit(path: str | os.PathLike, layout: Any, problems: list[str]) -> CheckpointError:
    """The error of a checkpoint whose tensors or hyper-parameters are not the model's, naming the first ten
    ``problems`` and the fix."""
    more = f"; and {len(problems) - 10} more" if len(problems) > 10 else ""
    fix = "" if all("optimizer class" in p for p in problems) else (
        ". Build the model with the checkpoint's values (the first of each pair) to load it")
    run = Path(path).parent.parent  # the configuration the CLI saved in the run's log folder (or the run's folder)
    saved = [p for p in (run / "config.yaml", *run.glob("csv/version_*/config.yaml")) if p.is_file()]
    if fix and saved:
        fix += f", e.g. with the run's own configuration: --config {max(saved, key=lambda p: p.stat().st_mtime)}"
    return CheckpointError(f"checkpoint {str(path)!r} does not fit this model (saved at layout {layout}): "
                           + "; ".join(problems[:10]) + more + fix)


def saved_extra(filepath: str | os.PathLike) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """``(extra.pt, the marker)`` of a checkpoint directory, for checks before any process starts (the CLI's):
    the marker and the file sizes checked, ``extra.pt``'s sha256 matched with the marker's and the file read with
    ``weights_only=True``; the tensors neither hashed nor read (:func:`load` verifies everything, on every rank).
    None where ``extra.pt`` has no checksum and the user did not opt in to unverified checkpoints (:func:`load`
    refuses it, saying why). A corrupt or unsafe file is a :class:`CheckpointError`."""
    path = Path(filepath)
    info = read_marker(path)
    want = info["sha256"].get("extra.pt") if isinstance(info.get("sha256"), dict) else None
    if want is None and not allow_unverified():
        return None
    if want is not None and file_sha256(path / "extra.pt") != want:
        raise CheckpointError(f"checkpoint {str(path)!r} is corrupt: extra.pt does not match the sha256 recorded "
                              f"in {MARKER} (the file changed after it was saved)")
    extra = load_plain(path / "extra.pt", path)
    if not isinstance(extra, dict):
        raise CheckpointError(f"checkpoint {str(path)!r}: extra.pt holds a {type(extra).__name__}, not a dict")
    return extra, info


def _same_checkpoint_everywhere(path: Path) -> None:
    """Collective: every rank loads the same run's same step. Each rank resolves ``--ckpt_path last`` from its own
    listing of the folder; a node whose network file system still showed an older one would load another step than
    the others, without a word. Raises :class:`CheckpointError` on every rank, naming what each rank was given."""
    seen = _gather((str(path), *checkpoint_identity(path)))
    if len({(run, step) for _, run, step in seen}) > 1:
        given = "; ".join(f"rank {r}: {p} (run {run}, step {step})" for r, (p, run, step) in enumerate(seen))
        raise CheckpointError(f"the ranks were given different checkpoints to load: {given}. A node that saw an older "
                              f"listing of the folder (a network file system's cache) resolved --ckpt_path last "
                              f"otherwise: pass the checkpoint's own path, the same on every node")


def load(mapper: ShardedStateMapper, filepath: str | os.PathLike, hparams: dict[str, Any] | None,
         layout: dict[str, int | None], load_optimizer: bool,
         hparam_defaults: dict[str, Any] | None = None,
         upgrade_hparams: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
         free_arguments: Callable[[dict[str, Any]], frozenset[str]] | None = None) -> dict[str, Any]:
    """Collective: verify ``filepath``, then load it into ``mapper``'s parameters and optimizers in
    place; returns Lightning's checkpoint dict (without tensors). ``hparam_defaults``: see
    :func:`compare_hparams`; ``upgrade_hparams``: the saved hyper-parameters in the module's current
    spelling (``MegatronLightningModule.upgrade_hparams``: a checkpoint written before its arguments moved);
    ``free_arguments``: the names that size no weight of a model with these hyper-parameters (a rope decoder's
    ``max_sequence_length``), allowed to differ where both models have them free."""
    rank, _ = _rank_world()
    path = Path(filepath)
    _same_checkpoint_everywhere(path)
    info = verify_checkpoint(path, collective=True)
    error = None
    try:
        metadata = dcp_io.read_metadata(path)
        extra = load_plain(path / "extra.pt", path)
        if not isinstance(extra, dict):
            error = f"checkpoint {str(path)!r}: extra.pt holds a {type(extra).__name__}, not a dict"
    except CheckpointError as e:
        error = str(e) if str(e).startswith("checkpoint ") else f"checkpoint {str(path)!r}: {e}"
    _agree(error)
    md = metadata.state_dict_metadata
    errors, allowed = hparam_problems(dict(extra.get("hyper_parameters") or {}), hparams,
                                      hparam_defaults=hparam_defaults, upgrade_hparams=upgrade_hparams,
                                      free_arguments=free_arguments)
    if load_optimizer:
        errors += _optimizer_class_errors(mapper, extra.get("megatron_optimizers") or [], path)
    state = mapper.save_state(include_optimizer=False)
    problems = errors + _shape_errors(state, md)
    everyone = _gather((problems, sorted(state)))
    problems = list(dict.fromkeys(p for ps, _ in everyone for p in ps))
    loaded = {k for _, keys in everyone for k in keys}
    problems += [f"{k}: in the checkpoint, not in the model" for k in sorted(md) if k.startswith("model.")
                 and k not in loaded]
    if problems:
        raise does_not_fit(path, info.get("layout"), problems)
    if allowed and rank == 0:
        warnings.warn(f"checkpoint {str(path)!r}: hyper-parameters differ (allowed): " + "; ".join(allowed))
    include_optimizer = load_optimizer and "megatron_optimizers" in extra
    state, targets = mapper.load_targets(md, include_optimizer)
    try:
        dcp_io.load(state, path)
    except CheckpointError as e:
        raise CheckpointError(f"checkpoint {str(path)!r} could not be loaded into this model "
                              f"(saved at layout {info.get('layout')}): {e}") from e
    if include_optimizer:
        mapper.finish_optimizer_load(targets, extra["megatron_optimizers"])
    mapper.sync_shared_embeddings()
    if include_optimizer:
        mapper.fill_mains_from_model(targets)
    if _same_ranks(info.get("layout") or {}, layout):  # the same on every rank: each restores its own, agreed
        rng_file, error = path / "rng" / f"rank_{rank}.pt", None
        if rng_file.is_file():
            try:
                set_rng_state(load_plain(rng_file, path))
            except CheckpointError as e:
                error = str(e)
            except Exception as e:  # noqa: BLE001 - state of another shape: one rank's, said on every rank
                error = f"checkpoint {str(path)!r}: {rng_file.relative_to(path)} is not RNG state ({e!r})"
        _agree(error)
    elif rank == 0 and include_optimizer:  # a fit: every rank's dropout and generator streams start from the
        # strategy's seed instead (an evaluation draws no dropout: nothing to say)
        saved = info.get("layout") or {}
        warnings.warn(f"checkpoint {str(path)!r} was saved at {_layout_words(saved)}; this run is "
                      f"{_layout_words(layout)}: the ranks' RNG states (dropout, torch's generator) are not restored "
                      f"(a state belongs to a rank of its layout) and start from the strategy's seed; the run goes on "
                      f"alike, not bit for bit as it would at its own layout", UserWarning, stacklevel=2)
    extra.setdefault("state_dict", {})
    return extra


def _layout_words(layout: dict[str, Any]) -> str:
    """``tp=2, pp=1, dp=2`` (and the other sizes above 1) of a marker's layout, for messages."""
    keys = ["tp", "pp", "dp"] + [k for k in ("vp", "cp", "ep") if (layout.get(k) or 1) > 1]
    return ", ".join(f"{k}={layout.get(k) if layout.get(k) is not None else 1}" for k in keys)
