"""bench/performance_doc.py: docs/performance.md is what the script makes of bench/results/*.json, and
the script turns a results file into its figures, the same way every time."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "performance_doc.py")


def _run(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=120)


def test_committed_document_is_current():
    result = _run("--check")
    assert result.returncode == 0, result.stderr + "\nrun: python bench/performance_doc.py"


def _tiny_results(folder):
    """One benchmark file: a made-up device at 1000 GB/s, a forward that moves 2 GB (floor 2 ms)."""
    os.makedirs(folder)
    row = dict(dtype="bfloat16", mode="add", tokens=524288, d_model=1024, vocab=32768, bytes=2_000_000_000,
               peak_mem_bytes=None, GBps=0.0)
    document = {"device": "Test GPU 9000", "torch": "9.9.9", "triton": "8.8.8", "cuda": "7.7", "date": "2030-01-02",
                "copy_GBps": 1000.0,
                "cases": [dict(row, op="forward", impl="eager", median_ms=10.0),
                          dict(row, op="forward", impl="triton", median_ms=2.5),
                          dict(row, op="forward", impl="cuda", median_ms=2.0)]}
    with open(os.path.join(folder, "test-gpu-9000.json"), "w", encoding="utf-8") as f:
        json.dump(document, f)


def test_a_tiny_results_file(tmp_path):
    results, out = str(tmp_path / "results"), str(tmp_path / "performance.md")
    _tiny_results(results)
    assert _run("--check", "--results", results, "--out", out).returncode == 1  # nothing written yet
    assert _run("--results", results, "--out", out).returncode == 0
    with open(out, encoding="utf-8") as f:
        text = f.read()
    # Its device, versions and date; the floor (2 GB at 1000 GB/s) and each fused time's share of it.
    assert "### Test GPU 9000" in text
    assert "torch 9.9.9, Triton 8.8.8, CUDA 7.7" in text and "2030-01-02" in text
    assert "| headline (524288 x 1024, V 32768) | forward | 2.000 | 2.00 | 10.0 | 2.50 (80%) | 2.00 (100%) |" in text
    assert "| Test GPU 9000 | headline (524288 x 1024, V 32768) | forward | triton | 2.00 | 2.50 | 80.0% |" in text
    # The same results give the same document, which --check then accepts; an edit makes it stale.
    assert _run("--results", results, "--out", out).returncode == 0
    with open(out, encoding="utf-8") as f:
        assert f.read() == text
    assert _run("--check", "--results", results, "--out", out).returncode == 0
    with open(out, "a", encoding="utf-8") as f:
        f.write("hand edit\n")
    assert _run("--check", "--results", results, "--out", out).returncode == 1


def test_a_backward_cost_file(tmp_path):
    """bench/backward_cost.py's file: per token count and dtype, a row per backend and chunk with the floor's
    and the kernels' share of the copy bandwidth."""
    results, out = str(tmp_path / "results"), str(tmp_path / "performance.md")
    _tiny_results(results)
    row = dict(tokens=524288, touched_rows=32768, dtype="bfloat16", backend="cuda", chunk=256, partial_rows=3848,
               floor_bytes=1_000_000_000, kernel_bytes=1_200_000_000, backward_ms=1.25, sort_ms=0.05,
               zero_fill_ms=0.2, kernels_ms=1.0)
    document = dict(what="dense weight-gradient backward by part and chunk length (bench/backward_cost.py)",
                    device="Test GPU 9000", torch="9.9.9", date="2030-01-02", width=1024, vocab=32768,
                    copy_GBps=1000.0, timed_region="backend.backward alone", results=[row])
    with open(os.path.join(results, "backward-cost-test-gpu-9000.json"), "w", encoding="utf-8") as f:
        json.dump(document, f)
    assert _run("--results", results, "--out", out).returncode == 0
    with open(out, encoding="utf-8") as f:
        text = f.read()
    assert "`bench/backward_cost.py`" in text
    assert "524288 tokens (32768 rows touched), bfloat16: floor 1.000 GB; the sort alone 0.050 ms" in text
    # 1 GB in 1.25 ms at 1000 GB/s: 80% of the floor; 1.2 GB in the kernels' 1.0 ms: 120% of copy.
    assert "| cuda | 256 | 3848 | 1.200 | 1.25 | 80% | 1.00 | 120% |" in text


def test_a_dropout_cost_file(tmp_path):
    """bench/dropout_cost.py's file (what bench/gpu_proof.sh's 'dropout' step keeps): a row per shape,
    implementation and op, with its share of the copy bandwidth."""
    results, out = str(tmp_path / "results"), str(tmp_path / "performance.md")
    _tiny_results(results)
    row = dict(shape=[16, 8192, 1024, 32768, "add"], impl="cuda p=0.1", op="step", median_ms=2.5,
               bytes=2_000_000_000, GBps=800.0)
    document = dict(what="dropout's cost in the forward and a training step (bench/dropout_cost.py)",
                    device="Test GPU 9000", torch="9.9.9", date="2030-01-02", copy_GBps=1000.0, p=0.1,
                    dtype="bfloat16", rows=[row])
    with open(os.path.join(results, "dropout-cost-test-gpu-9000.json"), "w", encoding="utf-8") as f:
        json.dump(document, f)
    assert _run("--results", results, "--out", out).returncode == 0
    with open(out, encoding="utf-8") as f:
        text = f.read()
    assert "a kind this script does not know" not in text and "`bench/dropout_cost.py`" in text
    assert "Dropout (p = 0.1)" in text
    assert "| 16, 8192, 1024, 32768, add | cuda p=0.1 | step | 2.50 | 80% |" in text  # 800 of 1000 GB/s


def test_a_cpu_benchmark_names_its_bandwidth(tmp_path):
    """A CPU run's bandwidth is the gather + write bandwidth of torch.index_select, not a copy bandwidth."""
    results, out = str(tmp_path / "results"), str(tmp_path / "performance.md")
    _tiny_results(results)
    path = os.path.join(results, "test-gpu-9000.json")
    with open(path, encoding="utf-8") as f:
        document = json.load(f)
    document["device"] = "CPU Test 9000, 2 threads"
    with open(path, "w", encoding="utf-8") as f:
        json.dump(document, f)
    assert _run("--results", results, "--out", out).returncode == 0
    with open(out, encoding="utf-8") as f:
        text = f.read()
    assert "Gather + write bandwidth (torch.index_select) 1000 GB/s in the same run" in text
    assert "Copy bandwidth 1000 GB/s" not in text
