"""One verification on every path that reads a checkpoint, in one process: ``load_from_checkpoint``,
``init_from``, ``export hf`` (through the command's ``main``) and ``verify_checkpoint`` itself refuse a
same-size byte flip and an altered checksum, and load a checkpoint without checksums (format 1, or a
format-2 marker whose checksums were deleted) only with the explicit opt-in, with a warning saying why.

The checkpoint is the committed format-1 one (tests/data/ckpt_v1_tp2, written at TP=2), given a
format-2 marker with checksums as the current release writes them. ``fit/validate --ckpt_path`` (the
collective path through ``checkpoint.load``) are checked on 2 ranks in tests/test_checkpoint_trust.py.
"""

from __future__ import annotations

import json
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from lightning_megatron import checkpoint as ckpt

DATA = Path(__file__).parent / "data"
V1 = json.loads((DATA / "ckpt_v1_tp2.json").read_text())


def _v1_model() -> dict:
    """The arguments the format-1 checkpoint was written with (the flat ones of before), in today's spelling."""
    from lightning_megatron.models.bert.module import BertLightningModule

    return BertLightningModule.upgrade_hparams(V1["model"])


def _format_2(src: Path, dst: Path) -> Path:
    """A copy of ``src`` with the marker the current release writes (format 2, sha256 of every file)."""
    shutil.copytree(src, dst)
    marker = json.loads((dst / ckpt.MARKER).read_text())
    names = ckpt._files(dst)
    marker.update(format_version=2, files={n: (dst / n).stat().st_size for n in names},
                  sha256={n: ckpt.file_sha256(dst / n) for n in names})
    (dst / ckpt.MARKER).write_text(json.dumps(marker))
    return dst


def _damage(path: Path, how: str) -> str:
    """Damage checkpoint ``path`` as ``how`` says; returns what the error must name."""
    marker = json.loads((path / ckpt.MARKER).read_text())
    if how == "byte_flip":  # same size: only the checksum can tell
        shard = path / "__1_0.distcp"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x40
        shard.write_bytes(bytes(data))
        return "__1_0.distcp does not match the sha256"
    if how == "altered_checksum":
        old = marker["sha256"]["__0_0.distcp"]
        marker["sha256"]["__0_0.distcp"] = ("0" if old[0] != "0" else "1") + old[1:]
        (path / ckpt.MARKER).write_text(json.dumps(marker))
        return "__0_0.distcp does not match the sha256"
    if how == "checksums_deleted":  # format 2 with its checksums removed: not a silent downgrade
        del marker["sha256"]
        (path / ckpt.MARKER).write_text(json.dumps(marker))
        return "has no sha256 checksums"
    if how == "format_1_checksums_deleted":
        marker["format_version"] = 1
        del marker["sha256"]
        (path / ckpt.MARKER).write_text(json.dumps(marker))
        return "format 1, written before checkpoints carried checksums"
    raise AssertionError(how)


def _load_from_checkpoint(path: Path) -> None:
    from lightning_megatron.models.bert.module import BertLightningModule

    BertLightningModule.load_from_checkpoint(path)


def _init_from(path: Path) -> None:
    from lightning_megatron.models.bert.module import BertLightningModule

    module = BertLightningModule(**_v1_model(), init_from=str(path))
    module.configure_model()


def _export(path: Path) -> None:
    from lightning_megatron.export import export_hf

    export_hf(path, path.parent / f"{path.name}-hf")  # `lightning-megatron export hf`: see the last test


def _verify(path: Path) -> None:
    ckpt.verify_checkpoint(path)


PATHS = {"load_from_checkpoint": _load_from_checkpoint, "init_from": _init_from, "export_hf": _export,
         "verify_checkpoint": _verify}


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    return _format_2(DATA / "ckpt_v1_tp2", tmp_path_factory.mktemp("verify") / "good")


@pytest.mark.parametrize("how", ["byte_flip", "altered_checksum"])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_corruption_is_refused_on_every_load_path_even_with_the_opt_in(good, tmp_path, monkeypatch, how, path):
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    expected = _damage(bad, how)
    for opted_in in (False, True):  # the opt-in is for missing checksums, never for wrong ones
        if opted_in:
            monkeypatch.setenv(ckpt.ALLOW_UNVERIFIED_ENV, "1")
        with pytest.raises(ckpt.CheckpointError, match=expected) as info:
            PATHS[path](bad)
        assert str(bad) in str(info.value)
    assert not (tmp_path / "bad-hf").exists()


@pytest.mark.parametrize("how", ["checksums_deleted", "format_1_checksums_deleted"])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_unverified_checkpoint_loads_only_with_the_opt_in(good, tmp_path, monkeypatch, how, path):
    unverified = tmp_path / "unverified"
    shutil.copytree(good, unverified)
    reason = _damage(unverified, how)
    with pytest.raises(ckpt.CheckpointError, match="cannot be verified") as info:
        PATHS[path](unverified)
    message = str(info.value)
    assert reason in message and "--allow-unverified-checkpoint" in message and ckpt.ALLOW_UNVERIFIED_ENV in message
    monkeypatch.setenv(ckpt.ALLOW_UNVERIFIED_ENV, "1")
    if path == "export_hf":
        return  # the opt-in through the command's flag: test_export_flag_opts_in_and_the_good_checkpoint_...
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        PATHS[path](unverified)
    assert [str(w.message) for w in caught if "UNVERIFIED" in str(w.message) and reason in str(w.message)]


class _Payload:
    """A pickle that would run a command when unpickled without restrictions."""

    def __init__(self, sentinel: Path) -> None:
        self.sentinel = sentinel

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.sentinel}",))


@pytest.mark.parametrize("how", ["whole_file", "same_size"])
@pytest.mark.parametrize("path", ["load_from_checkpoint", "init_from", "export_hf"])
def test_pickled_payload_in_a_tensor_chunk_is_refused_naming_the_file(good, tmp_path, how, path):
    """A tensor chunk (__1_0.distcp) replaced by a pickle, its checksum rewritten to match (an attacker's
    edit, or a writer's bug): refused naming the checkpoint, the file, the entry and the cause (was
    ``rank 0: EOFError:``, or torch's advice to load with weights_only=False), and the payload never runs."""
    import pickle

    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    shard, sentinel = bad / "__1_0.distcp", tmp_path / "payload-ran"
    payload = pickle.dumps(_Payload(sentinel), protocol=2)
    data = shard.read_bytes()
    shard.write_bytes(payload if how == "whole_file" else payload + data[len(payload):])
    marker = json.loads((bad / ckpt.MARKER).read_text())
    marker["files"]["__1_0.distcp"], marker["sha256"]["__1_0.distcp"] = shard.stat().st_size, ckpt.file_sha256(shard)
    (bad / ckpt.MARKER).write_text(json.dumps(marker))
    with pytest.raises(ckpt.CheckpointError) as info:
        PATHS[path](bad)
    message = str(info.value)
    assert f"checkpoint {str(bad)!r}: __1_0.distcp does not hold the tensor entry" in message, message
    cause = "run past the file's" if how == "whole_file" else "UnpicklingError: Trying to load unsupported GLOBAL"
    assert cause in message and "weights_only=False" not in message and "\n" not in message, message
    assert not sentinel.exists()


def test_export_flag_opts_in_and_the_good_checkpoint_loads_everywhere(good, tmp_path, monkeypatch, capsys):
    from lightning_megatron.cli import main
    from lightning_megatron.models.bert.module import BertLightningModule

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a verified checkpoint loads without the warning
        ckpt.verify_checkpoint(good)
        loaded = BertLightningModule.load_from_checkpoint(good)
    module = BertLightningModule(**_v1_model(), init_from=str(good))
    module.configure_model()
    for (name, a), (_, b) in zip(loaded.sharded_named_parameters(), module.sharded_named_parameters()):
        assert torch.equal(a, b), name
    v1 = tmp_path / "v1"
    shutil.copytree(DATA / "ckpt_v1_tp2", v1)  # the committed format-1 checkpoint, as written
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(995)]))
    monkeypatch.delenv(ckpt.ALLOW_UNVERIFIED_ENV, raising=False)
    with pytest.raises(SystemExit) as info:  # one line, exit 1
        main(["export", "hf", "--ckpt_path", str(v1), "--output", str(tmp_path / "hf"), "--vocab_file", str(vocab)])
    err = capsys.readouterr().err
    assert info.value.code == 1 and err.count("\n") == 1, err
    assert f"checkpoint '{v1}' cannot be verified: it is format 1" in err, err
    with pytest.warns(UserWarning, match="loaded UNVERIFIED: it is format 1"):
        main(["export", "hf", "--ckpt_path", str(v1), "--output", str(tmp_path / "hf"), "--vocab_file", str(vocab),
              "--allow-unverified-checkpoint"])
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_hf_folder_with_auto_map_is_refused_and_its_code_never_runs(tmp_path):
    """A Hugging Face folder whose config.json maps to its own code (auto_map) is refused before
    transformers sees it (which would offer to run that code, and read EOF without a terminal)."""
    from lightning_megatron.models.bert.module import BertLightningModule

    read_pretrained = BertLightningModule.read_pretrained

    folder = tmp_path / "remote"
    folder.mkdir()
    sentinel = tmp_path / "PWNED"
    (folder / "configuration_evil.py").write_text(
        f"import pathlib\npathlib.Path({str(sentinel)!r}).touch()\n"
        "from transformers import PretrainedConfig\nclass EvilConfig(PretrainedConfig):\n    model_type = 'evil'\n")
    (folder / "config.json").write_text(json.dumps({
        "model_type": "evil", "auto_map": {"AutoConfig": "configuration_evil.EvilConfig"}, "hidden_size": 16}))
    for load in (lambda: read_pretrained(str(folder)),
                 lambda: BertLightningModule(**_v1_model(), init_from=str(folder)).configure_model()):
        with pytest.raises(ValueError, match=r"config.json' has auto_map .*trust_remote_code=False") as info:
            load()
        assert str(folder) in str(info.value)
    assert not sentinel.exists()


def test_load_from_checkpoint_of_a_url_never_unpickles_code(tmp_path, monkeypatch):
    """``load_from_checkpoint("http://...")`` went to Lightning's loader, which reads a URL with
    ``weights_only=False``: a pickle payload in the served file ran. Read weights only now, and
    ``weights_only=False`` is refused."""
    import http.server
    import os
    import pickle
    import threading

    from lightning_megatron.models.bert.module import BertLightningModule

    sentinel = tmp_path / "PWNED"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {sentinel}",))

    (tmp_path / "served").mkdir()
    (tmp_path / "served" / "payload.ckpt").write_bytes(pickle.dumps(Payload()))
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))  # torch.hub's download cache

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(tmp_path / "served"), **kwargs)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/payload.ckpt"
        with pytest.raises(pickle.UnpicklingError):
            BertLightningModule.load_from_checkpoint(url)
        with pytest.raises(ValueError, match=r"load_from_checkpoint\(weights_only=False\) is refused"):
            BertLightningModule.load_from_checkpoint(url, weights_only=False)
    finally:
        server.shutdown()
    assert not sentinel.exists()


@pytest.mark.parametrize("lie", ["overlap", "bomb"])
def test_a_metadata_that_lies_about_its_chunks_is_refused_before_reading(good, tmp_path, lie):
    """A ``.metadata`` (allow-listed, its checksum updated) whose two word-embedding chunks both claim offset 0: the
    count of elements read matched, so one process's readers (export, init_from, load_from_checkpoint) took half
    the rows twice and left the others as ``torch.empty`` left them (process memory in ``model.safetensors``). One
    claiming a tensor of 10^12 elements over a few bytes: an allocation of terabytes before any read failed."""
    import dataclasses
    import pickle

    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata

    from lightning_megatron import dcp_io
    from lightning_megatron.saved_model import read_model_checkpoint

    path = tmp_path / lie
    shutil.copytree(good, path)
    md = dcp_io.read_metadata(path)
    emb = next(k for k in md.state_dict_metadata if k.endswith("word_embeddings.weight"))
    tensor = md.state_dict_metadata[emb]
    if lie == "overlap":
        first, second = tensor.chunks
        moved = ChunkStorageMetadata(offsets=first.offsets, sizes=second.sizes)
        md.state_dict_metadata[emb] = dataclasses.replace(tensor, chunks=[first, moved])
        for index, item in list(md.storage_data.items()):
            if index.fqn == emb and tuple(index.offset) == tuple(second.offsets):
                del md.storage_data[index]
                md.storage_data[dataclasses.replace(index, offset=first.offsets)] = item
        named = "two saved chunks overlap"
    else:
        md.state_dict_metadata["model.bomb"] = TensorStorageMetadata(
            properties=tensor.properties, size=torch.Size([10**6, 10**6]),
            chunks=[ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([10**6, 10**6]))])
        named = "model.bomb of shape [1000000, 1000000] needs 4000000000000 bytes but its saved chunks hold 0"
    (path / ".metadata").write_bytes(pickle.dumps(md))
    marker = json.loads((path / ckpt.MARKER).read_text())
    marker["files"][".metadata"] = (path / ".metadata").stat().st_size
    marker["sha256"][".metadata"] = ckpt.file_sha256(path / ".metadata")
    (path / ckpt.MARKER).write_text(json.dumps(marker))
    with pytest.raises(ckpt.CheckpointError, match=re.escape(named)):
        read_model_checkpoint(path)


def test_recover_last_takes_a_complete_interrupted_save_or_refuses(good, tmp_path):
    """``ckpt_path="last"`` with last.ckpt missing (a crash between the two renames of a file system
    without RENAME_EXCHANGE): the newest complete ``last.ckpt.tmp-<id>`` whose checksums verify; one
    that does not verify is an error, never a silent restart from step 0."""
    d = tmp_path / "checkpoints"
    d.mkdir()
    assert ckpt.recover_last(d) is None  # nothing saved yet: a fresh start is right
    shutil.copytree(good, d / "last.ckpt.tmp-old")  # the previous checkpoint, kept by the two-rename swap
    shutil.copytree(good, d / "last.ckpt.tmp-1a2b3c4d")  # the new, complete one
    with pytest.warns(UserWarning, match=r"last.ckpt' is missing, but the interrupted save .*tmp-1a2b3c4d' is "
                                         r"complete and its checksums verify"):
        assert ckpt.recover_last(d) == d / "last.ckpt.tmp-1a2b3c4d"
    _damage(d / "last.ckpt.tmp-1a2b3c4d", "byte_flip")
    with pytest.warns(UserWarning, match="tmp-old"):  # the corrupt new one is passed over for the old one
        assert ckpt.recover_last(d) == d / "last.ckpt.tmp-old"
    shutil.rmtree(d / "last.ckpt.tmp-old")
    (d / "last.ckpt.tmp-5e6f7a8b").mkdir()  # a save interrupted before its marker
    with pytest.raises(ckpt.CheckpointError, match="no checkpoint there can be used") as info:
        ckpt.recover_last(d)
    message = str(info.value)
    assert "lightning_megatron.json is missing" in message and "does not match the sha256" in message, message
    assert "refusing to start again from step 0" in message and "tmp-5e6f7a8b" in message
    shutil.copytree(good, d / "last.ckpt")
    assert ckpt.recover_last(d) is None  # last.ckpt is there: Lightning's own resolution


def test_a_file_no_loader_reads_is_ignored_one_it_may_read_is_refused_unlisted(good, tmp_path):
    """A file the checkpoint never held (``notes.txt``, a desktop's ``.DS_Store``, an NFS ``.nfs*`` file) made a good
    checkpoint unverifiable ("has no checksum for ['notes.txt']", only --allow-unverified-checkpoint went on),
    after the ranks had started. What no loader reads is left alone; an unlisted file a loader reads (a shard, a
    rank's RNG state) is still refused."""
    d = tmp_path / "ckpt"
    shutil.copytree(good, d)
    (d / "notes.txt").write_text("lr 1e-4 looked better\n")
    (d / ".DS_Store").write_bytes(b"\0\1")
    (d / "rng").mkdir(exist_ok=True)
    (d / "rng" / ".nfs000000000001").write_bytes(b"")
    ckpt.verify_checkpoint(d)
    (d / "rng" / "rank_7.pt").write_bytes(b"not a tensor file")
    with pytest.raises(ckpt.CheckpointError, match=r"has no checksum for \['rng/rank_7.pt'\]"):
        ckpt.verify_checkpoint(d)


def test_recover_last_takes_the_runs_newest_complete_checkpoint_when_last_was_never_saved(good, tmp_path):
    """A run whose ``last`` save failed (a full disk) or was killed between Lightning's step save and its ``last``
    save has step checkpoints and no ``last.ckpt``: ``--ckpt_path last`` said "no last checkpoint yet: a new run
    from step 0", then refused the new run because the folder holds checkpoints, telling the user to pass
    ``--ckpt_path last``. The run's newest complete checkpoint is taken, with a warning; another run's beside it
    makes "last" ambiguous, an error naming both."""
    d = tmp_path / "checkpoints"
    d.mkdir()
    shutil.copytree(good, d / "epoch=0-step=2.ckpt")
    shutil.copytree(good, d / "epoch=0-step=4.ckpt")
    for name, step in (("epoch=0-step=2.ckpt", 2), ("epoch=0-step=4.ckpt", 4)):
        marker = json.loads((d / name / ckpt.MARKER).read_text())
        (d / name / ckpt.MARKER).write_text(json.dumps({**marker, "global_step": step, "run_id": "run-a"}))
    with pytest.warns(UserWarning, match=r"last.ckpt' is missing .*: resuming from this run's newest complete "
                                         r"checkpoint '.*epoch=0-step=4.ckpt' \(step 4\)"):
        assert ckpt.recover_last(d) == d / "epoch=0-step=4.ckpt"
    _damage(d / "epoch=0-step=4.ckpt", "byte_flip")
    with pytest.warns(UserWarning, match=r"epoch=0-step=2.ckpt' \(step 2\)"):  # the damaged one passed over
        assert ckpt.recover_last(d) == d / "epoch=0-step=2.ckpt"
    shutil.copytree(d / "epoch=0-step=2.ckpt", d / "epoch=0-step=9.ckpt")
    marker = json.loads((d / "epoch=0-step=9.ckpt" / ckpt.MARKER).read_text())
    (d / "epoch=0-step=9.ckpt" / ckpt.MARKER).write_text(json.dumps({**marker, "global_step": 9, "run_id": "run-b"}))
    with pytest.raises(ckpt.CheckpointError, match=r"the checkpoints of 2 runs .*run-a.*run-b"):
        ckpt.recover_last(d)


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("error", ["disk_full", "nan"])
def test_cli_reports_an_agreed_error_once_on_rank_0(monkeypatch, capsys, rank, error):
    """Every rank raises the same CheckpointError (a full disk: was ~240 lines and 10 tracebacks from 2
    ranks) or NonFiniteLossOrGradError: rank 0 exits 1 with one line, the others exit 1 without a word."""
    from lightning.pytorch.utilities import rank_zero_only

    from lightning_megatron import cli
    from lightning_megatron.step import NonFiniteLossOrGradError

    message = {"disk_full": "saving checkpoint 'x/last.ckpt' failed: the disk is full in 'x' (0.00 GiB free)",
               "nan": "at step 3 (the state at global_step=3 is the last good one) the gradient is not finite (nan)"}[error]

    def fail(*args, **kwargs):
        raise (ckpt.CheckpointError if error == "disk_full" else NonFiniteLossOrGradError)(message)

    monkeypatch.setattr(cli, "lightning_cli", fail)
    monkeypatch.setattr(rank_zero_only, "rank", rank)
    with pytest.raises(SystemExit) as info:
        cli.main(["fit", "--config", "recipe.yaml"])
    assert info.value.code == (f"lightning-megatron: {message}" if rank == 0 else 1)
    assert capsys.readouterr().err == ""


def test_json_nested_past_the_parser_is_a_clear_error(good, tmp_path):
    """A marker or a Hugging Face config.json nested deeper than Python's parser goes raised RecursionError, a
    traceback before launch; one line naming the file now."""
    path = tmp_path / "deep"
    shutil.copytree(good, path)
    (path / ckpt.MARKER).write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ckpt.CheckpointError, match=r"has a corrupt lightning_megatron.json"):
        ckpt.verify_checkpoint(path)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    from lightning_megatron.interop.hf_folder import read_hf_config

    with pytest.raises(ValueError, match=r"config.json' cannot be read as JSON"):
        read_hf_config(tmp_path / "hf")


def test_a_payload_in_extra_pt_is_refused_without_advice_to_load_it_unsafely(good, tmp_path):
    """A pickle payload in extra.pt (its checksum updated): refused, nothing run, naming the global; torch's advice
    ("Re-running torch.load with weights_only set to False will likely succeed") is the wrong one for a hostile file
    and is not repeated."""
    import os
    import pickle

    from lightning_megatron.saved_model import read_model_checkpoint

    sentinel = tmp_path / "PWNED"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {sentinel}",))

    path = tmp_path / "payload"
    shutil.copytree(good, path)
    (path / "extra.pt").write_bytes(pickle.dumps(Payload(), protocol=2))  # torch.save's protocol
    marker = json.loads((path / ckpt.MARKER).read_text())
    marker["files"]["extra.pt"] = (path / "extra.pt").stat().st_size
    marker["sha256"]["extra.pt"] = ckpt.file_sha256(path / "extra.pt")
    (path / ckpt.MARKER).write_text(json.dumps(marker))
    for read in (lambda: read_model_checkpoint(path), lambda: ckpt.saved_extra(path)):
        with pytest.raises(ckpt.CheckpointError) as refused:
            read()
        message = str(refused.value)
        assert "extra.pt cannot be read safely (weights_only=True; nothing in it ran)" in message, message
        assert "system" in message and "weights_only set to False" not in message and "\n" not in message, message
    assert not sentinel.exists()


def test_last_behind_a_later_complete_checkpoint_of_its_run_resumes_the_later_one(good, tmp_path):
    """A launcher killed (or Ctrl-C pressed twice) during the ``last`` save that follows a step checkpoint left a
    complete ``epoch=0-step=4.ckpt`` and ``last.ckpt`` at step 2: ``--ckpt_path last`` resumed step 2 and trained a save
    interval again (200 steps in the recipes), while its own warning named the newer checkpoint. The run's complete
    checkpoint of a later step, written after ``last.ckpt``, is resumed, with a warning; one written before it (a
    branch the run left when it resumed from an earlier checkpoint), another run's, a weights-only one, or one that
    does not verify, is not."""
    import os

    d = tmp_path / "checkpoints"
    d.mkdir()

    def saved(name, step, run="run-a", when=0.0):
        shutil.copytree(good, d / name)
        marker = json.loads((d / name / ckpt.MARKER).read_text())
        (d / name / ckpt.MARKER).write_text(json.dumps({**marker, "global_step": step, "run_id": run}))
        os.utime(d / name / ckpt.MARKER, (1e9 + when, 1e9 + when))
        return d / name

    last = saved("last.ckpt", 2, when=10)
    assert ckpt.newer_than_last(last) is None
    saved("epoch=0-step=6.ckpt", 6, when=5)  # the branch the run left: written before last.ckpt
    saved("epoch=0-step=8.ckpt", 8, run="run-b", when=20)  # another run's
    assert ckpt.newer_than_last(last) is None
    later = saved("epoch=0-step=4.ckpt", 4, when=11)
    weights = saved("epoch=0-step=5.ckpt", 5, when=12)  # a save_weights_only callback's: nothing to resume training
    extra = torch.load(weights / "extra.pt", weights_only=True)
    torch.save({k: v for k, v in extra.items() if k not in ("megatron_optimizers", "loops")}, weights / "extra.pt")
    marker = json.loads((weights / ckpt.MARKER).read_text())
    marker["files"]["extra.pt"] = (weights / "extra.pt").stat().st_size
    marker["sha256"]["extra.pt"] = ckpt.file_sha256(weights / "extra.pt")
    (weights / ckpt.MARKER).write_text(json.dumps(marker))
    os.utime(weights / ckpt.MARKER, (1e9 + 12, 1e9 + 12))
    with pytest.warns(UserWarning, match=r"last.ckpt' is step 2, and this run's complete checkpoint "
                                         r"'.*epoch=0-step=4.ckpt' \(step 4\) was written after it: its last save was "
                                         r"interrupted; resuming from step 4"):
        assert ckpt.newer_than_last(last) == later
    _damage(later, "byte_flip")
    assert ckpt.newer_than_last(last) is None


@pytest.mark.parametrize("rank", [0, 1])
def test_a_dead_peer_is_said_in_one_line_and_never_blamed_on_the_disk(monkeypatch, capsys, tmp_path, rank):
    """A rank killed during a save, a validation or the data build left the others a ~95-line gloo traceback ending
    in "Connection closed by peer [127.0.0.1]:port", naming no rank; killed while it wrote its shard, the save said "a
    write failed in '...' (51.39 GiB free there)", blaming the disk. Each surviving rank now says in one line that
    another rank died or stopped answering, and where it was; the save says the disk is not the cause."""
    import torch.distributed as dist
    from lightning.pytorch.utilities import rank_zero_only

    from lightning_megatron import cli
    from lightning_megatron.checkpoint import _write_error
    from lightning_megatron.communicator import TorchCommunicator

    gloo = ("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:29516: Connection closed by "
            "peer [127.0.0.1]:29516")

    def closed(*args, **kwargs):
        raise RuntimeError(gloo)

    monkeypatch.setattr(dist, "all_reduce", closed)

    def fail(*args, **kwargs):  # a collective of ours whose peer is gone
        TorchCommunicator(None).all_reduce(torch.zeros(1))

    try:
        fail()
    except RuntimeError as e:
        said = _write_error(e, tmp_path / "last.ckpt", tmp_path)
    assert "another rank died or stopped answering during the save" in said and "a write failed" not in said, said
    # this process's own socket (an HTTP client's reset, W&B's), a data-loader worker's: not another rank's death
    own = ConnectionResetError(104, "Connection reset by peer")
    assert "a write failed" in _write_error(own, tmp_path / "last.ckpt", tmp_path)
    from lightning_megatron.communicator import peer_lost

    assert peer_lost(RuntimeError(gloo)) is None  # not raised by a collective

    monkeypatch.setattr(cli, "lightning_cli", fail)
    monkeypatch.setattr(rank_zero_only, "rank", rank)
    with pytest.raises(SystemExit) as info:
        cli.main(["fit", "--config", "recipe.yaml"])
    message = str(info.value.code)
    assert message.startswith(f"lightning-megatron: rank {rank}: another rank died or stopped answering (") and \
        "Connection closed by peer" in message and "that rank's own output" in message, message
    assert "in closed (" in message, message  # where this rank was: the innermost frame outside torch (its stand-in)


def test_an_nccl_peer_that_died_is_said_as_a_gloo_one_is(monkeypatch):
    """NCCL says a dead peer in its own words (``ncclRemoteError``, raised as ``DistBackendError``): the CLI's "another
    rank died or stopped answering" line and the save's "not the disk" named it only on gloo's ("Connection closed
    by peer"), and an NCCL run (our users') got the raw error."""
    import torch.distributed as dist

    from lightning_megatron.communicator import TorchCommunicator, peer_lost

    nccl = ("NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, remote process exited or "
            "there was a network error, NCCL version 2.21.5\nncclRemoteError: A call failed possibly due to a network "
            "error or a remote process exiting prematurely.\nLast error:\nsocketProgress: Connection closed by remote "
            "peer node-7<52118>")

    def closed(*args, **kwargs):
        raise dist.DistBackendError(nccl)

    monkeypatch.setattr(dist, "all_reduce", closed)
    try:
        TorchCommunicator(None).all_reduce(torch.zeros(1))
    except RuntimeError as e:
        said = peer_lost(e)
    assert said == nccl.splitlines()[0], said
    assert peer_lost(dist.DistBackendError(nccl)) is None  # not raised by a collective
