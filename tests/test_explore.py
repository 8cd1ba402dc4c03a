"""Tests for posenc_fast.explore: the PE geometry, principal angles, the experiment and the commands.

The numeric checks compare against float64 math written out here (not against
the library's own helpers); the experiment runs at a tiny size so the file
stays well under a minute on a 2-core CPU.
"""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from posenc_fast.cli import main as cli_main
from posenc_fast.explore import experiment, geometry, subspace
from posenc_fast.reference import sinusoidal_table

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True, scope="module")
def one_intra_op_thread():
    """Run this module's tiny models on one thread: they gain nothing from more, and on a
    busy 2-core machine two OpenMP threads fighting another process made the file 5x slower."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _frequencies(dim, base=10000.0):
    return torch.tensor([base ** (-2.0 * i / dim) for i in range(dim // 2)], dtype=torch.float64)


def _pe_float64(positions, dim, base=10000.0):
    """Interleaved PE straight from the definition, in float64 (accurate for moderate positions)."""
    angles = torch.as_tensor(positions, dtype=torch.float64)[:, None] * _frequencies(dim, base)[None, :]
    table = torch.zeros(len(positions), dim, dtype=torch.float64)
    table[:, 0 : 2 * (dim // 2) : 2] = torch.sin(angles)
    table[:, 1 : 2 * (dim // 2) : 2] = torch.cos(angles)
    return table


# --- <PE(t), PE(t+k)> depends on k only -----------------------------------------------------------


@pytest.mark.parametrize("dim", [16, 64, 128])
def test_dot_product_depends_only_on_offset(dim):
    starts = [0, 3, 100, 12345, 10**6]
    max_offset = 60
    dots = geometry.dot_by_offset(starts, max_offset, dim)
    # sum_i [sin(a)sin(b) + cos(a)cos(b)] = sum_i cos(k w_i): no t anywhere.
    closed_form = torch.cos(torch.arange(max_offset + 1, dtype=torch.float64)[:, None] * _frequencies(dim)).sum(-1)
    assert dots.shape == (len(starts), max_offset + 1)
    for row in dots:
        torch.testing.assert_close(row, closed_form, rtol=0, atol=1e-10)


def test_dot_product_matches_pe_written_out():
    dim, starts, max_offset = 64, [0, 5, 250], 40
    dots = geometry.dot_by_offset(starts, max_offset, dim)
    for row, t in zip(dots, starts):
        table = _pe_float64(list(range(t, t + max_offset + 1)), dim)
        torch.testing.assert_close(row, table @ table[0], rtol=0, atol=1e-11)


def test_library_table_matches_definition():
    positions = [0, 1, 2, 17, 999]
    torch.testing.assert_close(sinusoidal_table(positions, 32), _pe_float64(positions, 32), rtol=0, atol=1e-12)


# --- R(k) PE(t) = PE(t+k) ------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["interleaved", "split"])
@pytest.mark.parametrize("dim", [2, 8, 64, 128])
def test_rotation_maps_pe_t_to_pe_t_plus_k(dim, layout):
    offsets = [0, 1, 2, 7, 100, 1000, -5]
    starts = list(range(0, 5000, 97)) + [10**6]
    errors = geometry.rotation_error(offsets, starts, dim, layout=layout)
    assert errors.max() < 1e-12


def test_rotation_matches_the_angle_written_out():
    dim, k = 16, 9
    rotation = geometry.offset_rotation(k, dim)
    for i, w in enumerate(_frequencies(dim).tolist()):
        block = rotation[2 * i : 2 * i + 2, 2 * i : 2 * i + 2]
        expected = torch.tensor([[math.cos(k * w), math.sin(k * w)], [-math.sin(k * w), math.cos(k * w)]],
                                dtype=torch.float64)
        torch.testing.assert_close(block, expected, rtol=0, atol=1e-13)


def test_rotation_needs_an_even_width_and_a_known_layout():
    with pytest.raises(ValueError, match="even"):
        geometry.offset_rotation(1, 7)
    with pytest.raises(ValueError, match="layout"):
        geometry.offset_rotation(1, 8, layout="diagonal")


def test_rotation_is_orthogonal_and_composes():
    dim = 32
    r3, r5, r8 = (geometry.offset_rotation(k, dim) for k in (3, 5, 8))
    torch.testing.assert_close(r3 @ r3.T, torch.eye(dim, dtype=torch.float64), rtol=0, atol=1e-14)
    torch.testing.assert_close(r3 @ r5, r8, rtol=0, atol=1e-14)
    torch.testing.assert_close(geometry.offset_rotation(0, dim), torch.eye(dim, dtype=torch.float64), rtol=0, atol=0)


def test_pe_norm_is_sqrt_half_width():
    for row in geometry.norm_comparison([16, 64], num_tokens=200, num_positions=100):
        assert row["pe_mean"] == pytest.approx(math.sqrt(row["d"] / 2), abs=1e-12)
        assert row["pe_std"] < 1e-12
        assert row["token_mean"] == pytest.approx(math.sqrt(row["d"]), rel=0.15)


# --- principal angles ----------------------------------------------------------------------------


def test_principal_angles_of_a_subspace_with_itself_are_zero():
    vectors = torch.randn(5, 20, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    basis = subspace.orthonormal_basis(vectors)
    angles = subspace.principal_angles(basis, basis)
    assert angles.shape == (5,)
    assert angles.abs().max() < 1e-12
    # Another spanning set of the same subspace gives the same answer.
    mixed = torch.randn(5, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64) @ vectors
    assert subspace.principal_angles(basis, subspace.orthonormal_basis(mixed)).abs().max() < 1e-12


def test_principal_angles_of_orthogonal_coordinate_subspaces_are_right_angles():
    eye = torch.eye(7, dtype=torch.float64)
    angles = subspace.principal_angles(eye[:, :3], eye[:, 3:])
    torch.testing.assert_close(angles, torch.full((3,), math.pi / 2, dtype=torch.float64), rtol=0, atol=1e-15)


@pytest.mark.parametrize("theta", [1e-9, 0.3, math.pi / 2 - 1e-9])
def test_principal_angle_of_two_lines(theta):
    line_a = torch.tensor([[1.0, 0.0, 0.0]], dtype=torch.float64)
    line_b = torch.tensor([[math.cos(theta), math.sin(theta), 0.0]], dtype=torch.float64)
    angle = subspace.principal_angles(subspace.orthonormal_basis(line_a), subspace.orthonormal_basis(line_b))
    assert float(angle[0]) == pytest.approx(theta, rel=1e-9, abs=1e-15)


def test_mixed_case_has_a_shared_direction_and_a_right_angle():
    eye = torch.eye(4, dtype=torch.float64)
    angles = subspace.principal_angles(eye[:, [0, 1]], eye[:, [1, 2]])
    torch.testing.assert_close(angles, torch.tensor([0.0, math.pi / 2], dtype=torch.float64), rtol=0, atol=1e-15)


def test_orthonormal_basis_rejects_dependent_rows():
    rows = torch.tensor([[1.0, 2.0, 3.0], [2.0, 4.0, 6.0]], dtype=torch.float64)
    with pytest.raises(ValueError, match="dependent"):
        subspace.orthonormal_basis(rows)


def test_dominant_subspace_of_pe_is_low_rank_and_orthonormal():
    basis = subspace.dominant_subspace(sinusoidal_table(64, 256), energy=0.999)
    assert 5 < basis.shape[1] < 64  # slow pairs collapse: far fewer than 64 directions
    torch.testing.assert_close(basis.T @ basis, torch.eye(basis.shape[1], dtype=torch.float64), rtol=0, atol=1e-12)


def test_concatenated_tokens_and_pe_are_exactly_orthogonal():
    d_tok, d_pos = 12, 8
    tokens = torch.cat([torch.randn(6, d_tok, generator=torch.Generator().manual_seed(2), dtype=torch.float64),
                        torch.zeros(6, d_pos, dtype=torch.float64)], dim=1)
    pe = torch.cat([torch.zeros(16, d_tok, dtype=torch.float64), sinusoidal_table(16, d_pos)], dim=1)
    overlap = subspace.subspace_overlap(tokens, subspace.dominant_subspace(pe))
    assert overlap["min_angle_deg"] == pytest.approx(90.0, abs=1e-9)
    assert overlap["energy_in_pe"] < 1e-24


def test_median_angle_of_an_even_count_is_the_mean_of_the_middle_two():
    """Coordinate subspaces at known angles: tokens span e0, e1, cos(t) e2 + sin(t) e3, cos(u) e4 + sin(u) e5 and
    the PE e0, e1, e3, e5: the four angles are 0, 0, 90-t, 90-u degrees, so the median is (90 - u) / 2 where
    u > t (torch.median would give the lower middle value, 0)."""
    t, u = math.radians(30.0), math.radians(50.0)
    tokens = torch.zeros(4, 8, dtype=torch.float64)
    tokens[0, 0] = tokens[1, 1] = 1.0
    tokens[2, 2], tokens[2, 3] = math.cos(t), math.sin(t)
    tokens[3, 4], tokens[3, 5] = math.cos(u), math.sin(u)
    pe_basis = torch.eye(8, dtype=torch.float64)[:, [0, 1, 3, 5]]
    overlap = subspace.subspace_overlap(tokens, pe_basis)
    assert overlap["min_angle_deg"] == pytest.approx(0.0, abs=1e-6)
    assert overlap["median_angle_deg"] == pytest.approx((90.0 - 50.0) / 2, abs=1e-6)


def test_random_tokens_overlap_the_pe_span_like_a_random_subspace():
    rows = subspace.random_tokens_vs_pe([256, 1024], num_tokens=16, num_positions=32, seed=0)
    for row in rows:
        assert row["energy_in_pe"] == pytest.approx(row["random_energy_in_pe"], rel=0.35)
    assert rows[1]["min_angle_deg"] > rows[0]["min_angle_deg"]


def test_nearest_token_recovery_matches_brute_force():
    generator = torch.Generator().manual_seed(3)
    table = 0.5 * torch.randn(10, 8, generator=generator, dtype=torch.float64)
    pe = sinusoidal_table(6, 8)
    recovered = 0
    for u in range(10):
        for p in range(6):
            distances = (table[u] + pe[p] - table).norm(dim=-1)
            recovered += int(distances.argmin()) == u and int((distances == distances.min()).sum()) == 1
    assert subspace.nearest_token_recovery(table, pe) == pytest.approx(recovered / 60)
    assert subspace.nearest_token_recovery(table, torch.zeros(6, 8, dtype=torch.float64)) == 1.0


# --- the add-vs-concat experiment ----------------------------------------------------------------

TINY = experiment.ExperimentConfig(
    vocab_size=8, seq_len=6, d_model=16, d_pos=4, num_layers=1, num_heads=2, ffn_multiplier=2,
    batch_size=8, steps=6, learning_rate=3e-3, eval_size=16, eval_every=3,
)


def test_variants_cover_both_comparisons():
    variants = experiment.build_variants(TINY)
    assert [(v.group, v.position) for v in variants] == [
        ("equal width", "none"), ("equal width", "index"), ("equal width", "add"), ("equal width", "concat"),
        ("equal params", "concat"),
    ]
    assert all(v.width == 16 for v in variants[:4])
    wide = variants[4]
    assert (wide.width, wide.token_width, wide.pe_width) == (20, 16, 4)
    add_params = experiment.count_parameters(experiment.OrderTaskModel(variants[2], TINY))
    wide_params = experiment.count_parameters(experiment.OrderTaskModel(wide, TINY))
    per_ffn_unit = TINY.num_layers * (2 * wide.width + 1)  # what one FFN unit costs: the closest match possible
    assert abs(wide_params - add_params) <= per_ffn_unit / 2


@pytest.mark.parametrize("position", ["add", "concat", "index"])
def test_same_seed_gives_identical_losses(position):
    variant = next(v for v in experiment.build_variants(TINY) if v.position == position)
    state = torch.random.get_rng_state()
    first = experiment.train_one(variant, TINY, seed=5)
    second = experiment.train_one(variant, TINY, seed=5)
    assert first["train_losses"] == second["train_losses"]
    assert first["eval_history"] == second["eval_history"]
    assert torch.equal(first["trained_token_table"], second["trained_token_table"])
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's RNG is left alone
    other = experiment.train_one(variant, TINY, seed=6)
    assert other["train_losses"] != first["train_losses"]


def test_table_runs_at_tiny_size():
    result = experiment.run_add_vs_concat(TINY, [0, 1])
    rows = experiment.summarize(result)
    assert [r["variant"] for r in rows] == ["none", "index", "add", "concat", "concat"]
    for row in rows:
        assert row["seeds"] == 2
        assert 0.0 <= row["token_accuracy_min"] <= row["token_accuracy_mean"] <= row["token_accuracy_max"] <= 1.0
        assert math.isfinite(row["loss_mean"]) and row["loss_std"] >= 0
    table = experiment.format_table(rows)
    assert "equal params" in table and "concat" in table and len(table.splitlines()) == 2 + len(rows)
    subspace_rows = experiment.trained_subspace_rows(result)
    assert [(r["seed"], r["stage"]) for r in subspace_rows] == [(0, "initial"), (0, "trained"), (1, "initial"),
                                                               (1, "trained")]
    json.dumps(experiment.json_ready(result))  # serialisable


def test_config_validation():
    with pytest.raises(ValueError, match="num_heads"):
        experiment.ExperimentConfig(d_model=16, d_pos=3, num_heads=2).validate()
    with pytest.raises(ValueError, match="seq_len"):
        experiment.ExperimentConfig(seq_len=1).validate()


# --- the commands --------------------------------------------------------------------------------

TINY_ARGS = ["--seeds", "1", "--steps", "4", "--d-model", "16", "--d-pos", "4", "--seq-len", "6", "--vocab", "8",
             "--layers", "1", "--heads", "2", "--batch-size", "8", "--eval-size", "16", "--eval-every", "2",
             "--device", "cpu", "--quiet"]


def test_experiment_command_writes_results(tmp_path, capsys):
    assert cli_main(["experiment", "add-vs-concat", *TINY_ARGS, "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "equal width" in printed and "equal params" in printed
    with open(tmp_path / "add_vs_concat.json") as handle:
        saved = json.load(handle)
    assert len(saved["summary"]) == 5 and saved["config"]["d_model"] == 16


def test_subspace_command(tmp_path, capsys):
    args = ["experiment", "subspace", "--dims", "16,32", "--tokens", "4", "--positions", "8",
            "--recovery-vocab", "16", "--out", str(tmp_path)]
    assert cli_main(args) == 0
    printed = capsys.readouterr().out
    assert "min angle" in printed and "recovery" in printed
    with open(tmp_path / "subspace.json") as handle:
        assert [row["d"] for row in json.load(handle)["angles"]] == [16, 32]


@pytest.mark.parametrize("command", ["plot", "subspace"])
def test_a_blocked_output_file_is_named_not_a_traceback(tmp_path, capsys, command):
    """An output file that cannot be written (here a folder stands in its place) ends the command with its path
    and the reason, exit status 1."""
    name, args = "subspace.json", ["experiment", "subspace", "--dims", "16", "--tokens", "4", "--positions", "8",
                                   "--recovery-vocab", "16"]
    if command == "plot":
        pytest.importorskip("matplotlib")
        name, args = "pe_heatmap.png", ["plot", "--d-model", "32", "--positions", "20"]
    (tmp_path / name).mkdir()
    assert cli_main(args + ["--out", str(tmp_path)]) == 1
    assert capsys.readouterr().err.strip().endswith(f"error: {tmp_path / name}: Is a directory")


def test_plot_command_writes_non_empty_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    assert cli_main(["plot", "--out", str(tmp_path), "--d-model", "32", "--positions", "20"]) == 0
    names = sorted(os.listdir(tmp_path))
    assert names == ["pe_clock_hands.png", "pe_dot_vs_offset.png", "pe_heatmap.png", "pe_norms.png",
                     "pe_rotation_check.png"]
    for name in names:
        with open(tmp_path / name, "rb") as handle:
            assert handle.read(8) == b"\x89PNG\r\n\x1a\n"
        assert 1000 < os.path.getsize(tmp_path / name) < 200_000


def test_every_plot_follows_base_and_layout(tmp_path, monkeypatch):
    """--base and --layout reach the geometry behind every figure that depends on them (the offset and rotation
    figures were once computed for base 10000 whatever the command said); the norms depend on neither."""
    pytest.importorskip("matplotlib")
    calls, depth = [], [0]
    for name in ("pe_table", "column_spread", "dot_by_offset", "rotation_error", "offset_rotation", "pair_columns",
                 "norm_comparison"):
        def spy(*args, _name=name, _real=getattr(geometry, name), **kwargs):
            if not depth[0]:  # the figures' calls, not geometry's calls of its own functions
                calls.append((_name, args, kwargs))
            depth[0] += 1
            try:
                return _real(*args, **kwargs)
            finally:
                depth[0] -= 1
        monkeypatch.setattr(geometry, name, spy)
    assert cli_main(["plot", "--out", str(tmp_path), "--d-model", "32", "--positions", "20", "--base", "100",
                     "--layout", "split"]) == 0
    called = {name for name, _, _ in calls}
    assert called >= {"pe_table", "column_spread", "dot_by_offset", "rotation_error", "offset_rotation",
                      "pair_columns", "norm_comparison"}, called
    for name, args, kwargs in calls:
        if name == "norm_comparison":  # |PE| = sqrt(d/2) for any base and layout
            continue
        if name != "pair_columns":  # (takes no base)
            assert kwargs.get("base") == 100.0, (name, kwargs)
        if name != "dot_by_offset":  # (<PE(t), PE(t+k)> does not depend on the column order)
            assert "split" in args or kwargs.get("layout") == "split", (name, args, kwargs)


def test_loss_curves_and_subspace_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    from posenc_fast.explore import plots

    result = experiment.run_add_vs_concat(TINY, [0])
    for path in (plots.plot_loss_curves(result, str(tmp_path)),
                 plots.plot_subspace(subspace.random_tokens_vs_pe([16, 32], num_tokens=4, num_positions=8),
                                     str(tmp_path))):
        assert os.path.getsize(path) > 1000


def test_plot_command_without_matplotlib_says_how_to_install(tmp_path, monkeypatch, capsys):
    # A None entry makes "import matplotlib" (and its submodules, if already loaded) raise ImportError.
    for name in [n for n in sys.modules if n == "matplotlib" or n.startswith("matplotlib.")] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)
    assert cli_main(["plot", "--out", str(tmp_path)]) == 2
    message = capsys.readouterr().err
    assert "pip install 'posenc_fast[plot]'" in message and "pip install matplotlib" in message
    assert not os.listdir(tmp_path)
    from posenc_fast.explore import plots

    with pytest.raises(ImportError, match="pip install"):
        plots.plot_norms(str(tmp_path))


def test_importing_the_package_does_not_import_matplotlib():
    code = ("import sys, posenc_fast, posenc_fast.explore, posenc_fast.explore.cli, posenc_fast.explore.plots; "
            "sys.exit('matplotlib' in sys.modules)")
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    assert subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO_ROOT).returncode == 0
