"""The add-vs-concat experiment (setup and results: docs/explore.md, section 2): the task, sequence reversal
(without positions an encoder is permutation-equivariant, so it can only guess), the model variants, the
training loop and the summary table.  Each run is seeded and reproducible on a given machine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import statistics
from typing import Dict, Iterator, List, Optional, Sequence

import torch
from torch import nn
import torch.nn.functional as F

from ..module import SinusoidalEmbedding
from .geometry import pe_table
from .subspace import dominant_subspace, subspace_overlap

POSITION_KINDS = ("none", "index", "add", "concat")
EQUAL_WIDTH = "equal width"
EQUAL_PARAMS = "equal params"
_EVAL_SEED = 2**31 - 1  # one held-out set for every seed and variant
SOLVED_ACCURACY = 0.99  # held-out token accuracy that counts as "solved" for the steps-to-solve column


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    """Sizes and optimiser settings shared by every variant."""

    vocab_size: int = 32
    seq_len: int = 32
    d_model: int = 64
    d_pos: Optional[int] = None  # PE columns for concat; None: d_model // 4
    num_layers: int = 2
    num_heads: int = 4
    ffn_multiplier: int = 4
    batch_size: int = 64
    steps: int = 300
    learning_rate: float = 1e-3
    eval_size: int = 512
    eval_every: int = 20
    device: str = "cpu"

    @property
    def concat_pe_width(self) -> int:
        return self.d_pos if self.d_pos is not None else max(2, self.d_model // 4)

    def validate(self) -> None:
        for name in ("vocab_size", "seq_len", "d_model", "num_layers", "num_heads", "ffn_multiplier",
                     "batch_size", "steps", "eval_size", "eval_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not (isinstance(self.learning_rate, (int, float)) and 0 < self.learning_rate < math.inf):
            raise ValueError(f"learning_rate must be a finite number > 0, got {self.learning_rate!r}")
        if self.seq_len < 2:
            raise ValueError("seq_len must be >= 2 (the normalised index divides by seq_len - 1)")
        if not 1 <= self.concat_pe_width < self.d_model:
            raise ValueError(f"d_pos={self.concat_pe_width} must satisfy 1 <= d_pos < d_model={self.d_model}")
        for width in (self.d_model, self.d_model + self.concat_pe_width):
            if width % self.num_heads:
                raise ValueError(
                    f"num_heads={self.num_heads} must divide both d_model={self.d_model} and the equal-parameter "
                    f"concat width d_model + d_pos = {self.d_model + self.concat_pe_width}"
                )


@dataclasses.dataclass(frozen=True)
class Variant:
    """One row of the table: how positions enter, and the widths that follow from the comparison."""

    name: str
    group: str  # EQUAL_WIDTH or EQUAL_PARAMS
    position: str  # one of POSITION_KINDS
    width: int  # residual stream width
    token_width: int
    pe_width: int  # sinusoid columns (0 for none/index)
    ffn_width: int


class OrderTaskModel(nn.Module):
    """Token (+ position) input layer, ``nn.TransformerEncoder``, final LayerNorm, linear read-out."""

    def __init__(self, variant: Variant, config: ExperimentConfig):
        super().__init__()
        if variant.position not in POSITION_KINDS:
            raise ValueError(f"unknown position kind {variant.position!r}; expected one of {POSITION_KINDS}")
        self.position = variant.position
        self.seq_len = config.seq_len
        # Build order keeps variants comparable: with the same seed, none/index/add draw the same token
        # table first, then the body, and only then the index projection.
        if variant.position in ("add", "concat"):
            self.embedding = SinusoidalEmbedding(
                config.vocab_size, variant.width, mode=variant.position,
                d_pos=variant.pe_width if variant.position == "concat" else None,
            )
        else:
            self.embedding = nn.Embedding(config.vocab_size, variant.width)  # N(0, 1), like SinusoidalEmbedding
        layer = nn.TransformerEncoderLayer(
            variant.width, config.num_heads, variant.ffn_width, dropout=0.0, batch_first=True, norm_first=True,
        )
        self.encoder = nn.TransformerEncoder(layer, config.num_layers, enable_nested_tensor=False)
        self.final_norm = nn.LayerNorm(variant.width)
        self.readout = nn.Linear(variant.width, config.vocab_size)
        self.index_projection = nn.Linear(1, variant.width) if variant.position == "index" else None

    @property
    def token_table(self) -> torch.Tensor:
        return self.embedding.weight

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embedding(ids)
        if self.index_projection is not None:
            index = torch.arange(ids.shape[-1], device=ids.device, dtype=x.dtype) / (self.seq_len - 1)
            x = x + self.index_projection(index[:, None])
        return x

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.readout(self.final_norm(self.encoder(self.embed(ids))))


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _model_parameters(variant: Variant, config: ExperimentConfig) -> int:
    with torch.random.fork_rng(devices=[]):  # a model built only to be counted must not move the caller's RNG
        return count_parameters(OrderTaskModel(variant, config))


def build_variants(config: ExperimentConfig) -> List[Variant]:
    """The five rows: none/index/add/concat at equal width, and concat at equal parameters."""
    d, d_pos = config.d_model, config.concat_pe_width
    ffn = config.ffn_multiplier * d
    variants = [
        Variant("none", EQUAL_WIDTH, "none", d, d, 0, ffn),
        Variant("index", EQUAL_WIDTH, "index", d, d, 0, ffn),
        Variant("add", EQUAL_WIDTH, "add", d, d, d, ffn),
        Variant("concat", EQUAL_WIDTH, "concat", d, d - d_pos, d_pos, ffn),
    ]
    # The parameter count is affine in the FFN width: two probes give the slope, then solve for `add`'s count.
    target = _model_parameters(variants[2], config)
    wide = Variant("concat", EQUAL_PARAMS, "concat", d + d_pos, d, d_pos, 1)
    at_one = _model_parameters(wide, config)
    slope = _model_parameters(dataclasses.replace(wide, ffn_width=2), config) - at_one
    ffn_wide = max(1, round((target - at_one) / slope) + 1)
    variants.append(dataclasses.replace(wide, ffn_width=ffn_wide))
    return variants


def reversal_batch(generator: torch.Generator, batch_size: int, seq_len: int, vocab_size: int):
    """(ids, targets), both ``[batch, seq_len]`` int64 on the CPU; targets = ids reversed along the sequence."""
    ids = torch.randint(vocab_size, (batch_size, seq_len), generator=generator)
    return ids, ids.flip(-1)


@contextlib.contextmanager
def deterministic_algorithms(device: torch.device) -> Iterator[None]:
    """``torch.use_deterministic_algorithms(True)`` for the block, restoring the caller's setting after."""
    previous = torch.are_deterministic_algorithms_enabled()
    previous_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    if device.type == "cuda":
        # cuBLAS needs this for reproducible matmuls; it only takes effect if set before cuBLAS starts.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # warn_only off CPU: some CUDA kernels have no deterministic version and would otherwise raise.
    torch.use_deterministic_algorithms(True, warn_only=device.type != "cpu")
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous, warn_only=previous_warn)


@torch.no_grad()
def evaluate(model: OrderTaskModel, ids: torch.Tensor, targets: torch.Tensor) -> Dict[str, float]:
    """Mean token cross-entropy, token accuracy and whole-sequence accuracy on a fixed set."""
    was_training = model.training
    model.eval()
    logits = model(ids)
    model.train(was_training)
    correct = logits.argmax(-1) == targets
    return {
        "loss": float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))),
        "token_accuracy": float(correct.double().mean()),
        "sequence_accuracy": float(correct.all(-1).double().mean()),
    }


def train_one(variant: Variant, config: ExperimentConfig, seed: int) -> Dict:
    """Train one variant with one seed; returns the curves, final metrics and token tables."""
    device = torch.device(config.device)
    rng_devices = []
    if device.type == "cuda":
        rng_devices = [device.index if device.index is not None else torch.cuda.current_device()]
    # fork_rng: the run reseeds the global generators; the caller's state comes back afterwards.
    with deterministic_algorithms(device), torch.random.fork_rng(devices=rng_devices):
        torch.manual_seed(seed)
        model = OrderTaskModel(variant, config).to(device)
        initial_table = model.token_table.detach().to("cpu", torch.float64).clone()
        optimizer = torch.optim.Adam(model.parameters(), lr=config.learning_rate)
        data = torch.Generator().manual_seed(seed)  # batches on the CPU: the data do not depend on the device
        eval_ids, eval_targets = reversal_batch(
            torch.Generator().manual_seed(_EVAL_SEED), config.eval_size, config.seq_len, config.vocab_size)
        eval_ids, eval_targets = eval_ids.to(device), eval_targets.to(device)
        train_losses: List[float] = []
        eval_history: List[Dict[str, float]] = []
        for step in range(1, config.steps + 1):
            ids, targets = reversal_batch(data, config.batch_size, config.seq_len, config.vocab_size)
            ids, targets = ids.to(device), targets.to(device)
            logits = model(ids)
            loss = F.cross_entropy(logits.reshape(-1, config.vocab_size), targets.reshape(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            train_losses.append(loss.item())
            if step % config.eval_every == 0 or step == config.steps:
                eval_history.append({"step": step, **evaluate(model, eval_ids, eval_targets)})
    return {
        "variant": variant.name,
        "group": variant.group,
        "seed": seed,
        "parameters": count_parameters(model),
        "train_losses": train_losses,
        "eval_history": eval_history,
        "final": eval_history[-1],
        "initial_token_table": initial_table,
        "trained_token_table": model.token_table.detach().to("cpu", torch.float64).clone(),
    }


def run_add_vs_concat(config: ExperimentConfig, seeds: Sequence[int], *, progress=None) -> Dict:
    """Every variant x every seed.  ``progress(message)`` is called after each run when given."""
    config.validate()
    variants = build_variants(config)
    runs = []
    for variant in variants:
        for seed in seeds:
            run = train_one(variant, config, seed)
            runs.append(run)
            if progress is not None:
                final = run["final"]
                progress(f"{variant.group:>12} {variant.name:<6} seed {seed}: "
                         f"token acc {final['token_accuracy']:.3f}, eval loss {final['loss']:.4f}")
    return {"config": dataclasses.asdict(config), "seeds": list(seeds), "variants": variants, "runs": runs}



def steps_to_solve(run: Dict, threshold: float = SOLVED_ACCURACY) -> Optional[int]:
    """First evaluated step whose held-out token accuracy reaches ``threshold``; None if never."""
    for point in run["eval_history"]:
        if point["token_accuracy"] >= threshold:
            return point["step"]
    return None


def _mean_std(values: Sequence[float]):
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def summarize(result: Dict) -> List[Dict]:
    """One row per variant: widths, parameters and mean/std/min/max over seeds of the final metrics."""
    rows = []
    for variant in result["variants"]:
        runs = [r for r in result["runs"] if r["variant"] == variant.name and r["group"] == variant.group]
        accuracy = [r["final"]["token_accuracy"] for r in runs]
        loss = [r["final"]["loss"] for r in runs]
        sequence = [r["final"]["sequence_accuracy"] for r in runs]
        solved_at = [steps_to_solve(r) for r in runs]
        rows.append({
            "group": variant.group, "variant": variant.name, "width": variant.width,
            "token_width": variant.token_width, "pe_width": variant.pe_width, "ffn_width": variant.ffn_width,
            "parameters": runs[0]["parameters"], "seeds": len(runs),
            "token_accuracy_mean": _mean_std(accuracy)[0], "token_accuracy_std": _mean_std(accuracy)[1],
            "token_accuracy_min": min(accuracy), "token_accuracy_max": max(accuracy),
            "sequence_accuracy_mean": _mean_std(sequence)[0],
            "loss_mean": _mean_std(loss)[0], "loss_std": _mean_std(loss)[1],
            "solved_runs": sum(s is not None for s in solved_at),
            "steps_to_solve_mean": (statistics.fmean(s for s in solved_at if s is not None)
                                    if any(s is not None for s in solved_at) else None),
        })
    return rows


def format_table(rows: List[Dict]) -> str:
    """Fixed-width text table of :func:`summarize` rows."""
    header = (f"{'comparison':<12} {'variant':<7} {'width':>5} {'tok+pe':>7} {'ffn':>4} {'params':>7} "
              f"{'token acc mean±std [min,max]':>30} {'seq acc':>7} {'eval loss mean±std':>19} {'solved@':>9}")
    lines = [header, "-" * len(header)]
    for r in rows:
        # solved@: mean step at which held-out token accuracy first reached SOLVED_ACCURACY, over the runs that did.
        solved = (f"{r['steps_to_solve_mean']:.0f} ({r['solved_runs']}/{r['seeds']})"
                  if r["steps_to_solve_mean"] is not None else f"- (0/{r['seeds']})")
        accuracy = (f"{r['token_accuracy_mean']:.3f}±{r['token_accuracy_std']:.3f} "
                    f"[{r['token_accuracy_min']:.3f},{r['token_accuracy_max']:.3f}]")
        lines.append(
            f"{r['group']:<12} {r['variant']:<7} {r['width']:>5} {str(r['token_width']) + '+' + str(r['pe_width']):>7} "
            f"{r['ffn_width']:>4} {r['parameters']:>7} {accuracy:>30} {r['sequence_accuracy_mean']:>7.3f} "
            f"{r['loss_mean']:>10.4f}±{r['loss_std']:.4f} {solved:>9}"
        )
    return "\n".join(lines)


def trained_subspace_rows(result: Dict, *, energy: float = 0.999) -> List[Dict]:
    """Token-table vs PE(0..seq_len-1) subspace overlap for the ``add`` runs, at init and after training.

    Only ``add`` puts tokens and PE in the same columns (concat's are orthogonal by construction).
    Returns [] where vocab_size > d_model: the tokens then span all of R^d.
    """
    config = result["config"]
    if config["vocab_size"] > config["d_model"]:
        return []
    pe_basis = dominant_subspace(pe_table(config["seq_len"], config["d_model"]), energy=energy)
    rows = []
    for run in result["runs"]:
        if run["variant"] != "add" or run["group"] != EQUAL_WIDTH:
            continue
        for stage in ("initial", "trained"):
            overlap = subspace_overlap(run[f"{stage}_token_table"], pe_basis)
            rows.append({"seed": run["seed"], "stage": stage, **overlap})
    return rows


def format_subspace_rows(rows: List[Dict]) -> str:
    lines = [f"{'seed':>4} {'stage':<8} {'d':>4} {'tok dim':>7} {'pe dim':>6} {'min angle':>9} "
             f"{'mean cos^2':>10} {'(random)':>8} {'energy in PE':>12} {'(random)':>8}"]
    for r in rows:
        lines.append(
            f"{r['seed']:>4} {r['stage']:<8} {r['d']:>4} {r['token_dim']:>7} {r['pe_dim']:>6} "
            f"{r['min_angle_deg']:>8.1f}° {r['mean_cos2']:>10.3f} {r['random_mean_cos2']:>8.3f} "
            f"{r['energy_in_pe']:>12.3f} {r['random_energy_in_pe']:>8.3f}"
        )
    return "\n".join(lines)


def json_ready(result: Dict) -> Dict:
    """``result`` without tensors (token tables dropped, variants as dicts), for ``json.dump``."""
    return {
        "config": result["config"],
        "seeds": result["seeds"],
        "variants": [dataclasses.asdict(v) for v in result["variants"]],
        "runs": [{k: v for k, v in run.items() if not isinstance(v, torch.Tensor)} for run in result["runs"]],
        "summary": summarize(result),
    }

