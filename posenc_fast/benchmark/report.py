"""What a run reports: speedups over eager and torch.compile, the targets met or missed, the printed
table and the PNG plot (matplotlib, optional)."""

from __future__ import annotations

import math
import os
from typing import Dict, List, Optional, Sequence, Tuple

from .cases import JSON_IMPLS, COMPILE_IMPLS, TARGETS, CPU_TARGETS, DECODE_TARGET_X_EAGER, Case
from .results import Measurement, _key


def speedups(rows: Sequence[dict]) -> Dict[Tuple, Tuple[Optional[float], Optional[float]]]:
    """For each row (keyed by _key + impl): (eager time / its time, best compile time / its time).
    "Over compile" is over the faster of the two compile modes measured for that case and op."""
    eager, best_compile = {}, {}
    for r in rows:
        if r["impl"] == "eager":
            eager[_key(r)] = r["median_ms"]
        elif r["impl"] in COMPILE_IMPLS:
            best_compile[_key(r)] = min(best_compile.get(_key(r), math.inf), r["median_ms"])
    out = {}
    for r in rows:
        k, ms = _key(r), r["median_ms"]
        x_eager = eager[k] / ms if k in eager and ms > 0 else None
        x_compile = best_compile[k] / ms if k in best_compile and ms > 0 else None
        out[k + (r["impl"],)] = (x_eager, x_compile)
    return out


def target_report(rows: Sequence[dict], copy_GBps: float, headline: Case, decode: Optional[Case],
                  deterministic: Optional[Dict[str, bool]] = None) -> List[str]:
    """One line per fused implementation and target, each 'ok' or 'MISSED'.  A CPU headline
    (``headline.device_type == "cpu"``) is read against CPU_TARGETS, whose floor is a measured
    gather + write; ``decode`` None: no decode target (CPU)."""
    x = speedups(rows)
    by_key = {_key(r) + (r["impl"],): r for r in rows}
    on_cpu = headline.device_type == "cpu"
    targets = CPU_TARGETS if on_cpu else TARGETS
    fused = [impl for impl in ("triton", "cuda", "cpu") if any(r["impl"] == impl for r in rows)]
    if not fused:
        return [f"targets: no fused implementation ({'cpu' if on_cpu else 'triton, cuda'}) was measured"]
    floor = ("the gather + write floor: torch.index_select of random rows, ids + rows + output bytes over its time"
             if on_cpu else "the copy bandwidth")
    lines = [f"targets ({headline.name}: {headline.tokens} tokens x {headline.d_model}, {headline.dtype_name}, "
             f"{headline.mode}; x compile = over the faster compile mode; % of floor = GB/s by the byte model over "
             f"{floor}, {copy_GBps:.1f} GB/s):"]

    def key(op, case, impl):
        return (op,) + case.config_key() + (impl,)

    for impl in fused:
        parts = []
        for op, quantity, bar in targets:
            row = by_key.get(key(op, headline, impl))
            if row is None:
                parts.append(f"{op} {quantity}: not measured")
                continue
            if quantity == "pct_copy":
                value = 100.0 * row["GBps"] / copy_GBps if copy_GBps else None
            else:
                value = x[key(op, headline, impl)][0 if quantity == "x_eager" else 1]
            if value is None:
                parts.append(f"{op} {quantity}: no baseline")
                continue
            unit = "%" if quantity == "pct_copy" else "x"
            label = ("of floor" if on_cpu else "of copy") if quantity == "pct_copy" else quantity.replace("x_", "over ")
            parts.append(f"{op} {value:.2f}{unit} {label} (>= {bar:g}{unit}) {'ok' if value >= bar else 'MISSED'}")
        if deterministic is not None and impl in deterministic:
            parts.append(f"backward deterministic: {'ok' if deterministic[impl] else 'MISSED'}")
        else:
            parts.append("backward deterministic: not checked here (see the run's log)")
        if decode is not None:  # (no decode target on CPU)
            dx = x.get(key("forward", decode, impl), (None, None))[0]
            if dx is None:
                parts.append("decode forward over eager: not measured")
            else:
                parts.append(f"decode forward {dx:.2f}x over eager (>= {DECODE_TARGET_X_EAGER:g}x) "
                             f"{'ok' if dx >= DECODE_TARGET_X_EAGER else 'MISSED'}")
        mine, eager = by_key.get(key("step", headline, impl)), by_key.get(key("step", headline, "eager"))
        if on_cpu:
            pass  # peak memory is measured on GPU only
        elif mine and eager and mine["peak_mem_bytes"] is not None and eager["peak_mem_bytes"] is not None:
            ok = mine["peak_mem_bytes"] < eager["peak_mem_bytes"]
            parts.append(f"step peak memory {mine['peak_mem_bytes'] / 2**20:.0f} MiB vs eager "
                         f"{eager['peak_mem_bytes'] / 2**20:.0f} MiB {'ok' if ok else 'MISSED'}")
        else:
            parts.append("step peak memory: not measured")
        lines.append(f"  {impl}:")
        lines.extend(f"    {p}" for p in parts)
    return lines


def format_table(measurements: Sequence[Measurement], copy_GBps: float, *, device: str = "",
                 notes: Sequence[str] = ()) -> str:
    """The printed table: one line per (case, op, impl)."""
    rows = [m.as_json() for m in measurements]
    x = speedups(rows)
    floor = ("gather + write floor (torch.index_select of random rows)" if device.startswith("CPU")
             else "copy bandwidth")
    lines = [
        f"posenc_fast bench on {device or '?'}: {floor} {copy_GBps:.1f} GB/s (read + write); "
        f"posenc_fast timed with the id range check OFF (posenc_fast.id_check(False))",
        "bytes = the fewest bytes the op must move (posenc_fast.benchmark.bytes_moved); %copy = GB/s over the "
        f"{floor}; x eager / x compile = speedup (compile: the faster compile mode); peak = step only",
    ]
    header = (f"{'case':<21}{'op':<9}{'impl':<21}{'dtype':<9}{'tokens':>9}{'median ms':>11}{'spread':>8}"
              f"{'MB':>9}{'GB/s':>9}{'%copy':>7}{'x eager':>9}{'x compile':>10}{'peak MiB':>10}")
    lines += [header, "-" * len(header)]
    for m, r in zip(measurements, rows):
        x_eager, x_compile = x[_key(r) + (r["impl"],)]
        spread = f"{m.spread_pct:.0f}%" if m.spread_pct is not None else "-"
        peak = f"{m.peak_mem_bytes / 2**20:.0f}" if m.peak_mem_bytes is not None else "-"
        pct = f"{100.0 * m.GBps / copy_GBps:.0f}" if copy_GBps > 0 else "-"
        lines.append(
            f"{m.case.name:<21}{m.op:<9}{m.impl:<21}{m.case.dtype_name:<9}{m.case.tokens:>9}{m.median_ms:>11.4f}"
            f"{spread:>8}{m.bytes / 1e6:>9.1f}{m.GBps:>9.1f}{pct:>7}"
            f"{_fmt_x(x_eager):>9}{_fmt_x(x_compile):>10}{peak:>10}")
    lines.extend(notes)
    return "\n".join(lines)


def _fmt_x(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.3g}x"


def plot_results(rows: Sequence[dict], copy_GBps: float, path: str, title: str = "") -> Optional[str]:
    """Time against tokens per implementation, log-log, with the bandwidth floor (bytes over the
    copy bandwidth) drawn; for the forward op and, where measured, the step.  Uses the
    (dtype, mode, d_model, vocab) configuration with the most token counts (the sweep plus the
    headline).  Returns why no plot was written, or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib): no plot written"

    def config(r):
        return r["dtype"], r["mode"], r["d_model"], r["vocab"]

    configs: Dict[Tuple, set] = {}
    for r in rows:
        if r["op"] == "forward":
            configs.setdefault(config(r), set()).add(r["tokens"])
    if not configs:
        return "no forward measurements to plot"
    chosen = max(configs, key=lambda k: len(configs[k]))
    dtype, mode, d_model, vocab = chosen
    rows = [r for r in rows if config(r) == chosen]
    # The step gets its own panel where it was measured at two token counts or more (--full).
    ops = ["forward"] + [op for op in ("step",) if len({r["tokens"] for r in rows if r["op"] == op}) > 1]
    fig, axes = plt.subplots(1, len(ops), figsize=(6.5 * len(ops), 4.8), squeeze=False)
    for ax, op in zip(axes[0], ops):
        mine = [r for r in rows if r["op"] == op]
        for impl in JSON_IMPLS:
            points = sorted((r["tokens"], r["median_ms"]) for r in mine if r["impl"] == impl)
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=impl)
        if copy_GBps > 0:
            floor = sorted({(r["tokens"], r["bytes"] / (copy_GBps * 1e6)) for r in mine})
            ax.plot([p[0] for p in floor], [p[1] for p in floor], "k--", marker="_",
                    label=f"bytes / copy BW ({copy_GBps:.0f} GB/s)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens")
        ax.set_ylabel("median time (ms)")
        ax.set_title(f"{op}: d_model {d_model}, vocab {vocab}, {dtype}, {mode}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
