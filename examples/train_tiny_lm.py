"""Train a tiny character-level transformer language model whose first layer is posenc_fast's.

    python examples/train_tiny_lm.py                 # under a minute on a laptop CPU
    python examples/train_tiny_lm.py --pe concat --d-pos 32
    python examples/train_tiny_lm.py --pe none       # no positional information at all
    python examples/train_tiny_lm.py --dropout 0.1   # dropout fused into the embedding kernel
    python examples/train_tiny_lm.py --device cuda --backend triton

The text is synthetic: lines like ``hbkoa>aokbh``, random letters, ``>``, then the same letters
reversed.  The first half is noise (log 16 nats per letter at best); the second half is fully
determined, but only a model that knows where each character stands can produce it.  The
model is a causal nn.TransformerEncoder.  It prints a progress line, the final training loss,
and the held-out loss and accuracy on the reversed halves of fresh lines.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch
from torch import nn

import posenc_fast

LETTERS = "abcdefghijklmnop"
SEPARATOR, END = ">", "."
ALPHABET = LETTERS + SEPARATOR + END


def reversal_lines(count: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """``count`` lines of token ids: ``length`` letters, separator, the letters reversed, end."""
    letters = torch.randint(0, len(LETTERS), (count, length), generator=generator)
    separator = torch.full((count, 1), ALPHABET.index(SEPARATOR))
    end = torch.full((count, 1), ALPHABET.index(END))
    return torch.cat([letters, separator, letters.flip(1), end], dim=1)


class TinyLM(nn.Module):
    def __init__(self, vocab: int, d_model: int, layers: int, heads: int, pe: str, d_pos: int, backend: str,
                 dropout: float = 0.0):
        super().__init__()
        self.pe = pe
        if pe == "none":
            self.embed = nn.Sequential(nn.Embedding(vocab, d_model), nn.Dropout(dropout))
        else:
            self.embed = posenc_fast.SinusoidalEmbedding(
                vocab, d_model, mode="concat" if pe == "concat" else "add", d_pos=d_pos if pe == "concat" else None,
                dropout=dropout, backend=backend)  # N(0, 1) rows and the PE are both O(1) per column: no sqrt(d) scale
        block = nn.TransformerEncoderLayer(d_model, heads, dim_feedforward=4 * d_model, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        causal = nn.Transformer.generate_square_subsequent_mask(ids.shape[1], device=ids.device)
        return self.head(self.encoder(self.embed(ids), mask=causal, is_causal=True))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--pe", choices=("add", "concat", "none"), default="add",
                        help="positional encoding: added, concatenated, or none")
    parser.add_argument("--d-pos", type=int, default=32, help="PE columns for --pe concat")
    parser.add_argument("--dropout", type=float, default=0.0, help="dropout after embedding + PE (fused)")
    parser.add_argument("--backend", default="auto", choices=("auto", "torch", "triton", "cuda", "cpu"),
                        help="posenc_fast backend (on CPU: auto, cpu, torch, triton through its interpreter; "
                             "on CUDA: auto, triton, cuda, torch)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu, cuda or cuda:N (the default is cuda when torch sees a GPU)")
    parser.add_argument("--steps", type=int, default=300, help="training steps")
    parser.add_argument("--batch", type=int, default=32, help="lines per step")
    parser.add_argument("--length", type=int, default=8, help="letters per line before the separator")
    parser.add_argument("--d-model", type=int, default=64, help="model width")
    parser.add_argument("--layers", type=int, default=2, help="transformer layers")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and of the data")
    args = parser.parse_args(argv)
    try:
        device = torch.device(args.device)
    except RuntimeError as error:
        parser.error(f"--device {args.device!r}: {error}")
    if device.type == "cuda" and not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        parser.error(f"--device {args.device}: torch {torch.__version__} ({build}) sees no CUDA GPU; "
                     "run with --device cpu, or install a CUDA torch on a machine with an NVIDIA GPU (README)")

    try:  # a backend that cannot run on this device is a one-line usage error here, not a traceback mid-run
        posenc_fast.sinusoidal_embedding(torch.zeros(1, 2, dtype=torch.long, device=device),
                                         torch.zeros(2, 4, device=device), backend=args.backend)
    except (RuntimeError, TypeError) as error:
        parser.error(f"--backend {args.backend} on --device {args.device}: {error}")

    torch.manual_seed(args.seed)
    vocab = len(ALPHABET)
    model = TinyLM(vocab, args.d_model, args.layers, args.heads, args.pe, args.d_pos, args.backend, args.dropout)
    model.to(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    generator = torch.Generator().manual_seed(args.seed)
    loss_fn = nn.CrossEntropyLoss()
    answer = slice(args.length + 1, 2 * args.length + 1)  # target positions of the reversed letters
    started = time.time()
    for step in range(1, args.steps + 1):
        lines = reversal_lines(args.batch, args.length, generator).to(args.device)
        logits = model(lines[:, :-1])
        loss = loss_fn(logits.reshape(-1, vocab), lines[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % 10 == 0 or step == args.steps:
            bar = "#" * int(30 * step / args.steps)
            sys.stdout.write(f"\r[{bar:<30}] step {step}/{args.steps}  loss {loss.item():.3f}  "
                             f"{time.time() - started:.0f}s")
            sys.stdout.flush()
    print()
    model.eval()  # no dropout from here on
    with torch.no_grad():
        lines = reversal_lines(256, args.length, torch.Generator().manual_seed(args.seed + 1)).to(args.device)
        logits = model(lines[:, :-1])[:, answer]
        targets = lines[:, 1:][:, answer]
        held_out_loss = loss_fn(logits.reshape(-1, vocab), targets.reshape(-1)).item()
        accuracy = (logits.argmax(-1) == targets).float().mean().item()
    print(f"pe={args.pe} dropout={args.dropout:g} backend={args.backend} device={args.device}: final training loss {loss.item():.3f}; "
          f"held-out reversed half: loss {held_out_loss:.3f} nats/char, accuracy {accuracy:.1%} "
          f"(a guess: {math.log(len(LETTERS)):.3f} nats, {1 / len(LETTERS):.1%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
