"""PNG figures for the explore commands: the drawing only, every number from ``geometry``, ``subspace``
or ``experiment``.  matplotlib (optional) is imported in :func:`_figure`, never at module import; figures are
``matplotlib.figure.Figure``s, so no pyplot state or interactive backend is touched."""

from __future__ import annotations

import math
import os
from typing import Dict, List, Sequence

import torch

from . import geometry
from .experiment import EQUAL_PARAMS

MISSING_MATPLOTLIB = (
    "plotting needs matplotlib, an optional dependency of posenc_fast: "
    "pip install 'posenc_fast[plot]'  (or: pip install matplotlib)"
)
_DPI = 100  # keeps the PNGs small enough to commit (docs/img/)


def matplotlib_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _figure(width: float, height: float):
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(MISSING_MATPLOTLIB) from exc
    return Figure(figsize=(width, height), layout="constrained")


def _save(figure, out_dir: str, name: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    figure.savefig(path, dpi=_DPI)
    return path


def plot_pe_heatmap(out_dir: str, *, dim: int = 128, num_positions: int = 100, base: float = 10000.0,
                    layout: str = "interleaved") -> str:
    """PE(t) as an image (positions x columns), and each column's spread over those positions."""
    table = geometry.pe_table(num_positions, dim, base=base, layout=layout)
    spread = geometry.column_spread(num_positions, dim, base=base, layout=layout)
    figure = _figure(9, 6.5)
    heat_axes, spread_axes = figure.subplots(2, 1, height_ratios=[3, 1], sharex=True)
    image = heat_axes.imshow(table.numpy(), aspect="auto", cmap="RdBu_r", vmin=-1, vmax=1, interpolation="nearest")
    figure.colorbar(image, ax=[heat_axes, spread_axes], label="PE value", shrink=0.6)  # one bar keeps x aligned
    heat_axes.set_ylabel("position t")
    heat_axes.set_title(f"Sinusoidal PE, d={dim}, base={base:g}, layout={layout}")
    spread_axes.plot(spread.numpy(), ".-", markersize=3)
    spread_axes.set_xlabel("column")
    spread_axes.set_ylabel("std over t")
    spread_axes.set_title(f"How much each column varies over positions 0..{num_positions - 1} "
                          "(slow columns are ~constant: a bias, not noise)", fontsize=9)
    return _save(figure, out_dir, "pe_heatmap.png")


def plot_clock_hands(out_dir: str, *, dim: int = 128, num_positions: int = 64, base: float = 10000.0,
                     layout: str = "interleaved") -> str:
    """Each (sin, cos) pair is a point on the unit circle that turns by w_i per position: a clock hand."""
    pairs = sorted({0, 4, dim // 8, dim // 4, dim // 2 - 1})
    table = geometry.pe_table(num_positions, dim, base=base, layout=layout)
    sin_columns, cos_columns = geometry.pair_columns(dim, layout)
    figure = _figure(3.0 * len(pairs), 3.6)
    circle = torch.linspace(0, 2 * math.pi, 200)
    for axes, pair in zip(figure.subplots(1, len(pairs)), pairs):
        sin_column, cos_column = int(sin_columns[pair]), int(cos_columns[pair])
        sin_values, cos_values = table[:, sin_column].numpy(), table[:, cos_column].numpy()
        axes.plot(torch.sin(circle).numpy(), torch.cos(circle).numpy(), color="0.85", linewidth=1)
        axes.plot(sin_values, cos_values, color="0.6", linewidth=0.5)
        points = axes.scatter(sin_values, cos_values, c=range(num_positions), cmap="viridis", s=12, zorder=3)
        frequency = base ** (-2.0 * pair / dim)
        axes.set_title(f"pair {pair} (cols {sin_column},{cos_column})\nw={frequency:.3g}, "
                       f"period {2 * math.pi / frequency:.3g}", fontsize=9)
        axes.set_xlabel("sin(w t)")
        axes.set_aspect("equal")
        axes.set_xlim(-1.15, 1.15)
        axes.set_ylim(-1.15, 1.15)
    figure.axes[0].set_ylabel("cos(w t)")
    figure.colorbar(points, ax=figure.axes, label="position t", shrink=0.8)
    return _save(figure, out_dir, "pe_clock_hands.png")


def plot_dot_vs_offset(out_dir: str, *, dim: int = 128, max_offset: int = 100,
                       starts: Sequence[int] = (0, 7, 100, 1000, 100000), base: float = 10000.0) -> str:
    """<PE(t), PE(t+k)> against k for several t (one curve), next to what a normalised index gives."""
    dots = geometry.dot_by_offset(starts, max_offset, dim, base=base)
    spread = float((dots - dots[0]).abs().max())
    figure = _figure(11, 4)
    pe_axes, index_axes = figure.subplots(1, 2)
    offsets = range(max_offset + 1)
    for row, t in zip(dots, starts):
        pe_axes.plot(offsets, row.numpy(), label=f"t={t}", linewidth=1.5)
    pe_axes.set_xlabel("offset k")
    pe_axes.set_ylabel("<PE(t), PE(t+k)>")
    pe_axes.set_title(f"d={dim}, base={base:g}: the same curve for every t\n(max difference between curves "
                      f"{spread:.1e})", fontsize=10)
    pe_axes.legend(fontsize=8)
    for n in (16, 64, 256):
        ks = [k for k in offsets if k < n]
        index_axes.plot(ks, [k / (n - 1) for k in ks], label=f"sequence length n={n}")
    index_axes.set_xlabel("offset k")
    index_axes.set_ylabel("u(t+k) - u(t),  u = t/(n-1)")
    index_axes.set_title("normalised index: 'k tokens apart' depends on the length n", fontsize=10)
    index_axes.legend(fontsize=8)
    return _save(figure, out_dir, "pe_dot_vs_offset.png")


def plot_rotation(out_dir: str, *, dim: int = 128, max_offset: int = 1000, num_starts: int = 200,
                  shown_dim: int = 12, shown_offset: int = 3, base: float = 10000.0, layout: str = "interleaved") -> str:
    """The matrix R(k) (small d, to see its 2x2 blocks) and max |R(k) PE(t) - PE(t+k)| over t, against k."""
    offsets = list(range(0, max_offset + 1, max(1, max_offset // 200)))
    starts = [round(i * 10000 / (num_starts - 1)) for i in range(num_starts)]  # 0..10000
    errors = geometry.rotation_error(offsets, starts, dim, base=base, layout=layout)
    figure = _figure(11, 4.2)
    matrix_axes, error_axes = figure.subplots(1, 2, width_ratios=[1, 1.6])
    rotation = geometry.offset_rotation(shown_offset, shown_dim, base=base, layout=layout)
    image = matrix_axes.imshow(rotation.numpy(), cmap="RdBu_r", vmin=-1, vmax=1)
    figure.colorbar(image, ax=matrix_axes, shrink=0.8)
    matrix_axes.set_title(f"R(k={shown_offset}) for d={shown_dim}, {layout}: one 2x2 rotation per pair\n"
                          f"PE(t+k) = R(k) PE(t) for every t", fontsize=10)
    # Exact zeros cannot sit on a log axis; show them at the float64 epsilon floor.
    floor = torch.finfo(torch.float64).eps / 4
    error_axes.semilogy(offsets, errors.clamp_min(floor).numpy(), ".", markersize=3)
    error_axes.axhline(torch.finfo(torch.float64).eps, color="0.5", linestyle="--", linewidth=1, label="float64 eps")
    error_axes.set_xlabel("offset k")
    error_axes.set_ylabel("max over t, columns of |R(k)PE(t) - PE(t+k)|")
    error_axes.set_title(f"d={dim}, base={base:g}, {num_starts} starts t in [0, 10000]: max error "
                         f"{float(errors.max()):.1e}",
                         fontsize=10)
    error_axes.legend(fontsize=8)
    return _save(figure, out_dir, "pe_rotation_check.png")


def plot_norms(out_dir: str, *, dims: Sequence[int] = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)) -> str:
    """|PE(t)| = sqrt(d/2) next to sampled token-vector norms (N(0,1) and N(0,1) * sqrt(d))."""
    rows = geometry.norm_comparison(dims)
    figure = _figure(11, 4)
    norm_axes, ratio_axes = figure.subplots(1, 2)
    series = (("pe", "PE, any t (= sqrt(d/2))", "C0"), ("token", "token, N(0,1) init (nn.Embedding)", "C1"),
              ("scaled_token", "token, N(0,1) * sqrt(d) (Vaswani scale)", "C2"))
    for key, label, color in series:
        norm_axes.errorbar(dims, [r[f"{key}_mean"] for r in rows], yerr=[r[f"{key}_std"] for r in rows],
                           marker="o", markersize=4, capsize=3, label=label, color=color)
    norm_axes.set_xscale("log", base=2)
    norm_axes.set_yscale("log")
    norm_axes.set_xlabel("d")
    norm_axes.set_ylabel("L2 norm (mean ± std over 1000 tokens)")
    norm_axes.legend(fontsize=8)
    norm_axes.set_title("vector norms", fontsize=10)
    for key, label, color in series[1:]:
        ratio_axes.plot(dims, [r["pe_mean"] / r[f"{key}_mean"] for r in rows], marker="o", markersize=4, label=label,
                        color=color)
    ratio_axes.set_xscale("log", base=2)
    ratio_axes.set_yscale("log")
    ratio_axes.set_xlabel("d")
    ratio_axes.set_ylabel("|PE| / |token|")
    ratio_axes.legend(fontsize=8)
    ratio_axes.set_title("how loud the PE is next to the token vector", fontsize=10)
    return _save(figure, out_dir, "pe_norms.png")


def write_pe_plots(out_dir: str, *, dim: int = 128, num_positions: int = 100, base: float = 10000.0,
                   layout: str = "interleaved") -> List[str]:
    """All figures of ``python -m posenc_fast plot``; returns the written paths."""
    return [
        plot_pe_heatmap(out_dir, dim=dim, num_positions=num_positions, base=base, layout=layout),
        plot_clock_hands(out_dir, dim=dim, base=base, layout=layout),
        plot_dot_vs_offset(out_dir, dim=dim, base=base),
        plot_rotation(out_dir, dim=dim, base=base, layout=layout),
        plot_norms(out_dir),
    ]


def _moving_average(values: torch.Tensor, window: int) -> torch.Tensor:
    if window <= 1 or values.numel() < window:
        return values
    kernel = torch.full((1, 1, window), 1.0 / window, dtype=torch.float64)
    return torch.nn.functional.conv1d(values.view(1, 1, -1), kernel).view(-1)


def plot_loss_curves(result: Dict, out_dir: str, name: str = "add_vs_concat_curves.png") -> str:
    """Training loss (moving average, mean over seeds) and held-out token accuracy per variant."""
    figure = _figure(12, 4.2)
    loss_axes, accuracy_axes = figure.subplots(1, 2)
    window = max(1, len(result["runs"][0]["train_losses"]) // 50)
    for variant in result["variants"]:
        runs = [r for r in result["runs"] if r["variant"] == variant.name and r["group"] == variant.group]
        label = f"{variant.name} ({variant.group}, {variant.token_width}+{variant.pe_width})"
        losses = torch.stack([_moving_average(torch.tensor(r["train_losses"], dtype=torch.float64), window)
                              for r in runs])
        steps = range(window, window + losses.shape[1])
        line, = loss_axes.plot(steps, losses.mean(0).numpy(), label=label,
                               linestyle="--" if variant.group == EQUAL_PARAMS else "-")
        accuracy = torch.tensor([[h["token_accuracy"] for h in r["eval_history"]] for r in runs])
        eval_steps = [h["step"] for h in runs[0]["eval_history"]]
        accuracy_axes.plot(eval_steps, accuracy.mean(0).numpy(), color=line.get_color(), linestyle=line.get_linestyle(),
                           label=label)
        accuracy_axes.fill_between(eval_steps, accuracy.min(0).values.numpy(), accuracy.max(0).values.numpy(),
                                   color=line.get_color(), alpha=0.15)
    seeds = len(result["seeds"])
    loss_axes.set_yscale("log")
    loss_axes.set_xlabel("step")
    loss_axes.set_ylabel("training loss")
    loss_axes.set_title(f"moving average over {window} steps, mean of {seeds} seeds", fontsize=9)
    loss_axes.legend(fontsize=8)
    accuracy_axes.set_xlabel("step")
    accuracy_axes.set_ylabel("held-out token accuracy")
    accuracy_axes.set_title(f"mean of {seeds} seeds, band: min to max", fontsize=9)
    accuracy_axes.set_ylim(0, 1.02)
    config = result["config"]
    figure.suptitle(f"sequence reversal, length {config['seq_len']}, vocab {config['vocab_size']}, "
                    f"d_model {config['d_model']}, {config['num_layers']} layers", fontsize=10)
    return _save(figure, out_dir, name)


def plot_subspace(rows: List[Dict], out_dir: str, name: str = "subspace_angles.png") -> str:
    """Smallest principal angle and PE-energy share of random tokens vs the PE span, against d."""
    dims = [r["d"] for r in rows]
    figure = _figure(11, 4)
    angle_axes, energy_axes = figure.subplots(1, 2)
    angle_axes.plot(dims, [r["min_angle_deg"] for r in rows], "o-")
    angle_axes.set_xscale("log", base=2)
    angle_axes.set_ylim(0, 90)
    angle_axes.set_xlabel("d")
    angle_axes.set_ylabel("smallest principal angle (degrees)")
    angle_axes.set_title(f"{rows[0]['token_dim']} N(0,1) tokens vs PE span", fontsize=10)
    energy_axes.loglog(dims, [r["energy_in_pe"] for r in rows], "o-", label="measured")
    energy_axes.loglog(dims, [r["random_energy_in_pe"] for r in rows], "k--", label="random subspace: pe_dim / d")
    energy_axes.set_xlabel("d")
    energy_axes.set_ylabel("share of token |x|^2 inside the PE span")
    energy_axes.legend(fontsize=8)
    return _save(figure, out_dir, name)
