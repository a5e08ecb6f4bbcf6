"""benchmarks/gpu_check.py is not dead code: its CI-size dry run goes end to end on CPU."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from dist_utils import run_python

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_check_dry_run_on_cpu(tmp_path):
    out = tmp_path / "gpu_check"
    # every part but the test path (this is the test path) and the compile row (slow on 2 cores; tests/test_compile.py)
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--dry-run", "--no-compile",
           "--parts", "env,gemm,bench,decoder,norm,rmsnorm,glu,rope,host,fit", "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = run_python(cmd[1:], tmp_path, env, timeout=600)  # the script; the runs it starts are new interpreters
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["env"]["torch"] == __import__("torch").__version__
    assert results["gemm"]["bf16_tflops"] > 0
    rows = {r["framework"]: r for r in results["bench"]["rows"]}
    assert set(rows) == {"hf", "ours"} and not results["bench"]["errors"], results["bench"]
    for r in rows.values():
        assert r["tokens_per_s"] > 0 and r["steps_timed"] == 2 and r["peak_memory_gib"] > 0 and r["sdpa_kernels"]
        # the profiled warm-up step by kind: its GEMMs (and our fused AdamW) are found, within the step's time
        kinds = r["by_kind_ms"]
        assert kinds["GEMM"] > 0 and (r["framework"] == "hf" or kinds["optimizer step"] > 0), kinds
        assert sum(kinds.values()) <= 1000 * r["profiled_step_s"], (kinds, r["profiled_step_s"])
        assert r["stream_syncs"] == 0  # on CPU no stream: counted on an accelerator only
        # the largest non-GEMM ops by name and shapes: what the kinds' time is made of, within it
        top = r["top_non_gemm_ops"]
        assert top and all(kind != "GEMM" and isinstance(op, str) and op and calls >= 1 and ms > 0
                           for kind, op, shapes, calls, ms in top), top
        assert all(ms <= kinds[kind] + 1e-6 for kind, op, shapes, calls, ms in top), (top, kinds)
    decoder = {r["framework"]: r for r in results["decoder"]["rows"]}
    assert set(decoder) == {"hf", "ours"} and not results["decoder"]["errors"], results["decoder"]
    assert all(r["size"] == "dry-decoder" and r["tokens_per_s"] > 0 and r["steps_timed"] == 2 for r in decoder.values())
    for ours in (rows["ours"], decoder["ours"]):  # check --estimate-time's prediction of the step that ran
        estimate = ours["estimate"]  # the device's work alone, with the host's dispatch, at the measured GEMM rate
        assert 0 < estimate["datasheet_s"] < estimate["with_host_s"] and estimate["measured_gemm_s"] > 0, estimate
        assert estimate["measured_over_measured_gemm_s"] == ours["step_s"] / estimate["measured_gemm_s"]
    assert "hf" in rows and "estimate" not in rows["hf"]
    assert {"decoder_mfu", "decoder_vs_hf"} <= set(results["targets"]), results["targets"]
    norm = results["norm"]  # the grad norm: the library's fused default against fp64 pieces by size
    assert set(norm["ms"]) == {"fused fp64", "64Ki", "1Mi", "16Mi", "256Mi", "foreach fp32"}, norm
    assert all(v > 0 for v in norm["ms"].values()), norm
    assert norm["sums_max_rel_diff"] < 1e-12 and norm["fused_fp64_rel_diff"] < 1e-12, norm
    assert norm["foreach_fp32_rel_diff"] < 1e-5, norm  # fp32 per-tensor norms: within fp32 rounding
    rms = results["rmsnorm"]  # ours (torch's F.rms_norm) against the arithmetic spelled out: timed, the same bits on CPU
    assert set(rms["ms"]) == {"ours", "eager fp32"} and all(v > 0 for v in rms["ms"].values()), rms
    assert rms["output_max_abs_diff"] == 0 and rms["grad_max_abs_diff"] == 0, rms
    glu = results["glu"]  # gated_activation against silu(gate) * up through autograd: the same bits, a third less saved
    assert set(glu["ms"]) == {"ours", "autograd"} and all(v > 0 for v in glu["ms"].values()), glu
    assert glu["output_max_abs_diff"] == 0 and glu["grad_max_abs_diff"] == 0, glu
    assert glu["saved_bytes"] == {"ours": 2 * 256 * 256, "autograd": 2 * 256 * (256 + 128)}, glu
    rope = results["rope"]  # RoPE without rotate_half's copies against the expression through autograd: same bits
    assert set(rope["ms"]) == {"ours", "autograd"} and all(v > 0 for v in rope["ms"].values()), rope
    assert rope["output_max_abs_diff"] == 0 and rope["grad_max_abs_diff"] == 0, rope
    host = results["host"]  # the host's share of a step at bert-base's depth: every phase timed, both frameworks
    assert set(host["ms"]) == {"ours", "ours-zero1", "hf"} and not host["errors"], host
    assert all(0 < ms["forward+backward"] < ms["step"] and ms["optimizer"] > 0 for ms in host["ms"].values()), host
    assert all(ms["ops"] > ms["non-view ops"] > 100 for ms in host["ms"].values()), host  # one step's aten ops
    fit = results["fit"]
    assert fit["returncode"] == 0 and fit["logged_steps"] >= 1 and fit["checkpoint_saved"], fit
    assert (out / "summary.md").read_text().startswith("### GPU check")
    assert {p.name for p in out.iterdir()} <= {"results.json", "summary.md", "tests.log", "junit.xml", "fit.log",
                                               "metrics.csv"}  # within the device tool's 8 files back


def test_gpu_check_covers_the_overlaps():
    """The CUDA test path lists the tests of the overlapped ZeRO-1 parameter all-gather and p2p (they
    exist under these names: a rename would silently drop them from the GPU check)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_check import TEST_FILES

    for path, name in (("tests/test_distributed_optimizer_fit.py", "test_overlap_param_gather_bitwise_equal_to_off"),
                       ("tests/test_checkpoint_zero1.py", "overlap_param_gather=True"),
                       ("tests/test_pipeline_schedules.py", "test_overlap_p2p_comm_is_bitwise"),
                       ("tests/test_deferred_wgrad.py", "test_deferred_linear_gives_autograds_gradients_bitwise")):
        assert path in TEST_FILES and name in (ROOT / path).read_text(), (path, name)
    for entry in TEST_FILES:  # a file, or one test of a file (a node id): each still exists under its name
        path, _, test = entry.partition("::")
        assert (ROOT / path).is_file() and (not test or f"def {test}(" in (ROOT / path).read_text()), entry
