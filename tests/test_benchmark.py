"""The benchmark harness (posenc_fast.benchmark) on CPU: byte model, case selection, JSON schema,
table, targets, device slug, and ``python -m posenc_fast bench`` end to end on tiny sizes.

No timing is checked here (CPU numbers mean nothing); the GPU measurements are bench/'s.
"""

import json
import math
import os

import pytest
import torch

from posenc_fast import benchmark as bench
from posenc_fast import cli

from cases import backend_targets

# The results schema, written out independently of the module under test.
DOCUMENT_TYPES = {"device": str, "torch": str, "triton": str, "cuda": str, "date": str, "copy_GBps": float,
                  "cases": list}
ROW_TYPES = {"op": str, "impl": str, "dtype": str, "mode": str, "tokens": int, "d_model": int, "vocab": int,
             "median_ms": float, "bytes": int, "GBps": float, "peak_mem_bytes": (int, type(None))}
ROW_ENUMS = {"op": {"forward", "backward", "step"},
             "impl": {"eager", "compile", "compile-max-autotune", "triton", "cuda", "cpu"},
             "mode": {"add", "concat"}}

N_HEADLINE = 64 * 8192  # 2^19 tokens


def check_schema(doc):
    assert set(doc) == set(DOCUMENT_TYPES)
    for key, kind in DOCUMENT_TYPES.items():
        assert isinstance(doc[key], kind), key
    assert len(doc["date"]) == 10 and doc["date"][4] == "-" and doc["date"][7] == "-"
    for row in doc["cases"]:
        assert set(row) == set(ROW_TYPES)
        for key, kind in ROW_TYPES.items():
            assert isinstance(row[key], kind) and not isinstance(row[key], bool), (key, row[key])
        for key, allowed in ROW_ENUMS.items():
            assert row[key] in allowed, (key, row[key])


# ---- byte model, against numbers worked out by hand --------------------------------------------

def test_bytes_headline_bf16_add():
    case = bench.CASE_BY_NAME["headline"]
    assert (case.tokens, case.d_model, case.vocab, case.dtype, case.mode) == (N_HEADLINE, 1024, 32768,
                                                                               torch.bfloat16, "add")
    ids = 8 * 2**19                      # 4 MiB of int64 ids
    rows = 2**19 * 1024 * 2              # one bf16 row of 1024 per token: 1 GiB
    out = 2**19 * 1024 * 2               # 1 GiB
    grad_weight = 32768 * 1024 * 2       # the dense gradient, written once (zero rows included): 64 MiB
    assert bench.bytes_moved("forward", case) == ids + rows + out == 2_151_677_952
    assert bench.bytes_moved("backward", case) == rows + ids + grad_weight == 1_145_044_992
    assert bench.bytes_moved("step", case) == 2_151_677_952 + 1_145_044_992


def test_bytes_concat_reads_only_token_columns():
    case = bench.CASE_BY_NAME["headline-concat"]
    assert case.token_width == 1024 - 64 and case.d_pos == 64
    # forward: ids + 960-wide rows + 1024-wide output; backward: grad_out's 960 token columns + ids + [V, 960]
    assert bench.bytes_moved("forward", case) == 4_194_304 + 1_006_632_960 + 1_073_741_824
    assert bench.bytes_moved("backward", case) == 1_006_632_960 + 4_194_304 + 62_914_560


def test_bytes_wide_and_fp32():
    wide = bench.CASE_BY_NAME["wide"]
    assert wide.tokens == 65536 and wide.vocab == 262144
    # the large-vocabulary backward is dominated by the 2 GiB gradient
    expected = 65536 * 4096 * 2 + 65536 * 8 + 262144 * 4096 * 2
    assert bench.bytes_moved("backward", wide) == expected == 2_684_878_848
    fp32 = bench.CASE_BY_NAME["headline-fp32"]
    assert bench.bytes_moved("forward", fp32) == 4_194_304 + 2 * 2**31
    with pytest.raises(ValueError):
        bench.bytes_moved("inference", fp32)


def test_floor_ms_uses_the_copy_bandwidth():
    case = bench.CASE_BY_NAME["headline"]
    # 3000 GB/s is 3e12 B/s: 0.717 ms
    assert math.isclose(bench.floor_ms("forward", case, 3000.0), 2_151_677_952 / 3e12 * 1e3)


# ---- cases ---------------------------------------------------------------------------------------

def test_case_selection():
    assert [c.name for c in bench.select_cases(quick=True)] == ["headline", "decode"]
    default = bench.select_cases()
    assert default[0].name == "headline" and not any(c.full_only for c in default)
    assert {c.name for c in default} >= {"headline", "wide", "decode", "headline-concat", "headline-fp32"}
    sweep = [c.tokens for c in bench.select_cases(["sweep"])]
    assert sweep == sorted(sweep) and sweep[0] == 4096 and sweep[-1] == 1 << 20
    assert [c.name for c in bench.select_cases(["decode", "wide*"])] == ["decode", "wide", "wide-concat", "wide-fp32"]
    assert [c.name for c in bench.select_cases(["headline"])] == ["headline"], "a case name wins over its group"
    assert len(bench.select_cases(["headline*"])) == 4
    assert all(c.autotune and (c.latency or c.ops == bench.OPS) for c in bench.select_cases(full=True))
    with pytest.raises(ValueError, match="no case matches"):
        bench.select_cases(["nonsense"])
    with pytest.raises(ValueError, match="pass either it or a case list"):  # not one of them silently ignored
        bench.select_cases(["decode"], quick=True)


def test_cpu_case_selection_is_realistic_sizes():
    """On CPU the default list is the CPU cases, at sizes people run (>= 4096 tokens, d_model >= 512)."""
    default = bench.select_cases(device_type="cpu")
    assert default and default[0].name == "cpu-headline"
    assert all(c.device_type == "cpu" and c.tokens >= 4096 and c.d_model >= 512 for c in default)
    assert all(c.ops == bench.OPS for c in default), "forward, backward and step"
    assert [c.name for c in bench.select_cases(quick=True, device_type="cpu")] == ["cpu-headline"]
    assert {c.name for c in bench.select_cases(full=True, device_type="cpu")} > {c.name for c in default}
    assert not any(c.device_type == "cpu" for c in bench.select_cases())
    assert bench.CPU_DEFAULT_IMPLS == ("eager", "compile", "cpu")


def test_decode_is_a_latency_case():
    decode = bench.CASE_BY_NAME["decode"]
    assert decode.tokens == 64 and decode.d_model == 4096 and decode.latency and decode.ops == ("forward",)


def test_cpu_sizes_are_tiny_and_keep_the_shape_of_the_case():
    cpu = torch.device("cpu")
    for case in (c for c in bench.CASES if c.device_type == "cuda"):
        small = bench.for_device(case, cpu)
        assert small.tokens <= 4096 and small.d_model <= 128 and small.token_width >= 1
        assert (small.mode, small.dtype, small.ops) == (case.mode, case.dtype, case.ops)
    assert bench.for_device(bench.CASE_BY_NAME["decode"], cpu).tokens == 64
    assert bench.for_device(bench.CASE_BY_NAME["cpu-headline"], cpu) == bench.CASE_BY_NAME["cpu-headline"]


def test_device_slug():
    assert bench.device_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert bench.device_slug("NVIDIA H200") == "nvidia-h200"
    assert bench.device_slug("  NVIDIA A100-SXM4-40GB ") == "nvidia-a100-sxm4-40gb"
    assert bench.device_slug("cpu") == "cpu"


# ---- results: schema, table, targets -------------------------------------------------------------

def _measurement(case, op, impl, ms, peak=None):
    return bench.Measurement(case, op, impl, ms, 5.0, peak)


def _synthetic(copy_GBps=3000.0):
    """Headline and decode rows where triton meets every target and cuda misses some."""
    h, d = bench.CASE_BY_NAME["headline"], bench.CASE_BY_NAME["decode"]
    floor = {op: bench.floor_ms(op, h, copy_GBps) for op in bench.OPS}
    ms = {  # op: (eager, compile, compile-max-autotune, triton, cuda)
        "forward": (4 * floor["forward"], 1.3 * floor["forward"], 1.25 * floor["forward"], 1.1 * floor["forward"],
                    2.0 * floor["forward"]),
        "backward": (3.0, 2.0, 2.5, 1.0, 1.9),
        "step": (7.0, 3.0, 2.9, 2.0, 2.8),
    }
    rows = []
    for op, times in ms.items():
        for impl, t in zip(("eager", "compile", "compile-max-autotune", "triton", "cuda"), times):
            peak = {"eager": 4 << 30, "triton": 1 << 30, "cuda": 5 << 30}.get(impl, 2 << 30) if op == "step" else None
            rows.append(_measurement(h, op, impl, t, peak))
    rows += [_measurement(d, "forward", "eager", 0.060), _measurement(d, "forward", "triton", 0.025),
             _measurement(d, "forward", "cuda", 0.040)]
    return rows


def test_measurement_json_and_validation():
    copy = 3000.0
    doc = bench.make_document(torch.device("cpu"), copy, _synthetic(copy) + [
        _measurement(bench.CASE_BY_NAME["decode"], "forward", "torch", 1.0)])
    check_schema(doc)
    assert bench.validate_document(doc) == []
    assert all(r["impl"] != "torch" for r in doc["cases"]), "torch is not in the schema's impl enum"
    row = doc["cases"][0]
    assert row["bytes"] == 2_151_677_952 and math.isclose(row["GBps"], row["bytes"] / (row["median_ms"] * 1e6))
    bad = json.loads(json.dumps(doc))
    bad["cases"][0]["impl"] = "torch"
    bad["cases"][1]["extra"] = 1
    bad["cases"][2]["tokens"] = 1.5
    bad["date"] = "21/11/2026"
    problems = bench.validate_document(bad)
    assert len(problems) == 4, problems


def test_speedups_and_targets():
    copy = 3000.0
    rows = [m.as_json() for m in _synthetic(copy)]
    x = bench.speedups(rows)
    fwd = next(r for r in rows if r["op"] == "forward" and r["impl"] == "triton")
    x_eager, x_compile = x[bench._key(fwd) + ("triton",)]
    assert math.isclose(x_eager, 4 / 1.1) and math.isclose(x_compile, 1.25 / 1.1), "over the faster compile mode"
    lines = bench.target_report(rows, copy, bench.CASE_BY_NAME["headline"], bench.CASE_BY_NAME["decode"],
                                {"triton": True, "cuda": False})
    text = "\n".join(lines)
    triton_part, cuda_part = text.split("  cuda:")
    assert "MISSED" not in triton_part and triton_part.count(" ok") == 10, triton_part
    assert "forward 50.00% of copy (>= 85%) MISSED" in cuda_part
    assert "backward deterministic: MISSED" in cuda_part
    assert "step peak memory 5120 MiB vs eager 4096 MiB MISSED" in cuda_part


def test_table_prints_every_row(capsys):
    copy = 3000.0
    measurements = _synthetic(copy)
    table = bench.format_table(measurements, copy, device="test GPU", notes=["a note"])
    lines = table.splitlines()
    assert "id range check OFF" in lines[0] and "test GPU" in lines[0]
    header = next(line for line in lines if line.startswith("case"))
    for column in ("median ms", "MB", "GB/s", "%copy", "x eager", "x compile", "peak MiB"):
        assert column in header
    assert sum(line.startswith("headline ") for line in lines) == 15 and lines[-1] == "a note"
    fwd_triton = next(line for line in lines if "forward" in line and "triton" in line and line.startswith("headline"))
    assert " 91 " in fwd_triton  # 1 / 1.1 of the copy bandwidth, in %


def test_summarize_reads_a_results_file(tmp_path, capsys):
    copy = 3000.0
    path = tmp_path / "nvidia-test.json"
    bench.write_document(str(path), bench.make_document(torch.device("cpu"), copy, _synthetic(copy)))
    assert cli.main(["bench", "--summarize", str(path)]) == 0
    out = capsys.readouterr().out
    assert "targets" in out and "triton:" in out and "not checked here" in out


# ---- the command, end to end on CPU ----------------------------------------------------------------

def test_bench_command_end_to_end_on_cpu(tmp_path, capsys):
    out_dir = tmp_path / "results"
    code = cli.main(["bench", "--device", "cpu", "--cases", "headline,decode", "--impls", "eager,torch",
                     "--out", str(out_dir)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    with open(out_dir / CPU_JSON(), encoding="utf-8") as f:
        doc = json.load(f)
    check_schema(doc)
    assert doc["device"] == f"CPU {bench.cpu_model()}, {torch.get_num_threads()} threads"
    assert doc["cuda"] == (torch.version.cuda or "none") and doc["copy_GBps"] > 0
    cpu = torch.device("cpu")
    headline, decode = (bench.for_device(bench.CASE_BY_NAME[n], cpu) for n in ("headline", "decode"))
    got = {(r["op"], r["tokens"]) for r in doc["cases"]}
    assert got == {("forward", headline.tokens), ("backward", headline.tokens), ("step", headline.tokens),
                   ("forward", decode.tokens)}
    assert all(r["impl"] == "eager" and r["median_ms"] > 0 and r["peak_mem_bytes"] is None for r in doc["cases"])
    for r in doc["cases"]:
        case = headline if r["tokens"] == headline.tokens else decode
        assert r["bytes"] == bench.bytes_moved(r["op"], case)
    assert "id range check OFF" in printed and "median ms" in printed
    assert printed.count("torch ") >= 4, "torch rows are printed though not written"
    assert "backward deterministic (two runs bitwise equal), torch: yes" in printed
    if _has_matplotlib():
        assert os.path.getsize(out_dir / CPU_JSON().replace(".json", ".png")) > 1000
    else:
        assert "no plot" in printed


def test_bench_command_default_output_folder(tmp_path, monkeypatch, capsys):
    """Without --out: a folder of that clear name in the current directory, and the paths printed."""
    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench", "--device", "cpu", "--cases", "decode", "--impls", "eager", "--ops", "forward"]) == 0
    printed = capsys.readouterr().out
    folder = tmp_path / bench.cli.DEFAULT_OUT
    assert os.listdir(tmp_path) == [bench.cli.DEFAULT_OUT]
    assert (folder / CPU_JSON()).is_file()
    assert f"results go to {folder}" in printed and f"wrote {folder / CPU_JSON()}" in printed


def CPU_JSON():
    return bench.device_slug(bench.device_name(torch.device("cpu"))) + ".json"


def test_bench_command_times_the_cpu_backend_on_cpu(tmp_path, capsys):
    """--device cpu: the CPU case at its real size, the native CPU backend beside eager (compile left
    out here for the test's time), its rows in the JSON, and the CPU targets read against the
    measured gather + write floor.  No timing is asserted: only that each was measured and reported."""
    code = cli.main(["bench", "--device", "cpu", "--quick", "--impls", "eager,cpu", "--ops", "forward,step",
                     "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    with open(tmp_path / CPU_JSON(), encoding="utf-8") as f:
        doc = json.load(f)
    check_schema(doc)
    case = bench.CASE_BY_NAME["cpu-headline"]
    got = {(r["op"], r["impl"]) for r in doc["cases"]}
    assert got == {(op, impl) for op in ("forward", "step") for impl in ("eager", "cpu")}
    for r in doc["cases"]:
        assert r["tokens"] == case.tokens == 4096 and r["d_model"] == 512 and r["median_ms"] > 0
        assert r["bytes"] == bench.bytes_moved(r["op"], case) and math.isclose(r["GBps"], r["bytes"] / r["median_ms"] / 1e6)
    assert "gather + write floor" in printed
    assert "targets (cpu-headline: 4096 tokens x 512" in printed and "no fused implementation" not in printed
    for target in ("% of floor (>= 70%)", "over eager (>= 2x)", "forward x_compile: no baseline", "step "):
        assert target in printed, target
    assert "cpu-headline forward, cpu, with the id range check ON" in printed and "with it off" in printed


def test_bench_command_rejects_unknown_names(capsys):
    assert cli.main(["bench", "--device", "cpu", "--impls", "eager,fast"]) == 2
    assert cli.main(["bench", "--device", "cpu", "--cases", "nonsense"]) == 2
    assert "unknown implementation fast" in capsys.readouterr().err


def test_a_run_that_measures_nothing_keeps_the_results_file(tmp_path, capsys):
    """An implementation this machine cannot run (triton on CPU) measures nothing: the results file and plot
    of an earlier run stay as they were, and the command fails, naming why."""
    path, png = tmp_path / CPU_JSON(), tmp_path / CPU_JSON().replace(".json", ".png")
    assert cli.main(["bench", "--device", "cpu", "--cases", "decode", "--impls", "eager", "--ops", "forward",
                     "--out", str(tmp_path)]) == 0
    png.write_bytes(b"an earlier plot")
    before = path.read_bytes()
    capsys.readouterr()
    assert cli.main(["bench", "--device", "cpu", "--cases", "decode", "--impls", "triton", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "skipped triton" in err and "nothing was measured" in err and str(path) in err
    assert path.read_bytes() == before and png.read_bytes() == b"an earlier plot"
    # Rows of the torch reference only (printed, never kept in the JSON): the same.
    assert cli.main(["bench", "--device", "cpu", "--cases", "decode", "--impls", "torch", "--out", str(tmp_path)]) == 0
    assert "is left as it was" in capsys.readouterr().out
    assert path.read_bytes() == before and png.read_bytes() == b"an earlier plot"
    # A run with no forward to plot rewrites the file: the earlier plot, which no longer shows it, goes.
    assert cli.main(["bench", "--device", "cpu", "--cases", "headline", "--impls", "eager", "--ops", "backward",
                     "--out", str(tmp_path)]) == 0
    assert path.read_bytes() != before and not png.exists()


def test_cuda_impl_is_skipped_cleanly_without_a_gpu():
    reason = bench.impl_unavailable("cuda", torch.device("cpu"))
    assert reason is not None and "cuda" in reason.lower()
    assert bench.impl_unavailable("triton", torch.device("cpu")) is not None
    assert bench.impl_unavailable("eager", torch.device("cpu")) is None


def _has_matplotlib():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_merge_keeps_rows_not_measured_again(tmp_path):
    copy = 3000.0
    cpu = torch.device("cpu")
    h, d = bench.CASE_BY_NAME["headline"], bench.CASE_BY_NAME["decode"]
    earlier = bench.make_document(cpu, copy, [_measurement(h, "forward", "eager", 4.0),
                                              _measurement(d, "forward", "eager", 0.05)])
    path = tmp_path / "cpu.json"
    bench.write_document(str(path), earlier)
    kept, note = bench.rows_to_merge(str(path), cpu)
    assert len(kept) == 2 and "merged with" in note
    doc = bench.make_document(cpu, copy, [_measurement(h, "forward", "eager", 3.0)], kept)
    assert sorted((r["tokens"], r["median_ms"]) for r in doc["cases"]) == [(64, 0.05), (h.tokens, 3.0)]
    earlier["device"] = "NVIDIA Other"
    bench.write_document(str(path), earlier)
    with pytest.raises(bench.MergeError, match="measured on"):
        bench.rows_to_merge(str(path), cpu)
    path.write_text("{ not json")  # a file cut short: named, not json's traceback
    with pytest.raises(bench.MergeError, match="cannot read"):
        bench.rows_to_merge(str(path), cpu)


def test_a_failing_implementation_keeps_what_was_measured(tmp_path, monkeypatch):
    def broken_step(runner, inputs):
        raise RuntimeError("step exploded")

    monkeypatch.setattr(bench.run, "step_fn", broken_step)  # the name the run module calls
    report = bench.run_benchmark([bench.CASE_BY_NAME["headline"]], ["eager"], torch.device("cpu"), str(tmp_path),
                                 log=lambda line: None)
    assert [m.op for m in report.measurements] == ["forward", "backward"]
    assert report.failures == ["headline eager: RuntimeError: step exploded"]
    with open(report.json_path, encoding="utf-8") as f:
        assert len(json.load(f)["cases"]) == 2


def _cost_script(tmp_path, script: str, *args) -> dict:
    """Run bench/<script>.py --smoke with ``args`` and ``--out tmp_path``; its JSON (<script>.json there)."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run([sys.executable, os.path.join(root, "bench", script + ".py"), "--smoke", *args,
                             "--out", str(tmp_path)], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((tmp_path / (script + ".json")).read_text())


def test_dropout_cost_script_smoke(tmp_path):
    """bench/dropout_cost.py (the GPU stage 'dropout') runs end to end on tiny CPU shapes."""
    doc = _cost_script(tmp_path, "dropout_cost")
    impls = {row["impl"] for row in doc["rows"]}
    assert impls == {"torch p=0", "torch p=0.1", "eager p=0.1"}
    assert all(row["median_ms"] > 0 and row["bytes"] > 0 for row in doc["rows"])


def test_sparse_gradient_cost_script_smoke(tmp_path):
    """bench/sparse_gradient_cost.py runs end to end on a tiny table (a run of the script, not a timing)."""
    doc = _cost_script(tmp_path, "sparse_gradient_cost", "--device", "cpu", "--tokens", "64,256")
    assert {(row["impl"], row["sparse"], row["tokens"]) for row in doc["rows"]} == {("zero-fill", False, 0)} | {
        (impl, sparse, tokens) for impl in ("fused", "nn.Embedding") for sparse in (False, True) for tokens in (64, 256)}
    assert all(row["backward_ms"] > 0 for row in doc["rows"]) and doc["device"].startswith("CPU")


def test_backward_cost_script_smoke(tmp_path):
    """bench/backward_cost.py (the GPU stage 'backward') runs end to end on a tiny case: every (backend,
    chunk) timed and checked against the float64 sum, its parts beside it (a run of the script, not a
    timing)."""
    doc = _cost_script(tmp_path, "backward_cost", "--dtypes", "float32", "--chunks", "3,32")
    assert {row["chunk"] for row in doc["results"]} == {3, 32} and {row["backend"] for row in doc["results"]} >= {
        "triton"}
    assert all(row["backward_ms"] > 0 and row["sort_ms"] > 0 and row["partial_rows"] > 0 for row in doc["results"])


@pytest.mark.parametrize("chunk", [1, 3, 5, 32])
@pytest.mark.parametrize("vocab,tokens", [(3, 97), (40, 300), (500, 300)])
@pytest.mark.parametrize("backend,device", [t for t in backend_targets() if t.values[0] in ("cuda", "triton")])
def test_backward_cost_counts_the_partial_rows_the_kernel_writes(backend, device, vocab, tokens, chunk, monkeypatch):
    """backward_cost.partial_rows, the byte model's partials, is the number of rows the weight gradient's first
    kernel writes into its NaN-poisoned partials buffer (runs of many lengths crossing chunks of 1 to 32
    tokens), on both GPU backends."""
    import sys

    from posenc_fast import _dispatch
    from posenc_fast.backends import sort_ids_for_gradient

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    from backward_cost import partial_rows

    module, buffers = _dispatch.BACKENDS[backend], []
    new_buffer = module.new_buffer
    monkeypatch.setattr(module, "new_buffer", lambda *args: buffers.append(new_buffer(*args)) or buffers[-1])
    monkeypatch.setattr(module, "GRAD_CHUNK", chunk)
    g = torch.Generator().manual_seed(vocab + tokens)
    ids = torch.randint(0, vocab, (tokens,), generator=g).to(device)
    module.backward(torch.randn(tokens, 16, generator=g).to(device), ids, vocab, 16, 1.0, -1, torch.float32, None)
    written = int((~buffers[-1].reshape(-1, 16).isnan().all(dim=1)).sum())
    assert written == partial_rows(sort_ids_for_gradient(ids, vocab)[0], chunk)


def test_host_overhead_script_smoke(tmp_path):
    """bench/host_overhead.py (the host-time table) runs end to end on small tables: every backend and
    entry point, inference and training, and eager's row (a run of the harness, not a timing)."""
    import subprocess
    import sys

    from cases import cpu_extension_problem, host_emulation_build

    # (Built, not loaded here: on a GPU this process's cuda backend must keep the real extension.)
    _, problem = host_emulation_build()
    if problem is not None:
        pytest.skip(f"the harness times the cuda backend's host-emulation build: {problem}")
    # The host extension, built here where a checkout has none (the harness builds it only as backend='cpu'
    # does: not with POSENC_FAST_BUILD_ON_DEMAND=0).
    problem = cpu_extension_problem()
    if problem is not None:
        pytest.skip(f"the harness times the cpu backend: {problem}")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)  # (the harness compiles Triton's kernels onto its stand-in driver)
    out = tmp_path / "host.json"
    result = subprocess.run([sys.executable, os.path.join(root, "bench", "host_overhead.py"), "--smoke",
                             "--entry-points", "--json", str(out)], capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["smoke"] and doc["case"]["d_model"] == 64
    assert all(us > 0 for us in doc["us_per_call"].values()) and len(doc["us_per_call"]) == 5
    entry_points = {"SinusoidalEmbedding", "sinusoidal_embedding", "add_sinusoidal", "SinusoidalPositionalEncoding"}
    backends = ({"cuda (d 64)", "cpu (d 64, zero-token launches)", "cpu (d 8)", "torch (d 8)"}
                | ({"triton (d 64)"} if doc["triton"] else set()))
    rows = doc["entry_points_us_per_call"]
    assert set(rows) == backends | {"eager (nn.Embedding + scale + add, d 8)"}
    for backend in backends:
        assert set(rows[backend]) == entry_points, backend
        assert all(us["inference"] > 0 and us["training"] > 0 for us in rows[backend].values()), backend
    assert bool(doc["entry_points_timed"]) == bool(doc["triton"])  # what the triton rows timed, said


@pytest.mark.slow
def test_cpu_kernel_ab_script_smoke():
    """bench/cpu_kernel_ab.py builds HEAD's and the working tree's CPU kernel into one program and times both
    (a run of the script on a tiny case, not a timing)."""
    import platform
    import shutil
    import subprocess
    import sys

    from posenc_fast import _build

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not sys.platform.startswith("linux") or platform.machine() != "x86_64" or _build.find_cxx() is None:
        pytest.skip("needs Linux on x86-64 with a C++ compiler")
    inside = shutil.which("git") and subprocess.run(["git", "-C", root, "rev-parse", "--is-inside-work-tree"],
                                                    capture_output=True, text=True).stdout.strip() == "true"
    if not inside:
        pytest.skip("needs a git checkout (the script compares with a revision)")
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # The baseline variant (any x86-64) with a padded positions tensor: the options, and the shortest compile.
    result = subprocess.run([sys.executable, os.path.join(root, "bench", "cpu_kernel_ab.py"), "--shapes", "3x5,2x16",
                             "--vocab", "50", "--d", "40", "--repeats", "3", "--threads", "2", "--isa", "isa_baseline",
                             "--offsets", "padded"],
                            capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "isa_baseline ISA, right-padded make_positions" in result.stdout, result.stdout[:500]
    # 3x5: token-major, 2x16: position-major, each with padding
    rows = [line.split() for line in result.stdout.splitlines() if line.split()[:1] in (["3x5"], ["2x16"])]
    assert [(row[0], row[1]) for row in rows] == [(s, c) for s in ("3x5", "2x16") for c in ("warm", "cold", "fresh")]
    assert all(float(x) > 0 for row in rows for x in row[2:6]), rows  # p10 and median of each version, in ms
    assert all(row[7] in ("same", "DIFFER") for row in rows), rows  # (HEAD's kernel may differ from the tree's)


def test_cuda_forward_ab_builds_each_variant_with_its_defines(tmp_path, monkeypatch):
    """bench/cuda_forward_ab.py compiles every source of a variant with its -D flags, in a folder of its
    own, and reuses a finished build (the plan is checked; nothing is compiled here)."""
    import importlib.util

    from posenc_fast import _build

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("cuda_forward_ab", os.path.join(root, "bench", "cuda_forward_ab.py"))
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    plans = []
    monkeypatch.setattr(_build, "find_nvcc", lambda *a, **k: "/usr/bin/true")
    monkeypatch.setattr(_build, "run_build", lambda plan, *a, **k: plans.append(plan))
    defines = ("POSENC_FORWARD_MIN_BLOCKS=1", "OTHER=2")
    output = ab.build_variant(str(tmp_path), defines, log=None)
    assert os.path.dirname(output) == ab.variant_dir(str(tmp_path), defines) != ab.variant_dir(str(tmp_path), ())
    (plan,) = plans
    assert len(plan.compiles) == len(_build.SOURCES)
    assert all(cmd[-2:] == ["-DPOSENC_FORWARD_MIN_BLOCKS=1", "-DOTHER=2"] for cmd in plan.compiles)
    open(output, "w").close()  # (run_build was stubbed: the folder exists only if build_variant made it)
    assert ab.build_variant(str(tmp_path), defines, log=None) == output and len(plans) == 1


@pytest.mark.parametrize("script,args,message", [
    ("host_overhead", ["--calls", "0"], "--calls must be at least 1"),
    ("host_overhead", ["--real", "nosuch"], "is not a device name"),
    *([("host_overhead", ["--real", "cuda"], "sees no CUDA device")] if not torch.cuda.is_available() else []),
    ("cpu_in_context", ["--repeats", "0"], "expected an integer >= 1"),
    ("sparse_gradient_cost", ["--reps", "0"], "expected an integer >= 1"),
    ("backward_cost", ["--reps", "-1"], "expected an integer >= 1"),
    ("cuda_forward_ab", ["--rounds", "0"], "expected an integer >= 1"),
    ("dropout_cost", ["--p", "1.5"], "a dropout probability in [0, 1)"),
])
def test_bench_scripts_refuse_bad_arguments(script, args, message):
    """Bad arguments of the bench scripts exit 2 with a message, before any build, allocation or timing."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run([sys.executable, os.path.join(root, "bench", script + ".py"), *args],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 2 and message in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
