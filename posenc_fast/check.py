"""``python -m posenc_fast check``: run the op on the best device against the float64 reference,
print the errors against the accuracy bars and a timing against eager PyTorch.  Exit code 1
if any bar is missed."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import math
from typing import Dict

import torch

from . import reference
from ._dispatch import BACKENDS
from ._timing import median_ms
from .backends import cuda_backend
from .baselines import EagerSinusoidalEmbedding
from .cli import device_from_arg, positive_int, usage_error
from .functional import sinusoidal_embedding


def add_subcommand(subparsers) -> None:
    parser = subparsers.add_parser("check", help="check accuracy against float64 and time against eager PyTorch",
                                   description=__doc__)
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    parser.add_argument("--batch", type=positive_int, default=None, help="sequences (default: 16 on GPU, 4 on CPU)")
    parser.add_argument("--seq-len", type=positive_int, default=None,
                        help="tokens per sequence, at most 2^24 (default: 4096 GPU, 128 CPU)")
    parser.add_argument("--d-model", type=positive_int, default=None, help="width (default: 1024 GPU, 128 CPU)")
    parser.add_argument("--vocab", type=positive_int, default=32768)
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=run)


def _bound(exact: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32: 1e-6 + 2^-22|y|; bf16/fp16: half an ulp of the exact value plus that (correct rounding)."""
    fp32_bar = 1e-6 + 2.0**-22 * exact.abs()
    if dtype == torch.float32:
        return fp32_bar
    bits = {torch.bfloat16: 7, torch.float16: 10}[dtype]
    _, e = torch.frexp(exact.abs().clamp_min(torch.finfo(dtype).tiny))
    return 0.5 * torch.ldexp(torch.ones_like(exact), (e - 1 - bits).to(exact.dtype)) + fp32_bar


def skipped_backends(device: torch.device) -> Dict[str, str]:
    """Backends that cannot run on ``device`` here, each with the reason and what would enable it."""
    skipped = {}
    for name in ("triton", "cuda", "cpu", "torch"):
        why = BACKENDS[name].available(device)
        if why is None:
            continue
        if name == "cuda" and device.type != "cuda":
            why = "needs an NVIDIA GPU (this run is on the CPU)"
            if cuda_backend.extension_problem() is None:
                why += "; the CUDA extension posenc_fast._C is installed"
            else:
                why += (" and the CUDA extension posenc_fast._C, which is not installed (pip install . with nvcc "
                        "on PATH, or python -m posenc_fast._build; docs/cuda_backend.md)")
        skipped[name] = why
    return skipped


def _triton_version() -> str:
    spec = importlib.util.find_spec("triton")
    if spec is None:
        return "not installed"
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return "installed (version unknown)"


def run(args: argparse.Namespace) -> int:
    device = device_from_arg(args.device)
    gpu = device.type == "cuda"
    batch = args.batch if args.batch is not None else (16 if gpu else 4)
    seq_len = args.seq_len if args.seq_len is not None else (4096 if gpu else 128)
    d_model = args.d_model if args.d_model is not None else (1024 if gpu else 128)
    vocab = args.vocab
    if seq_len > 2**24:  # the offsets are drawn from [-2^24, 2^24 - seq_len)
        raise usage_error(f"--seq-len {seq_len}: at most 2^24")
    name = torch.cuda.get_device_name(device) if gpu else "CPU"
    print(f"posenc_fast check on {name}: {batch} x {seq_len} tokens, d_model {d_model}, vocab {vocab}")
    print("positions: per-sequence offsets spread over [-2^24, 2^24]; reference: float64 with exact angles\n")

    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, vocab, (batch, seq_len), generator=g).to(device)
    offsets = torch.randint(-(2**24), 2**24 - seq_len, (batch,), generator=g).to(device)
    master = torch.randn(vocab, d_model, generator=g, dtype=torch.float32).to(device)
    grad_out = torch.randn(batch, seq_len, d_model, generator=g).to(device)
    scale = math.sqrt(d_model)

    backends = [b for b in ("triton", "cuda", "cpu", "torch") if BACKENDS[b].available(device) is None]
    for backend, why in skipped_backends(device).items():
        print(f"skipped backend {backend!r}: {why}")
    print(f"versions: torch {torch.__version__}, triton {_triton_version()}\n")
    interpreted = {b: device.type == "cpu" and b == "triton" for b in backends}
    ok = True
    print(f"{'backend':<22}{'dtype':<10}{'max |err|':>12}{'err/bar':>10}{'grad rel err':>15}{'deterministic':>15}")
    for backend in backends:
        small = interpreted[backend]  # the interpreter is slow: check a slice
        sub = (slice(0, 2), slice(0, 32)) if small else (slice(None), slice(None))
        b_ids, b_off, b_grad = ids[sub], offsets[sub[0]], grad_out[sub]
        for dtype in (torch.float32, torch.bfloat16):
            weight = master.to(dtype).requires_grad_()
            out = sinusoidal_embedding(b_ids, weight, offset=b_off, embed_scale=scale, backend=backend)
            (grad,) = torch.autograd.grad(out, weight, b_grad.to(dtype))
            out2 = sinusoidal_embedding(b_ids, weight, offset=b_off, embed_scale=scale, backend=backend)
            (grad2,) = torch.autograd.grad(out2, weight, b_grad.to(dtype))
            worst_err = worst_ratio = 0.0
            flat_out, flat_ids = out.reshape(-1, d_model), b_ids.reshape(-1)
            positions = (b_off.unsqueeze(-1) + torch.arange(b_ids.shape[-1], device=device)).reshape(-1)
            for start in range(0, flat_ids.numel(), 1 << 16):  # (in chunks: no full-size float64 temporaries)
                rows = slice(start, start + (1 << 16))
                exact = reference.sinusoidal_embedding(flat_ids[rows], weight.detach().double(),
                                                       positions=positions[rows], embed_scale=scale)
                err = (flat_out[rows].double() - exact).abs()
                worst_err = max(worst_err, err.max().item())
                worst_ratio = max(worst_ratio, (err / _bound(exact, dtype)).max().item())
            exact_grad = torch.zeros(vocab, d_model, dtype=torch.float64, device=device)
            exact_grad.index_add_(0, flat_ids, b_grad.reshape(-1, d_model).double() * scale)
            grad_err = ((grad.double() - exact_grad).abs().max() / exact_grad.abs().max().clamp_min(1e-30)).item()
            deterministic = torch.equal(grad, grad2)
            grad_bar = 1e-5 if dtype == torch.float32 else 2.0**-7
            passed = worst_ratio <= 1.0 and grad_err <= grad_bar and deterministic
            ok &= passed
            label = backend + (" (interpreter)" if small else "")
            print(f"{label:<22}{str(dtype).replace('torch.', ''):<10}{worst_err:>12.3g}{worst_ratio:>10.3f}"
                  f"{grad_err:>15.3g}{str(deterministic):>15}  {'ok' if passed else 'FAIL'}")

    print(f"\nforward time, bf16, {batch * seq_len} tokens (median; speedup over eager PyTorch):")
    eager = EagerSinusoidalEmbedding(vocab, d_model, max_len=seq_len, embed_scale=scale, device=device,
                                     dtype=torch.bfloat16)
    weight = master.to(torch.bfloat16)
    with torch.no_grad():
        eager.embed.weight.copy_(weight)
        eager_ms = median_ms(lambda: eager(ids), device)
        print(f"  {'eager (nn.Embedding + fp32 table)':<36}{eager_ms:>9.3f} ms")
        for backend in backends:
            if interpreted[backend]:
                print(f"  {backend:<36}{'n/a (interpreter: not a timing)':>9}")
                continue
            ms = median_ms(lambda: sinusoidal_embedding(ids, weight, embed_scale=scale, backend=backend), device)
            print(f"  {backend:<36}{ms:>9.3f} ms   {eager_ms / ms:5.2f}x")
    print("\ncolumns: max |err| = largest absolute error of any output element against the float64 reference;\n"
          "  err/bar = the worst element's error divided by its bar (fp32: 1e-6 + 2^-22|y|; bf16: that plus half\n"
          "  an ulp of the exact value, i.e. correct rounding); <= 1 passes;\n"
          "  grad rel err = max |grad_W - exact| / max |exact| (bar 1e-5 fp32, 2^-7 bf16);\n"
          "  deterministic = two backward passes give bitwise equal gradients")
    print("\nall bars met" if ok else "\nSOME BARS MISSED")
    return 0 if ok else 1
