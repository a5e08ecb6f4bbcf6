"""Checkpoints under Trainer on 2 ranks: a planted .metadata payload never runs (fit and validate),
a flipped byte, an altered checksum, another head count, another hidden size and (on resume) another
optimizer class are clear CheckpointErrors, saving is warning-free and atomic, stale temporaries go, a
full disk is named, a NaN gradient stops the run and keeps the last good checkpoint, checkpoints without
checksums (format 1, or checksums deleted) load only with the opt-in."""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from dist_utils import run_distributed
from megatron_testing import TINY_CONFIG, TINY_MODEL, error_of, make_trainer, synthetic_datamodule

DATA = Path(__file__).parent / "data"


class _Payload:
    def __init__(self, sentinel: str) -> None:
        self.sentinel = sentinel

    def __reduce__(self):
        return (os.system, (f"touch {self.sentinel}",))


def _rewrite_marker(path: Path, name: str) -> None:
    """Update size and checksum of ``name`` as an attacker would: only the unpickler stands in the way."""
    from lightning_megatron.checkpoint import MARKER, file_sha256

    marker = json.loads((path / MARKER).read_text())
    marker["files"][name] = (path / name).stat().st_size
    marker["sha256"][name] = file_sha256(path / name)
    (path / MARKER).write_text(json.dumps(marker))


def _trainer(tp: int, max_steps: int, pp: int = 1, **kwargs):
    from lightning_megatron.strategy import MegatronStrategy

    strategy = MegatronStrategy(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    trainer = make_trainer(strategy, 2, max_steps, **kwargs)
    dims = strategy.parallel_dims.for_world_size(trainer.world_size)
    dp_rank = dims.coordinates(torch.distributed.get_rank())["dp"]
    return trainer, synthetic_datamodule(8, 2, dims.dp, dp_rank)


def _worker(root: str) -> dict:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_megatron.models.bert.module import BertLightningModule
    from lightning_megatron.module import check_checkpoint_fits

    rank = torch.distributed.get_rank()
    out: dict = {}
    root_p = Path(root)
    # --- a run that saves "last.ckpt" through ModelCheckpoint every step; a stale temporary is cleaned
    if rank == 0:
        (root_p / "last.ckpt.tmp-stale").mkdir(parents=True)
    torch.distributed.barrier()
    trainer, dm = _trainer(2, 3, enable_checkpointing=True,
                           callbacks=[ModelCheckpoint(dirpath=root, save_last=True, save_top_k=0,
                                                      every_n_train_steps=1)])
    trainer.fit(BertLightningModule(**TINY_MODEL), datamodule=dm)
    out["listing"] = sorted(p.name for p in root_p.iterdir())
    out["listing_root"] = root
    good = root_p / "last.ckpt"
    # --- save + load without a single warning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.save_checkpoint(root_p / "direct")
        trainer.strategy.load_checkpoint(root_p / "direct")
    out["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
    # --- resume with ckpt_path="last": ModelCheckpoint finds the swapped-in directory
    trainer, dm = _trainer(2, 4, enable_checkpointing=True,
                           callbacks=[ModelCheckpoint(dirpath=root, save_last=True, save_top_k=0)])
    trainer.fit(BertLightningModule(**TINY_MODEL), datamodule=dm, ckpt_path="last")
    out["resumed_step"] = trainer.global_step

    # --- planted payload in .metadata, marker checksum updated by the attacker
    planted, sentinel = root_p / "planted", root_p / "PWNED"
    if rank == 0:
        shutil.copytree(good, planted)
        (planted / ".metadata").write_bytes(pickle.dumps(_Payload(str(sentinel))))
        _rewrite_marker(planted, ".metadata")
    torch.distributed.barrier()
    trainer, dm = _trainer(2, 6)
    out["payload_fit"] = error_of(lambda: trainer.fit(BertLightningModule(**TINY_MODEL), datamodule=dm,
                                                    ckpt_path=planted))
    trainer, dm = _trainer(2, 6)
    out["payload_validate"] = error_of(lambda: trainer.validate(BertLightningModule(**TINY_MODEL), datamodule=dm,
                                                              ckpt_path=planted, verbose=False))
    out["sentinel"] = sentinel.exists()

    # --- one rank's RNG file holding plain data that is not RNG state (its checksum updated): that rank raised alone
    # and the other died of a closed connection; both say it now
    rng_other = root_p / "rng_other"
    if rank == 0:
        shutil.copytree(good, rng_other)
        torch.save({"cpu": "not a state"}, rng_other / "rng" / "rank_1.pt")
        _rewrite_marker(rng_other, "rng/rank_1.pt")
    torch.distributed.barrier()
    trainer, dm = _trainer(2, 6)
    out["rng_other"] = error_of(lambda: trainer.fit(BertLightningModule(**TINY_MODEL), datamodule=dm,
                                                    ckpt_path=rng_other))

    # --- a same-size byte flip in a shard
    flipped = root_p / "flipped"
    if rank == 0:
        shutil.copytree(good, flipped)
        shard = sorted(flipped.glob("*.distcp"))[-1]
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x40
        shard.write_bytes(bytes(data))
    torch.distributed.barrier()
    trainer, dm = _trainer(2, 6)
    out["flip"] = error_of(lambda: trainer.fit(BertLightningModule(**TINY_MODEL), datamodule=dm, ckpt_path=flipped))

    # --- other hyper-parameters: every differing field in one error; another hidden size: short
    trainer, dm = _trainer(2, 6)
    other = {**TINY_MODEL, "config": {**TINY_CONFIG, "num_attention_heads": 2, "layernorm_epsilon": 1e-5}}
    out["heads"] = error_of(lambda: trainer.fit(BertLightningModule(**other), datamodule=dm, ckpt_path=good))
    # the check the CLI makes before any rank starts: the same error, from extra.pt alone
    out["heads_before_launch"] = error_of(lambda: check_checkpoint_fits(BertLightningModule(**other), good))
    out["fits_before_launch"] = error_of(lambda: check_checkpoint_fits(BertLightningModule(**TINY_MODEL), good))
    trainer, dm = _trainer(2, 6)
    other = {**TINY_MODEL, "config": {**TINY_CONFIG, "hidden_size": 64}}
    out["hidden"] = error_of(lambda: trainer.fit(BertLightningModule(**other), datamodule=dm, ckpt_path=good))
    # --- another optimizer class (the CLI's --optimizer): AdamW's moments never become SGD's state (they
    # were dropped silently), nor SGD's momentum AdamW's (a KeyError at the first step); validate loads no
    # optimizer state and is not refused
    trainer, dm = _trainer(2, 6)
    sgd = BertLightningModule(**TINY_MODEL)
    sgd.use_optimizer("torch.optim.SGD", {"momentum": 0.9})
    out["optimizer_class"] = error_of(lambda: trainer.fit(sgd, datamodule=dm, ckpt_path=good))
    trainer, dm = _trainer(2, 0, limit_val_batches=1)
    sgd = BertLightningModule(**TINY_MODEL)
    sgd.use_optimizer("torch.optim.SGD", {"momentum": 0.9})
    out["optimizer_class_validate"] = error_of(lambda: trainer.validate(sgd, datamodule=dm, ckpt_path=good,
                                                                      verbose=False))
    # --- a torch LR scheduler the checkpoint holds no state of (the run was trained without it) starts from its own
    # first step: said (Lightning restored the schedulers it had state for without a word)
    trainer, dm = _trainer(2, 6)
    stepped = BertLightningModule(**TINY_MODEL)
    stepped.use_lr_scheduler("torch.optim.lr_scheduler.StepLR", {"step_size": 2})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(stepped, datamodule=dm, ckpt_path=good)
    out["fresh_scheduler"] = [str(w.message) for w in caught if "holds no state of the LR scheduler" in str(w.message)]

    # --- a full disk: the previous checkpoint stays, no temporary is left, the error names the directory
    import torch.distributed.checkpoint as dcp

    def full_disk(self, plan, planner):
        raise OSError(errno.ENOSPC, "No space left on device")

    from lightning_megatron import checkpoint as ckpt

    # (another run's save at that path is refused before anything is written: the saves of a run never
    # replace another run's checkpoint)
    trainer, dm = _trainer(2, 1)
    trainer.fit(BertLightningModule(**TINY_MODEL), datamodule=dm)
    before = ckpt.checkpoint_identity(good), (good / ckpt.MARKER).read_text()
    out["other_run"] = error_of(lambda: trainer.save_checkpoint(good))
    out["other_run_ids"] = trainer.strategy.run_id, before[0][0]
    out["other_run_untouched"] = (good / ckpt.MARKER).read_text() == before[1]
    # ... nor what is not a checkpoint: a folder of the user's at that name was swapped out and deleted
    if rank == 0:
        (root_p / "user_folder").mkdir()
        (root_p / "user_folder" / "notes.txt").write_text("mine")
    torch.distributed.barrier()
    out["not_a_checkpoint"] = error_of(lambda: trainer.save_checkpoint(root_p / "user_folder"))
    out["not_a_checkpoint_kept"] = sorted(q.name for q in (root_p / "user_folder").iterdir())
    import datetime

    from lightning.pytorch import Callback

    # --- what extra.pt holds must load back: a datamodule's Path hyper-parameter was saved as a PosixPath that
    # torch.load(weights_only=True) refuses (every checkpoint of the run saved, none loaded); now a record as the
    # module's are. Callback state that cannot load back (a timedelta), or cannot be pickled at all (a lambda), is
    # refused at the save on every rank, naming the callback (the lambda's PicklingError left rank 1 waiting).
    trainer.datamodule.save_hyperparameters({"data_path": root_p / "data", "seed": 3})
    trainer.save_checkpoint(root_p / "dm_path")
    out["dm_hparams"] = ckpt.saved_extra(root_p / "dm_path")[0]["datamodule_hyper_parameters"]

    class Clock(Callback):
        def __init__(self, value):
            self.value = value

        def state_dict(self):
            return {"elapsed": self.value}

    for name, value in (("timedelta", datetime.timedelta(seconds=5)), ("lambda", lambda: 0)):
        clock = Clock(value)
        trainer.callbacks.append(clock)
        out[f"clock_{name}"] = error_of(lambda: trainer.save_checkpoint(root_p / f"clock_{name}"))
        trainer.callbacks.remove(clock)
        torch.distributed.barrier()  # rank 0 removes the temporary after the error
        out[f"clock_{name}_left"] = sorted(q.name for q in root_p.iterdir() if q.name.startswith(f"clock_{name}"))
    original = dcp.FileSystemWriter.write_data
    dcp.FileSystemWriter.write_data = full_disk
    try:
        trainer, dm = _trainer(2, 5)  # the run of last.ckpt, one step further, saved again there
        trainer.fit(BertLightningModule(**TINY_MODEL), datamodule=dm, ckpt_path=good)
        out["full"] = error_of(lambda: trainer.save_checkpoint(good))
    finally:
        dcp.FileSystemWriter.write_data = original
    torch.distributed.barrier()
    out["after_full"] = sorted(p.name for p in root_p.iterdir() if p.name.startswith("last.ckpt"))

    # --- PP=2 resume: the last stage's tied embedding copy gets the first stage's optimizer state too
    from megatron_testing import LossRecorder

    straight, resumed = LossRecorder(), LossRecorder()
    trainer, dm = _trainer(1, 6, pp=2, enable_checkpointing=True, callbacks=[straight, ModelCheckpoint(
        dirpath=root_p / "pp2", filename="{step}", every_n_train_steps=3, save_top_k=-1)])
    trainer.fit(BertLightningModule(**TINY_MODEL), datamodule=dm)
    trainer, dm = _trainer(1, 6, pp=2, callbacks=[resumed])
    trainer.fit(BertLightningModule(**TINY_MODEL), datamodule=dm, ckpt_path=root_p / "pp2" / "step=3.ckpt")
    out["pp2_straight"], out["pp2_resumed"] = straight.losses, resumed.losses
    # the ranks given different checkpoints (a node whose stale listing resolved `last` to an older save): rank 0
    # would train steps 4-6 while rank 1, at step 6, had ended (a hang), or each stage at another step
    trainer, dm = _trainer(1, 6, pp=2)
    mine = root_p / "pp2" / ("step=3.ckpt" if rank == 0 else "step=6.ckpt")
    out["different_checkpoints"] = error_of(lambda: trainer.fit(BertLightningModule(**TINY_MODEL), datamodule=dm,
                                                                ckpt_path=mine))

    # --- a NaN gradient at step 2 on TP rank 1 only: every rank stops before the step with an error
    # naming the step (and, where it is, the parameter); no checkpoint is written from that state,
    # last.ckpt stays the one saved after step 1
    from lightning_megatron.callbacks import MegatronOptimizerCallback
    from lightning_megatron import checkpoint as ckpt

    nan_dir = root_p / "nan"
    # A rank that the guard did not stop goes on alone and hangs in its next collective: the ranks meet
    # again on a group with a short timeout, so that such a run fails in a minute, not at the helper's 600 s.
    meet = torch.distributed.new_group(timeout=datetime.timedelta(seconds=60))

    import lightning_megatron.step as step_module

    finalize = step_module.finalize_model_grads

    class InjectNaN(Callback):
        """At step 2, once the step's gradients are reduced (where the step's guard then looks), a NaN
        in TP rank 1's piece of one weight's gradient."""

        marker_before: str | None = None
        step = -1

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.step = trainer.global_step
            if self.step == 2:
                self.marker_before = (nan_dir / "last.ckpt" / ckpt.MARKER).read_text()
                [self.param] = [p for n, p in pl_module.sharded_named_parameters()
                                if n == "encoder.layers.1.mlp.linear_fc1.weight"]

        def finalize(self, buffer, ps):
            finalize(buffer, ps)
            if self.step == 2 and rank == 1:
                self.param.main_grad.view(-1)[3] = float("nan")

    inject = InjectNaN()
    step_module.finalize_model_grads = inject.finalize
    trainer, dm = _trainer(2, 6, enable_checkpointing=True, callbacks=[
        MegatronOptimizerCallback(), inject,
        ModelCheckpoint(dirpath=nan_dir, save_last=True, save_top_k=0, every_n_train_steps=1)])
    out["nan"] = error_of(lambda: trainer.fit(BertLightningModule(**TINY_MODEL), datamodule=dm))
    step_module.finalize_model_grads = finalize
    stopped = [None] * torch.distributed.get_world_size()
    try:
        torch.distributed.all_gather_object(stopped, out["nan"], group=meet)
    except RuntimeError as e:
        raise AssertionError(f"the NaN guard did not stop every rank together: rank {rank} stopped with "
                             f"{out['nan']!r}, another rank did not come back within 60 s ({e})") from None
    out["nan_all_ranks"] = stopped
    out["nan_marker_unchanged"] = (nan_dir / "last.ckpt" / ckpt.MARKER).read_text() == inject.marker_before
    out["nan_listing"] = sorted(p.name for p in nan_dir.iterdir())
    out["nan_last_step"] = torch.load(nan_dir / "last.ckpt" / "extra.pt", weights_only=True)["global_step"]
    ckpt.verify_checkpoint(nan_dir / "last.ckpt")

    # --- unverified checkpoints (format 2 with its checksums deleted; format 1) are refused by fit and
    # validate unless the user opts in; an altered checksum is refused even then
    nosums, altered = root_p / "nosums", root_p / "altered"
    if rank == 0:
        for d in (nosums, altered):
            shutil.copytree(good, d)
        marker = json.loads((nosums / ckpt.MARKER).read_text())
        del marker["sha256"]
        (nosums / ckpt.MARKER).write_text(json.dumps(marker))
        marker = json.loads((altered / ckpt.MARKER).read_text())
        name = sorted(marker["sha256"])[-1]
        marker["sha256"][name] = "0" * 64
        (altered / ckpt.MARKER).write_text(json.dumps(marker))
        extra_flipped = root_p / "extra_flipped"  # a byte of extra.pt flipped: refused before launch too
        shutil.copytree(good, extra_flipped)
        data = bytearray((extra_flipped / "extra.pt").read_bytes())
        data[len(data) // 2] ^= 0x40
        (extra_flipped / "extra.pt").write_bytes(bytes(data))
        out["extra_flipped"] = error_of(lambda: ckpt.saved_extra(extra_flipped))
        out["nosums_extra"] = ckpt.saved_extra(nosums)  # None without the opt-in: the ranks refuse it, saying why
    torch.distributed.barrier()
    trainer, dm = _trainer(2, 6)
    out["nosums_fit"] = error_of(lambda: trainer.fit(BertLightningModule(**TINY_MODEL), datamodule=dm,
                                                     ckpt_path=nosums))
    v1 = json.loads((DATA / "ckpt_v1_tp2.json").read_text())
    v1_model = BertLightningModule.upgrade_hparams(v1["model"])  # written with the flat arguments of before
    trainer, dm = _trainer(2, 0, limit_val_batches=2)
    out["v1_validate"] = error_of(lambda: trainer.validate(BertLightningModule(**v1_model), datamodule=dm,
                                                         ckpt_path=DATA / "ckpt_v1_tp2", verbose=False))
    os.environ[ckpt.ALLOW_UNVERIFIED_ENV] = "1"  # the opt-in from here on (--allow-unverified-checkpoint)
    trainer, dm = _trainer(2, 6)
    out["altered_fit"] = error_of(lambda: trainer.fit(BertLightningModule(**TINY_MODEL), datamodule=dm,
                                                    ckpt_path=altered))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, dm = _trainer(2, 6)
        trainer.fit(BertLightningModule(**TINY_MODEL), datamodule=dm, ckpt_path=nosums)
    out["nosums_step"] = trainer.global_step
    out["nosums_extra_opted_in"] = ckpt.saved_extra(nosums)[0]["global_step"]
    out["nosums_warnings"] = [str(w.message) for w in caught if "UNVERIFIED" in str(w.message)]

    # --- format 1 (written by the release before format 2): loads at TP=2 and TP=1 with the opt-in
    for tp in (2, 1):
        trainer, dm = _trainer(tp, 0, limit_val_batches=2)
        [metrics] = trainer.validate(BertLightningModule(**v1_model), datamodule=dm,
                                     ckpt_path=DATA / "ckpt_v1_tp2", verbose=False)
        out[f"v1_tp{tp}"] = float(metrics["val_loss"])
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_distributed(_worker, 2, str(tmp_path_factory.mktemp("trust")), timeout=600)


def test_ranks_given_different_checkpoints_are_refused_on_every_rank(results):
    for r in results:
        said = r["different_checkpoints"]
        assert "the ranks were given different checkpoints to load: rank 0: " in said, said
        assert "step=3.ckpt (run " in said and ", step 3); rank 1: " in said and "step=6.ckpt (run " in said, said


def test_saving_is_atomic_warning_free_and_found_as_last(results):
    r = results[0]
    assert r["listing"] == ["last.ckpt"]  # the stale temporary is gone, no new one is left
    assert r["warnings"] == []
    assert r["resumed_step"] == 4


def test_planted_payload_is_refused_and_never_runs(results):
    for r in results:
        for key in ("payload_fit", "payload_validate"):
            assert r[key].startswith("CheckpointError") and "planted/.metadata" in r[key], r[key]
            assert "refusing to load global posix.system" in r[key], r[key]
        assert r["sentinel"] is False


def test_one_ranks_bad_rng_state_is_said_on_every_rank(results):
    for r in results:
        assert "rng/rank_1.pt is not RNG state" in r["rng_other"], r["rng_other"]


def test_byte_flip_names_the_file(results):
    for r in results:
        assert r["flip"].startswith("CheckpointError") and "does not match the sha256" in r["flip"], r["flip"]
        assert ".distcp" in r["flip"]


def test_other_hyperparameters_are_listed_in_oneerror_of(results):
    for r in results:
        assert r["heads"].startswith("CheckpointError"), r["heads"]
        assert "num_attention_heads: checkpoint 4, model 2" in r["heads"]
        assert "layernorm_epsilon: checkpoint 1e-12, model 1e-05" in r["heads"]
        hidden = r["hidden"]
        assert hidden.startswith("CheckpointError") and "hidden_size: checkpoint 32, model 64" in hidden, hidden
        assert "checkpoint shape (1000, 32), model shape (1000, 64)" in hidden
        assert hidden.rstrip().endswith("Build the model with the checkpoint's values (the first of each pair) to load "
                                        "it"), hidden
        assert "Traceback" not in hidden and len(hidden) < 4000
        assert r["heads_before_launch"] == r["heads"] and r["fits_before_launch"] == "no error", r
        refused = r["optimizer_class"]
        assert refused.startswith("CheckpointError"), refused
        assert "optimizer class: checkpoint torch.optim.AdamW, this run torch.optim.SGD" in refused, refused
        assert "--optimizer torch.optim.AdamW" in refused and "--model.init_from" in refused, refused
        assert r["optimizer_class_validate"] == "no error", r["optimizer_class_validate"]
    assert results[0]["fresh_scheduler"] == ["the checkpoint at step 3 holds no state of the LR scheduler StepLR this "
                                             "run configures (it was trained with another schedule, or none): it "
                                             "starts from its own first step here"], results[0]["fresh_scheduler"]
    assert results[1]["fresh_scheduler"] == []  # said once


def test_a_save_never_replaces_what_is_not_a_checkpoint(results):
    for r in results:
        assert "it is a folder that is no checkpoint (no lightning_megatron.json in it)" in r["not_a_checkpoint"], r
        assert r["not_a_checkpoint_kept"] == ["notes.txt"]


def test_a_save_never_replaces_another_runs_checkpoint(results):
    for r in results:
        mine, theirs = r["other_run_ids"]
        assert mine and theirs and mine != theirs, r["other_run_ids"]
        assert r["other_run"].startswith("CheckpointError: refusing to save"), r["other_run"]
        assert f"another run (run {theirs} at step " in r["other_run"], r["other_run"]
        assert f") and this run is {mine}; a save never replaces another run's checkpoint" in r["other_run"]
        assert r["other_run_untouched"]


def test_what_extra_pt_holds_loads_back_or_the_save_is_refused_on_every_rank(results):
    for r in results:
        assert r["dm_hparams"] == {"data_path": str(Path(r["listing_root"]) / "data"), "seed": 3}
        for name, what in (("timedelta", "timedelta"), ("lambda", "lambda")):
            assert "Clock" in r[f"clock_{name}"] and "callbacks" in r[f"clock_{name}"], r[f"clock_{name}"]
            assert what in r[f"clock_{name}"], r[f"clock_{name}"]
            assert r[f"clock_{name}_left"] == [], r[f"clock_{name}_left"]


def test_full_disk_names_the_directory_and_keeps_the_last_checkpoint(results):
    for r in results:
        assert r["full"].startswith("CheckpointError") and "the disk is full" in r["full"], r["full"]
        assert "GiB free there" in r["full"] and "last.ckpt.tmp-" in r["full"]
    assert results[0]["after_full"] == ["last.ckpt"]


def test_pipeline_resume_restores_the_tied_embedding_state_on_both_stages(results):
    # Losses are logged on the last stage: rank 1 at PP=2.
    r = results[1]
    assert len(r["pp2_straight"]) == 6 and len(r["pp2_resumed"]) == 3
    torch.testing.assert_close(torch.tensor(r["pp2_resumed"]), torch.tensor(r["pp2_straight"][3:]),
                               rtol=1e-6, atol=0)


def test_nan_gradient_stops_the_run_and_keeps_the_last_good_checkpoint(results):
    """The NaN is in TP rank 1's gradient only: both ranks stop at the same step (the step's check is
    agreed over every rank), each with one line naming the parameter and the rank that holds it."""
    for rank, r in enumerate(results):
        assert r["nan_all_ranks"] == [x["nan"] for x in results]  # every rank got this far: none hangs
        assert r["nan"].startswith("NonFiniteLossOrGradError: at step 2"), r["nan"]
        assert "\n" not in r["nan"] and "the gradient is not finite (nan)" in r["nan"], r["nan"]
        named = "first parameter with a non-finite gradient on rank 1: encoder.layers.1.mlp.linear_fc1.weight"
        assert named in r["nan"], r["nan"]  # rank 0 too: the name is gathered with the flag
        assert "check_for_nan_in_loss_and_grad" in r["nan"]
        assert r["nan_marker_unchanged"] and r["nan_last_step"] == 2
    assert results[0]["nan_listing"] == ["last.ckpt"]  # no temporary of a save from the NaN state


def test_unverified_checkpoints_need_the_opt_in_and_wrong_checksums_never_load(results):
    for r in results:
        assert r["nosums_fit"].startswith("CheckpointError") and "has no sha256 checksums" in r["nosums_fit"]
        assert "--allow-unverified-checkpoint" in r["nosums_fit"], r["nosums_fit"]
        assert "cannot be verified: it is format 1" in r["v1_validate"], r["v1_validate"]
        assert r["altered_fit"].startswith("CheckpointError") and "does not match the sha256" in r["altered_fit"]
        assert r["nosums_step"] == 6 and r["nosums_extra_opted_in"] == 3, r
    flipped = results[0]["extra_flipped"]
    assert flipped.startswith("CheckpointError") and "extra.pt does not match the sha256" in flipped, flipped
    assert results[0]["nosums_extra"] is None
    assert results[0]["nosums_warnings"] and "has no sha256 checksums" in results[0]["nosums_warnings"][0]


def test_format_1_checkpoint_loads_at_tp2_and_tp1(results):
    expected = json.loads((DATA / "ckpt_v1_tp2.json").read_text())["val_loss"]
    for tp in (2, 1):
        assert abs(results[0][f"v1_tp{tp}"] - expected) <= 1e-5 * abs(expected), (tp, results[0][f"v1_tp{tp}"])
