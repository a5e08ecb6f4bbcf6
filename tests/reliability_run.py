"""A short real training run for the fault tests and benchmarks/faults.py (not a test module).

    python tests/reliability_run.py ROOT --devices 2 --max-steps 20 [--fault sigterm|sigterm-job|sigint|sigint2|
        kill0|kill1|raise1|usr1 --fault-step 3] [--ckpt-path last] [--every 2] [--prewarm] [--wandb]
        [--workers N] [--then-validate]

Tiny BERT on synthetic batches under MegatronStrategy (TP = devices), launched by Lightning's own
subprocess launcher (rank 0 is the launcher). Every rank appends ``step wall_time`` to
``ROOT/progress-<rank>.txt`` after each step (then Lightning's ``_batches_that_stepped``, the step its loggers
write, and ``total_batch_idx``, which schedules validation: both ``step - 1`` there) and writes the step it starts
from to ``ROOT/start-<rank>.txt`` and its pid to ``ROOT/pid-<rank>.txt``.

The fault is injected at the end of step ``--fault-step`` by rank 0, and its time written to ``ROOT/fault.txt``:

- sigterm: SIGTERM to rank 0's own process, as a scheduler would;
- sigterm-job: the same after SIGTERM to the job's other processes (W&B's service, the ranks' data workers), which a
  signal to every process of the job (SLURM's time limit, ``scancel``) reaches too (rank 1 left out: the ranks'
  agreement stops it);
- sigint: SIGINT to the job's process group, as Ctrl-C in a terminal (start the script in a session of its own);
  sigint2: two of them 0.5 s apart;
- kill0: SIGKILL of rank 0; kill1 / raise1: rank 1 is SIGKILLed / raises;
- usr1: SIGUSR1 to every rank, as SLURM's ``--signal=USR1@90`` signals every task (start each rank as a SLURM task,
  its ``SLURM_*`` variables set).

``--then-validate``: after the fit, ``trainer.validate`` of 8 batches, rank 1 sending SIGTERM to itself alone at the
first. Checkpoints: ``ROOT/ckpt`` every ``--every`` steps. ``--wandb``: the recipes' W&B logger, offline, in
``ROOT/wandb``. ``--prewarm``: ranks 1.. start before torch is imported and wait for Lightning's command
(``lightning_megatron.launch.prewarm``), as the ``lightning-megatron`` command starts them.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--fault", choices=["none", "sigterm", "sigterm-job", "sigint", "sigint2", "kill0", "kill1",
                                            "raise1", "usr1"],
                        default="none")
    parser.add_argument("--fault-step", type=int, default=3)
    parser.add_argument("--mid", action="store_true",
                        help="inject the fault inside the next step's forward (peers then wait in a TP collective)")
    parser.add_argument("--ckpt-path", default=None)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=1800, help="collective timeout (s); 1800 is the default")
    parser.add_argument("--gloo", action="store_true", help="no CPU tuning: torch.distributed (gloo) collectives")
    parser.add_argument("--prewarm", action="store_true", help="start ranks 1.. now, as lightning-megatron does")
    parser.add_argument("--wandb", action="store_true", help="log to W&B offline (ROOT/wandb), as the recipes do")
    parser.add_argument("--workers", type=int, default=0, help="DataLoader worker processes of each rank")
    parser.add_argument("--then-validate", action="store_true",
                        help="after the fit, validate 8 batches, rank 1 SIGTERMing itself at the first")
    a = parser.parse_args()
    if a.prewarm:
        from lightning_megatron.launch import prewarm

        prewarm(["--trainer.devices", str(a.devices)])

    import torch
    from lightning.pytorch import Callback, Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_megatron.models.bert.module import BertLightningModule
    from lightning_megatron.strategy import MegatronStrategy
    from megatron_testing import TINY_MODEL, dataloader

    torch.set_num_threads(1)
    root = Path(a.root)
    root.mkdir(parents=True, exist_ok=True)

    class Faults(Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            (root / f"start-{trainer.global_rank}.txt").write_text(str(trainer.global_step))
            (root / f"pid-{trainer.global_rank}.txt").write_text(str(os.getpid()))

        def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
            if a.then_validate and trainer.state.fn == "validate" and trainer.global_rank == 1 and batch_idx == 0:
                os.kill(os.getpid(), signal.SIGTERM)  # this rank alone: the others are in the model's collectives

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            rank, step, loop = trainer.global_rank, trainer.global_step, trainer.fit_loop.epoch_loop
            with open(root / f"progress-{rank}.txt", "a") as fh:  # and the batch counts logging and validation read
                fh.write(f"{step} {time.time():.3f} {loop._batches_that_stepped} {loop.total_batch_idx}\n")
            if step != a.fault_step or a.fault == "none":
                return
            if a.mid:  # at the start of the next step's first forward, before its TP collectives
                handle = []

                def hook(module, args) -> None:
                    handle[0].remove()
                    self.inject(trainer.global_rank, step)

                handle.append(pl_module.model_chunks[0].register_forward_pre_hook(hook))
                return
            self.inject(rank, step)

        @staticmethod
        def inject(rank: int, step: int) -> None:
            if rank == 0:
                (root / "fault.txt").write_text(f"{a.fault} {step} {time.time():.3f}")
            if a.fault == "sigterm-job" and rank == 0:  # the job's other processes first: W&B's service, the ranks'
                import psutil  # data workers (rank 1 itself left out: the ranks' agreement stops it)

                rank1 = int((root / "pid-1.txt").read_text())
                others = [p for p in psutil.Process().children(recursive=True) if p.pid != rank1]
                names = [(p, p.name(), " ".join(p.cmdline())) for p in others]
                assert {n for _, n, _ in names} >= ({"pt_data_worker"} if a.workers else set()), names
                for p in others:
                    p.send_signal(signal.SIGTERM)
                psutil.wait_procs([p for p, _, line in names if "wandb-core" in line], timeout=30)
            if a.fault in ("sigterm", "sigterm-job") and rank == 0:
                os.kill(os.getpid(), signal.SIGTERM)
            elif a.fault in ("sigint", "sigint2") and rank == 0:
                os.killpg(os.getpgid(0), signal.SIGINT)
                if a.fault == "sigint2":
                    time.sleep(0.5)  # a person pressing Ctrl-C again
                    os.killpg(os.getpgid(0), signal.SIGINT)
            elif a.fault == "kill0" and rank == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            elif a.fault == "kill1" and rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            elif a.fault == "usr1" and rank == 0:
                for r in range(a.devices):
                    os.kill(int((root / f"pid-{r}.txt").read_text()), signal.SIGUSR1)
            elif a.fault == "raise1" and rank == 1:
                raise RuntimeError(f"injected failure on rank 1 at step {step}")

    strategy = MegatronStrategy(tensor_model_parallel_size=a.devices, micro_batch_size=4, timeout=a.timeout,
                                cpu_tuning=not a.gloo)
    checkpoint = ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=a.every, save_top_k=-1, save_last=True)
    logger = False
    if a.wandb:
        from lightning_megatron.loggers import WandbLogger

        os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true")
        logger = WandbLogger(project="reliability", save_dir=str(root))
    trainer = Trainer(accelerator="cpu", devices=a.devices, strategy=strategy, max_steps=a.max_steps, logger=logger,
                      log_every_n_steps=1, callbacks=[Faults(), checkpoint], enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                      use_distributed_sampler=False)
    model = BertLightningModule(**TINY_MODEL)
    trainer.fit(model, train_dataloaders=dataloader(8, 1, 0, num_workers=a.workers), ckpt_path=a.ckpt_path)
    if a.then_validate:
        trainer.limit_val_batches = 8
        trainer.validate(model, dataloaders=dataloader(8, 1, 0))


if __name__ == "__main__":
    main()
