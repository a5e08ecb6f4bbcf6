"""Checkpoint tensors through public ``torch.distributed.checkpoint`` (DCP) APIs, and safe reading.

State dicts saved and loaded here are flat ``{key: value}`` with two kinds of values:

- a plain ``torch.Tensor``: the whole global tensor, identical on every rank that holds it
  (replicated parameters, Adam's ``step``); DCP writes one copy;
- :class:`Chunks`: rectangular pieces of a global tensor of shape ``global_shape``, each a local
  tensor at ``offsets`` (TP shards, ZeRO-1 shards of optimizer state, several per rank allowed).

:class:`ChunkSavePlanner` / :class:`ChunkLoadPlanner` subclass DCP's public default planners and
emit one ``WriteItem`` / the ``ReadItem`` s of ``create_read_items_for_chunk_list`` per chunk, so
DCP reads only the saved chunks that overlap each destination chunk: resharding is DCP's own.
On disk this is the same as what ShardedTensor writes (``TensorStorageMetadata`` with chunk
offsets and sizes), so checkpoints of format 1 load unchanged.

Safety: DCP's ``.metadata`` is a pickle. :func:`read_metadata` unpickles it with
:class:`MetadataUnpickler`, which resolves only the classes in :data:`ALLOWED_GLOBALS`; anything
else (``os.system``, ``builtins.eval``, ...) raises before it can run. :class:`SafeFileSystemReader`
makes ``dcp.load`` use the same reader, and the metadata is refused if it has byte entries (DCP
loads those with ``torch.load(weights_only=False)``), stream transforms or storage paths outside
the checkpoint directory. Tensor data is read by DCP with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import pickle
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.futures import Future

__all__ = [
    "ALLOWED_GLOBALS",
    "ChunkLoadPlanner",
    "ChunkSavePlanner",
    "Chunks",
    "CheckpointError",
    "MetadataUnpickler",
    "SafeFileSystemReader",
    "load",
    "model_metadata_problem",
    "read_metadata",
    "save",
    "saved_chunks_problem",
]

METADATA_FILE = ".metadata"

ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset({
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),  # refused after unpickling, by key
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.metadata", "StorageMeta"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    # megatron-core's torch_dist keeps its save plans in ``planner_data`` (inert dataclasses / an enum)
    ("torch.distributed.checkpoint.planner", "SavePlan"),
    ("torch.distributed.checkpoint.planner", "WriteItem"),
    ("torch.distributed.checkpoint.planner", "WriteItemType"),
    ("torch.distributed.checkpoint.planner", "TensorWriteData"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # str -> torch.layout, from a table of torch's layouts
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id: the directory it was written to
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
})
"""(module, name) pairs the metadata unpickler resolves; plus ``torch.<dtype>`` (e.g. ``torch.float32``)."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, partial, corrupt, unsafe or does not fit the model."""


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata: classes outside :data:`ALLOWED_GLOBALS` (and torch dtypes) are refused."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing to load global {module}.{name} (not a DCP metadata class)")


def _check_metadata(metadata: Any, path: Path, allow_bytes: bool = False) -> Metadata:
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path} is not DCP metadata (it holds a {type(metadata).__name__})")
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata) and allow_bytes:
            continue  # listed only: :func:`load` never reads a bytes entry (its state holds tensors)
        if isinstance(md, BytesStorageMetadata):
            raise CheckpointError(f"{path}: entry {key!r} is pickled bytes, which lightning_megatron never writes "
                           f"and does not load (DCP would unpickle it without restrictions)")
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointError(f"{path}: entry {key!r} has unknown storage type {type(md).__name__}")
    for index, info in (metadata.storage_data or {}).items():
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str) or Path(rel).name != rel or rel in ("", ".", ".."):
            raise CheckpointError(f"{path}: entry {getattr(index, 'fqn', index)!r} points outside the checkpoint "
                           f"directory ({rel!r})")
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{path}: entry {getattr(index, 'fqn', index)!r} uses stream transforms "
                           f"{info.transform_descriptors}, which lightning_megatron does not write")
    return metadata


def read_metadata(checkpoint_dir: str | Path, *, allow_bytes: bool = False) -> Metadata:
    """The DCP metadata of ``checkpoint_dir``, unpickled with :class:`MetadataUnpickler` and checked.

    ``allow_bytes``: accept (list, never read) pickled-bytes entries, as in other libraries'
    checkpoints (megatron-core's ``torch_dist``); ours never have them."""
    path = Path(checkpoint_dir) / METADATA_FILE
    try:
        with open(path, "rb") as f:
            metadata = MetadataUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError, IndexError,
            ImportError, KeyError) as e:
        raise CheckpointError(f"{path} cannot be loaded safely: {e}") from e
    return _check_metadata(metadata, path, allow_bytes)


class SafeFileSystemReader(dcp.FileSystemReader):
    """``dcp.FileSystemReader`` whose metadata goes through :func:`read_metadata`, and whose failure to read
    a tensor names the file, the entry and the cause (DCP's own says ``EOFError:`` or torch's advice to
    load with ``weights_only=False``, which is never the fix here)."""

    def __init__(self, path: str | Path, *, allow_bytes: bool = False) -> None:
        super().__init__(str(path))
        self.allow_bytes = allow_bytes

    def read_data(self, plan: LoadPlan, planner: Any) -> Future:
        """DCP's reading, one data file at a time; a failure is a :class:`CheckpointError` naming the file,
        the entry (found by reading that file's entries one by one, only then) and the cause."""
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in per_file.items():
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except CheckpointError:
                raise
            except Exception as e:  # noqa: BLE001 - torch.load's errors on bytes that are no tensor vary
                raise CheckpointError(self._unreadable(plan, planner, name, items, e)) from e
        done: Future = Future()
        done.set_result(None)
        return done

    def _unreadable(self, plan: LoadPlan, planner: Any, name: str, items: list[ReadItem], error: Exception) -> str:
        """One line: the file, the first entry that cannot be read as a tensor, and why (torch's reason,
        without its advice to turn ``weights_only`` off)."""
        path = Path(self.path)
        size = (path / name).stat().st_size if (path / name).is_file() else 0
        for item in items:
            info = self.storage_data[item.storage_index]
            if info.offset + info.length > size:
                where, error = f"its bytes {info.offset}..{info.offset + info.length} run past the file's {size}", None
                break
            try:
                super().read_data(dataclasses.replace(plan, items=[item]), planner).wait()
            except Exception as e:  # noqa: BLE001
                where, error = f"bytes {info.offset}..{info.offset + info.length}", e
                break
        else:
            item, where = items[0], "reading the file"
        skip = ("Weights only load failed", "Please file an issue", "Check the documentation")
        lines = [ln.strip() for ln in str(error or "").splitlines() if ln.strip() and not ln.strip().startswith(skip)]
        cause = "" if error is None else f": {type(error).__name__}{f': {lines[0]}' if lines else ''}"
        return (f"checkpoint {str(path)!r}: {name} does not hold the tensor entry {item.storage_index.fqn!r} its "
                f".metadata lists ({where}{cause}); nothing in it ran (tensors are read with "
                f"torch.load(weights_only=True)). The file was damaged or altered after it was saved (and its "
                f"checksum with it, where the checkpoint records one): use another checkpoint")

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointError("per-rank DCP metadata files are not part of the lightning_megatron format")
        metadata = read_metadata(Path(self.path), allow_bytes=self.allow_bytes)
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


@dataclass
class Chunks:
    """Rectangular pieces of one global tensor held by this rank: ``(offsets, local tensor)``."""

    global_shape: tuple[int, ...]
    pieces: list[tuple[tuple[int, ...], torch.Tensor]] = field(default_factory=list)

    def add(self, offsets: tuple[int, ...], tensor: torch.Tensor) -> None:
        if tensor.numel() == 0:
            return
        if len(offsets) != len(self.global_shape) or tensor.dim() != len(self.global_shape):
            raise ValueError(f"chunk of rank {tensor.dim()} at {offsets} in a tensor of shape {self.global_shape}")
        if any(o < 0 or o + s > g for o, s, g in zip(offsets, tensor.shape, self.global_shape)):
            raise ValueError(f"chunk {tuple(tensor.shape)} at {offsets} exceeds shape {self.global_shape}")
        self.pieces.append((tuple(offsets), tensor))

    def chunk_metadata(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=t.shape) for o, t in self.pieces]

    def find(self, offsets: Any) -> torch.Tensor:
        key = tuple(offsets)
        for o, t in self.pieces:
            if o == key:
                return t
        raise KeyError(f"no chunk at offsets {key}")


def _properties(t: torch.Tensor) -> TensorProperties:
    return TensorProperties(dtype=t.dtype, layout=torch.strided, requires_grad=False,
                            memory_format=torch.contiguous_format, pin_memory=False)


class ChunkSavePlanner(DefaultSavePlanner):
    """Writes :class:`Chunks` as SHARD items of their global tensor, plain tensors as one item
    (deduplicated across ranks by DCP)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def create_local_plan(self) -> SavePlan:
        items: list[WriteItem] = []
        for fqn, obj in self.state_dict.items():
            if isinstance(obj, Chunks):
                props = _properties(obj.pieces[0][1]) if obj.pieces else None
                for offsets, t in obj.pieces:
                    items.append(WriteItem(
                        index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(offsets), t.shape),
                                                    properties=props, size=torch.Size(obj.global_shape))))
            elif isinstance(obj, torch.Tensor):
                items.append(WriteItem(
                    index=MetadataIndex(fqn, (0,) * obj.dim()), type=WriteItemType.TENSOR,
                    tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size((0,) * obj.dim()), obj.shape),
                                                properties=_properties(obj), size=obj.shape)))
            else:
                raise TypeError(f"{fqn}: only tensors and Chunks are checkpointed here, not {type(obj).__name__}")
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        obj = self.state_dict[write_item.index.fqn]
        t = obj.find(write_item.index.offset) if isinstance(obj, Chunks) else obj
        return _own_storage(t.detach())


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """``t`` over a storage of exactly its bytes, sharing memory (DCP clones a contiguous view of a
    larger storage, and a ZeRO-1 shard is all views: its whole size again while saving)."""
    storage = t.untyped_storage()
    if not t.is_contiguous() or storage.nbytes() == t.nbytes:
        return t
    start = t.storage_offset() * t.element_size()
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage[start:start + t.nbytes], 0, t.shape, t.stride())


def saved_chunks_problem(md: Any) -> str | None:
    """Why the saved chunks of one tensor (``md``: its ``TensorStorageMetadata``) do not tile it: two that overlap
    (each element is saved once; an overlap read one chunk's elements twice and left others unread, a count of
    elements read matching all the same), or elements no chunk holds; None when they tile it exactly."""
    chunks = list(md.chunks)
    boxes = [(tuple(c.offsets), tuple(c.sizes)) for c in chunks]
    for (o, z) in boxes:
        if any(x < 0 or n < 0 or x + n > d for x, n, d in zip(o, z, md.size)):
            return f"a saved chunk at offsets {list(o)} of sizes {list(z)} lies outside its shape {list(md.size)}"
    for i, (o1, z1) in enumerate(boxes):
        for o2, z2 in boxes[i + 1:]:
            if all(n1 and n2 and a < b + n2 and b < a + n1 for a, n1, b, n2 in zip(o1, z1, o2, z2)):
                return (f"two saved chunks overlap (offsets {list(o1)} and {list(o2)}): the checkpoint's .metadata "
                        f"is not one this library writes")
    total, saved = math.prod(md.size), sum(math.prod(z) for _, z in boxes)
    if saved != total:
        return f"the saved chunks hold {saved} of its {total} elements (chunks missing from the checkpoint)"
    return None


def model_metadata_problem(metadata: Metadata) -> str | None:
    """Why the model tensors a checkpoint's ``.metadata`` describes cannot be read as it says: chunks that do not
    tile their tensor (:func:`saved_chunks_problem`), or a tensor whose chunks' files hold fewer bytes than its
    elements need (a shape of 10^12 elements over a file of a few bytes: a memory bomb before any read failed).
    None when they can."""
    stored: dict[str, int] = {}
    for index, item in metadata.storage_data.items():
        stored[index.fqn] = stored.get(index.fqn, 0) + int(getattr(item, "length", 0) or 0)
    for fqn, md in metadata.state_dict_metadata.items():
        if not fqn.startswith("model.") or not hasattr(md, "size"):
            continue
        if any(int(d) < 0 for d in md.size):
            return f"{fqn} has a negative size {list(md.size)}"
        problem = saved_chunks_problem(md)
        if problem is not None:
            return f"{fqn}: {problem}"
        need = math.prod(md.size) * torch.empty((), dtype=md.properties.dtype).element_size()
        if stored.get(fqn, 0) < need:
            return (f"{fqn} of shape {list(md.size)} needs {need} bytes but its saved chunks hold "
                    f"{stored.get(fqn, 0)}: the .metadata is not one this library writes")
    return None


class ChunkLoadPlanner(DefaultLoadPlanner):
    """Reads into :class:`Chunks` (and plain tensors) the overlapping parts of the saved chunks."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        self.state_dict = state_dict
        self.original_state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        requests: list[ReadItem] = []
        for fqn, obj in self.state_dict.items():
            md = self.metadata.state_dict_metadata.get(fqn)
            if md is None:
                raise CheckpointError(f"the checkpoint has no entry {fqn!r}")
            shape = obj.global_shape if isinstance(obj, Chunks) else tuple(obj.shape)
            if tuple(md.size) != tuple(shape):
                raise CheckpointError(f"{fqn}: checkpoint shape {tuple(md.size)}, model shape {tuple(shape)}")
            problem = saved_chunks_problem(md)
            if problem is not None:
                raise CheckpointError(f"{fqn}: {problem}")
            if isinstance(obj, Chunks):
                local = obj.chunk_metadata()
            else:
                local = [ChunkStorageMetadata(torch.Size((0,) * obj.dim()), obj.shape)]
            covered = sum(math.prod(c.sizes) for c in local)
            items = create_read_items_for_chunk_list(fqn, md, local)
            read = sum(math.prod(i.lengths) for i in items)
            if read != covered:
                raise CheckpointError(f"{fqn}: the checkpoint covers {read} of the {covered} elements this rank "
                               f"loads (chunks missing from the checkpoint)")
            requests += items
        self.plan = LoadPlan(requests)
        return self.plan

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        obj = self.state_dict[read_item.dest_index.fqn]
        t = obj.find(read_item.dest_index.offset) if isinstance(obj, Chunks) else obj
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            t = t.narrow(dim, start, length)
        return t

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise CheckpointError(f"refusing to unpickle checkpoint entry {read_item.dest_index.fqn!r}")


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _single_process_quiet(single_process: bool = False) -> Iterator[None]:
    """DCP warns that it assumes one process without a process group, or when this process reads alone inside one
    (``single_process``: ``init_from``, ``export``): that is what we ask for."""
    with warnings.catch_warnings():
        if single_process or not _distributed():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def save(state: dict[str, Any], path: str | Path) -> None:
    """Write ``state`` (tensors and :class:`Chunks`) into the DCP directory ``path`` (collective)."""
    try:
        with _single_process_quiet():
            dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)), planner=ChunkSavePlanner(),
                     no_dist=not _distributed())
    except BaseException as e:  # torch's CheckpointException derives from BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise CheckpointError(_short(e)) from e


def load(state: dict[str, Any], path: str | Path, *, single_process: bool = False,
         allow_bytes: bool = False) -> None:
    """Fill ``state`` (tensors and :class:`Chunks`, in place) from the DCP directory ``path``.

    Collective over the default group when one exists, unless ``single_process`` (this process
    reads what it asks for on its own, e.g. whole tensors to convert). ``allow_bytes``: see
    :func:`read_metadata` (the bytes entries are never read)."""
    try:
        with _single_process_quiet(single_process):
            dcp.load(state, storage_reader=SafeFileSystemReader(path, allow_bytes=allow_bytes),
                     planner=ChunkLoadPlanner(), no_dist=single_process or not _distributed())
    except BaseException as e:  # noqa: BLE001 - CheckpointException derives from BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise CheckpointError(_short(e)) from e


def _short(e: BaseException) -> str:
    """One line per distinct failure (DCP's CheckpointException carries a traceback per rank)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        causes = []
        for rank, err in sorted(failures.items()):
            inner = err[0] if isinstance(err, tuple) else err
            text = f"{type(inner).__name__}: {inner}".splitlines()[0]
            if isinstance(inner, CheckpointError):
                text = str(inner).splitlines()[0]
            if text not in [c for _, c in causes]:
                causes.append((rank, text))
        return "; ".join(f"rank {r}: {c}" for r, c in causes)
    return f"{type(e).__name__}: {e}".splitlines()[0] if not isinstance(e, CheckpointError) else str(e)
