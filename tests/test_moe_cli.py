"""recipes/moe_tiny.yaml through the real CLI (subprocesses): 2 processes at EP=2 fit a small version of it on the
built-in corpus and log the routing (each layer's aux and z-loss, every expert's share of the tokens); the
checkpoint they wrote then resumes on one process at EP=1, which reads all four experts from it.
"""

from __future__ import annotations

import csv
import os
import re
import subprocess
from pathlib import Path

from dist_utils import run_python

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--config", str(ROOT / "recipes" / "moe_tiny.yaml"), "--model.config.hidden_size", "32",
         "--model.config.num_attention_heads", "2", "--model.config.num_query_groups", "1",
         "--model.config.ffn_hidden_size", "64", "--data.global_batch_size", "4", "--data.micro_batch_size", "2",
         "--data.eval_samples", "4", "--trainer.limit_val_batches", "1", "--trainer.log_every_n_steps", "1"]


def _cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    proc = run_python(["-m", "lightning_megatron.cli", *args], tmp_path, dict(os.environ, WANDB_MODE="offline"), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def test_moe_tiny_fits_at_ep2_logs_routing_and_resumes_at_ep1(tmp_path):
    run = tmp_path / "run"
    first = _cli(tmp_path, "fit", *SMALL, "--trainer.max_steps", "2", "--trainer.val_check_interval", "2",
         "--trainer.default_root_dir", str(run))
    [metrics] = list((run / "csv").rglob("metrics.csv"))
    rows = [r for r in csv.DictReader(metrics.open()) if r.get("train_moe/max_load")]
    assert len(rows) == 2, rows
    for row in rows:
        for layer in (0, 1):  # numbered as the checkpoint's decoder.layers.{i} and megatron-core's moe/..._layer_{i}
            loads = [float(row[f"train_moe/load/layer_{layer}/expert_{e}"]) for e in range(4)]
            assert abs(sum(loads) - 1.0) < 1e-5 and min(loads) > 0, loads  # every expert got tokens
            assert 0.0 < float(row[f"train_moe/aux_loss/layer_{layer}"]) < 0.1  # ~ coeff 0.01 when balanced
            assert float(row[f"train_moe/z_loss/layer_{layer}"]) > 0
        assert 1.0 <= float(row["train_moe/max_load"]) <= 4.0
    ckpt = run / "checkpoints" / "last.ckpt"
    assert ckpt.exists()
    # The experts were written under their global indices by two EP ranks; one process takes all of them.
    resumed = _cli(tmp_path, "fit", *SMALL, "--trainer.max_steps", "3", "--trainer.val_check_interval", "3",
                   "--trainer.devices", "1", "--trainer.strategy.init_args.expert_model_parallel_size", "1",
                   "--trainer.default_root_dir", str(tmp_path / "resumed"), "--ckpt_path", str(ckpt))
    steps = [line for line in resumed.stdout.splitlines() if line.startswith("Step ")]
    assert [line.split()[1] for line in steps] == ["3/3"], resumed.stdout[-3000:]
    # the model summary counts the whole model at EP=2 (each rank holds two of the four experts) as one process does
    whole = [re.findall(r"Whole model: ([\d.]+ [KMB]?) ?parameters", p.stdout + p.stderr) for p in (first, resumed)]
    assert whole[0] == whole[1] and len(whole[1]) == 1, whole
    assert "over TP=1 x PP=1 x EP=2;" in first.stdout + first.stderr


def test_moe_tiny_check_measures_what_the_estimate_predicts(tmp_path):
    """``check --estimate-memory`` on the recipe at EP=2, at TP=2 with SP and at CP=2 (one step): the parameters,
    gradients and optimizer state a rank holds are the estimate's exactly, and the activations it saved for the
    backward within 3% (the experts' rows and slots, the router's bookkeeping, the CPU's composite RMSNorm:
    docs/memory.md; an EP rank's share of the rows depends on the routing, the estimate takes the mean: 2.5% here;
    under CP the other ranks' keys and values and the two chunks' contexts beside their concatenation).

    With ``--estimate-time`` the bytes each rank sends, by part, are the time model's within 0.5% (the all-to-alls of
    the routed rows within 5%: the routing's imbalance): under TP the experts' partial outputs weighed and summed,
    then reduced (they all-reduced the ``k`` slots: 15.08 MiB sent at TP=2 with SP, 11.61 now), the routing weights'
    gradient, under SP the tokens' and the routing's gathers (the model counted a dense MLP's: 11 MiB predicted),
    CP's all-gathered keys and values, the dense and the experts' gradients over DP."""
    from check_tables import assert_traffic

    out = _cli(tmp_path, "check", "--config", str(ROOT / "recipes" / "moe_tiny.yaml"), "--layouts", "ep2,tp2sp,cp2",
               "--steps", "1", "--estimate-memory", "--estimate-time").stdout
    assert "ep2            PASS" in out and "tp2sp          PASS" in out and "cp2            PASS" in out, out
    assert_traffic(out, [("ep2", 0), ("tp2sp", 0), ("cp2", 0)], ep=0.05)
    out = out.split("predicted step time")[0]
    rows = [line.split() for line in out.split("memory per rank")[1].splitlines()[2:] if line.strip()]
    assert [r[0] for r in rows] == ["tp1", "ep2", "tp2sp", "cp2"], out
    for row in rows:
        held = [cell.split("/") for cell in row[2:6]]
        assert all(p == m for p, m in held[:3]), row
        predicted, measured = (float(x) for x in held[3])
        assert abs(predicted / measured - 1) < 0.03, row


def test_experts_padded_to_their_capacity_are_predicted_at_every_layout(tmp_path):
    """``check --estimate-memory`` with ``moe_expert_capacity_factor`` 1.5 and the experts padded to it, at CP=2 and
    TP=2 with SP (one step): every expert runs on its capacity, so no routing imbalance, each row within 1%. Under CP
    the capacity is the whole microbatch's (the ranks that split the sequence choose together), so every CP rank
    pads to it: the estimate divided those rows by CP (cp2 16.92 predicted against 22.29 MiB)."""
    out = _cli(tmp_path, "check", "--config", str(ROOT / "recipes" / "moe_tiny.yaml"), "--layouts", "cp2,tp2sp",
               "--steps", "1", "--estimate-memory", "--model.config.moe_expert_capacity_factor", "1.5",
               "--model.config.moe_pad_expert_input_to_capacity", "true").stdout
    assert "cp2            PASS" in out and "tp2sp          PASS" in out, out
    rows = [line.split() for line in out.split("memory per rank")[1].splitlines()[2:] if line.strip()]
    assert [r[0] for r in rows] == ["tp1", "cp2", "tp2sp"], out
    for row in rows:
        predicted, measured = (float(x) for x in row[5].split("/"))
        assert abs(predicted / measured - 1) < 0.01, row
