"""The ``plot`` and ``experiment`` commands of ``python -m posenc_fast``: argument parsing and printing
only; the work is in ``plots``, ``experiment`` and ``subspace``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from typing import Callable, List

from . import experiment as experiment_module
from . import plots, subspace
from ..cli import device_from_arg, output_folder, positive_int, print_usage_error


def _number_list(kind):
    """An argparse type: comma-separated numbers of ``kind`` (int or float), at least one, each > 0."""
    def parse(text: str) -> List:
        try:
            values = [kind(part) for part in text.split(",") if part.strip()]
        except ValueError:
            values = []
        if not values or not all(0 < value < math.inf for value in values):
            raise argparse.ArgumentTypeError(f"expected comma-separated {kind.__name__}s > 0, got {text!r}")
        return values
    return parse


def add_subcommand(subparsers) -> None:
    """Register ``plot`` and ``experiment`` (with its experiments as sub-commands) on ``subparsers``."""
    parser = subparsers.add_parser(
        "plot", help="write PNG figures of the sinusoidal PE (needs matplotlib)",
        description="Heatmap, clock hands, <PE(t),PE(t+k)> against k, the R(k) rotation check, "
                    "and PE vs token norms, as PNG files in --out.",
    )
    parser.add_argument("--out", default="pe_plots", help="output folder (created if missing; default: %(default)s)")
    parser.add_argument("--d-model", type=int, default=128, help="PE width for the figures (default: %(default)s)")
    parser.add_argument("--positions", type=int, default=100, help="positions in the heatmap (default: %(default)s)")
    parser.add_argument("--base", type=float, default=10000.0, help="frequency base (default: %(default)s)")
    parser.add_argument("--layout", choices=("interleaved", "split"), default="interleaved",
                        help="column layout of the PE (default: %(default)s)")
    parser.set_defaults(func=_run_plot)
    _add_experiment(subparsers)


def _run_plot(args: argparse.Namespace) -> int:
    if not plots.matplotlib_available():
        return print_usage_error(plots.MISSING_MATPLOTLIB)
    if args.d_model < 16 or args.d_model % 2:
        return print_usage_error("--d-model must be an even number >= 16 for these figures")
    if args.positions < 2:
        return print_usage_error("--positions must be >= 2")
    if not 0 < args.base < math.inf:
        return print_usage_error(f"--base must be a finite number > 0, got {args.base}")
    output_folder(args.out)
    for path in plots.write_pe_plots(args.out, dim=args.d_model, num_positions=args.positions, base=args.base,
                                     layout=args.layout):
        print(f"wrote {path} ({os.path.getsize(path) / 1024:.0f} KB)")
    return 0


def _add_experiment(subparsers) -> None:
    parser = subparsers.add_parser(
        "experiment", help="small reproducible experiments: add-vs-concat, subspace",
        description="Run one of the experiments; see 'experiment NAME --help'.",
    )
    experiments = parser.add_subparsers(dest="experiment", required=True, metavar="NAME")

    defaults = experiment_module.ExperimentConfig()
    add_vs_concat = experiments.add_parser(
        "add-vs-concat", help="no PE vs normalised index vs add vs concat on sequence reversal",
        description="Train a tiny nn.TransformerEncoder on sequence reversal with each way of injecting "
                    "positions, at equal width and at equal parameter count; print a table over seeds.",
    )
    option = add_vs_concat.add_argument
    option("--seeds", type=positive_int, default=3, help="number of seeds (default: %(default)s)")
    option("--first-seed", type=int, default=0, help="the seeds are first-seed, first-seed+1, ... (default: 0)")
    option("--steps", type=int, default=defaults.steps, help="training steps (default: %(default)s)")
    option("--d-model", type=int, default=defaults.d_model, help="model width (default: %(default)s)")
    option("--d-pos", type=int, default=None, help="PE columns for concat (default: d_model // 4)")
    option("--seq-len", type=int, default=defaults.seq_len, help="sequence length (default: %(default)s)")
    option("--vocab", type=int, default=defaults.vocab_size, help="vocabulary size (default: %(default)s)")
    option("--layers", type=int, default=defaults.num_layers, help="encoder layers (default: %(default)s)")
    option("--heads", type=int, default=defaults.num_heads, help="attention heads (default: %(default)s)")
    option("--batch-size", type=int, default=defaults.batch_size, help="(default: %(default)s)")
    option("--lr", type=float, default=defaults.learning_rate, help="Adam learning rate (default: %(default)s)")
    option("--eval-size", type=int, default=defaults.eval_size, help="held-out sequences (default: %(default)s)")
    option("--eval-every", type=int, default=defaults.eval_every, help="(default: %(default)s)")
    option("--device", default="auto", help="'auto' (cuda if available, else cpu), 'cpu', 'cuda', 'cuda:1', ...")
    option("--out", default=None, help="folder for add_vs_concat.json and the loss-curve PNG")
    option("--quiet", action="store_true", help="do not print one line per run")
    add_vs_concat.set_defaults(func=_run_add_vs_concat)

    subspace_parser = experiments.add_parser(
        "subspace", help="principal angles between token vectors and the PE span as d grows",
        description="Random N(0,1) token vectors vs the span of PE(0..L-1): principal angles and the share of "
                    "token energy inside the PE span, per d; plus nearest-token recovery after adding the PE.",
    )
    subspace_parser.add_argument("--dims", type=_number_list(int), default=[64, 128, 256, 512, 1024, 2048, 4096],
                                 help="comma-separated widths (default: 64,...,4096)")
    subspace_parser.add_argument("--tokens", type=positive_int, default=32, help="token vectors (default: %(default)s)")
    subspace_parser.add_argument("--positions", type=positive_int, default=64, help="PE positions 0..L-1 (default: %(default)s)")
    subspace_parser.add_argument("--energy", type=float, default=subspace.DEFAULT_ENERGY,
                                 help="share of PE energy kept when choosing its span (default: %(default)s)")
    subspace_parser.add_argument("--recovery-vocab", type=positive_int, default=256,
                                 help="table rows for the nearest-token recovery check (default: %(default)s)")
    subspace_parser.add_argument("--token-stds", type=_number_list(float), default=[1.0, 0.1],
                                 help="comma-separated init std of the token table for recovery (default: %(default)s)")
    subspace_parser.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    subspace_parser.add_argument("--out", default=None, help="folder for subspace.json and a PNG")
    subspace_parser.set_defaults(func=_run_subspace)


def _write_results(folder: str, name: str, document: dict, draw: Callable[[], str], figure: str) -> None:
    """``document`` as JSON in ``folder``, then its figure (``draw()`` returns its path) if matplotlib is there."""
    json_path = os.path.join(folder, name)
    with open(json_path, "w") as handle:
        json.dump(document, handle, indent=1)
    print(f"wrote {json_path}")
    if plots.matplotlib_available():
        print(f"wrote {draw()}")
    else:
        print(f"note: no {figure}; {plots.MISSING_MATPLOTLIB}")


def _run_add_vs_concat(args: argparse.Namespace) -> int:
    config = experiment_module.ExperimentConfig(
        vocab_size=args.vocab, seq_len=args.seq_len, d_model=args.d_model, d_pos=args.d_pos,
        num_layers=args.layers, num_heads=args.heads, batch_size=args.batch_size, steps=args.steps,
        learning_rate=args.lr, eval_size=args.eval_size, eval_every=args.eval_every,
        device=str(device_from_arg(args.device)),
    )
    if not -(2**63) <= args.first_seed <= 2**64 - args.seeds:  # (torch.manual_seed's range)
        return print_usage_error(f"--first-seed {args.first_seed}: the seeds must lie in [-2**63, 2**64)")
    if args.out is not None:  # (an empty --out is refused there, as plot's)
        output_folder(args.out)
    try:
        config.validate()
    except ValueError as exc:
        return print_usage_error(str(exc))
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    print(f"add-vs-concat: sequence reversal, seq_len={config.seq_len}, vocab={config.vocab_size}, "
          f"d_model={config.d_model}, d_pos(concat)={config.concat_pe_width}, layers={config.num_layers}, "
          f"heads={config.num_heads}, steps={config.steps}, batch={config.batch_size}, lr={config.learning_rate:g}, "
          f"device={config.device}, seeds={seeds}", flush=True)
    started = time.perf_counter()
    progress = None if args.quiet else (lambda message: print(message, flush=True))
    result = experiment_module.run_add_vs_concat(config, seeds, progress=progress)
    elapsed = time.perf_counter() - started
    print()
    print(experiment_module.format_table(experiment_module.summarize(result)))
    print(f"(chance token accuracy 1/{config.vocab_size} = {1 / config.vocab_size:.3f}; "
          f"solved@ = first step with held-out token accuracy >= {experiment_module.SOLVED_ACCURACY}, "
          f"mean over the seeds that got there)")
    subspace_rows = experiment_module.trained_subspace_rows(result)
    if subspace_rows:
        print()
        print(f"Token table vs span of PE(0..{config.seq_len - 1}) ('add', equal width), at init and after training:")
        print(experiment_module.format_subspace_rows(subspace_rows))
    print(f"\ntotal time {elapsed:.1f} s")
    if args.out is not None:  # (made at the start: output_folder)
        document = {**experiment_module.json_ready(result), "trained_subspace": subspace_rows, "seconds": elapsed}
        _write_results(args.out, "add_vs_concat.json", document, lambda: plots.plot_loss_curves(result, args.out),
                       "loss-curve PNG")
    return 0


def _run_subspace(args: argparse.Namespace) -> int:
    if args.out is not None:  # (an empty --out is refused there, as plot's)
        output_folder(args.out)
    try:
        angle_rows = subspace.random_tokens_vs_pe(
            args.dims, num_tokens=args.tokens, num_positions=args.positions, energy=args.energy, seed=args.seed)
        recovery_rows = subspace.recovery_by_dim(
            args.dims, args.token_stds, vocab_size=args.recovery_vocab, num_positions=args.positions, seed=args.seed)
    except ValueError as exc:
        return print_usage_error(str(exc))
    print(f"{args.tokens} N(0,1) token vectors vs span of PE(0..{args.positions - 1}) "
          f"(dominant subspace holding {args.energy:g} of its energy), seed {args.seed}:")
    print(f"{'d':>5} {'pe dim':>6} {'min angle':>9} {'median angle':>12} {'mean cos^2':>10} {'(random)':>8} "
          f"{'energy in PE':>12} {'(random)':>8}")
    for r in angle_rows:
        print(f"{r['d']:>5} {r['pe_dim']:>6} {r['min_angle_deg']:>8.1f}° {r['median_angle_deg']:>11.1f}° "
              f"{r['mean_cos2']:>10.4f} {r['random_mean_cos2']:>8.4f} {r['energy_in_pe']:>12.4f} "
              f"{r['random_energy_in_pe']:>8.4f}")
    print()
    print(f"Nearest-token recovery: share of (token, position) pairs whose nearest row of a "
          f"{args.recovery_vocab}-row N(0, std^2) table to E[u] + PE(p), p < {args.positions}, is still E[u]:")
    print(f"{'d':>5} " + " ".join(f"{'std ' + format(s, 'g'):>10}" for s in args.token_stds))
    for r in recovery_rows:
        print(f"{r['d']:>5} " + " ".join(f"{r[f'recovery_std_{s:g}']:>10.4f}" for s in args.token_stds))
    if args.out is not None:  # (made at the start: output_folder)
        _write_results(args.out, "subspace.json", {"angles": angle_rows, "recovery": recovery_rows},
                       lambda: plots.plot_subspace(angle_rows, args.out), "PNG")
    return 0
