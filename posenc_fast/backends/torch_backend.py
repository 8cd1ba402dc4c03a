"""Torch backend: the reference definition run as an op (float64 inside, rounded as the reference rounds);
the fallback where no compiled backend applies.  It materialises a float64 PE for the batch: exact, not fast."""

from __future__ import annotations

from typing import Optional

import torch

from .. import reference
from .._validate import Batch
from . import KernelParams

SUPPORTED_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
FLOAT64_MATH = True  # it always computes in float64


def available(device: torch.device) -> Optional[str]:
    return None


def forward(ids, weight, turns, positions, offsets, offset, seq_len, params: KernelParams, dropout):
    batch = Batch(ids=ids, out_shape=(), seq_len=seq_len, offset=offset, offsets=offsets, positions=positions)
    with torch.no_grad():
        return reference.embed_flat(
            ids, weight, batch.token_positions(), turns,
            concat=params.concat, pe_width=params.pe_width, columns=params.columns,
            embed_scale=params.embed_scale, pe_scale=params.pe_scale,
            padding_idx=params.pe_zero_id if params.pe_zero_id >= 0 else None,
            zero_pe_at_padding=params.pe_zero_id >= 0, dropout=dropout,
        )


def backward(grad_out, ids, num_embeddings, token_width, embed_scale, padding_idx, weight_dtype, dropout):
    ids64 = ids.to(torch.int64)
    if num_embeddings == 0 or token_width == 0 or ids64.numel() == 0:
        return torch.zeros((num_embeddings, token_width), dtype=weight_dtype, device=grad_out.device)
    in_range = (ids64 >= 0) & (ids64 < num_embeddings)
    # Selected, not multiplied by the mask: an out-of-range token's gradient may be inf (inf * 0 = NaN).
    grad_tokens = torch.where(in_range.unsqueeze(-1), grad_out[:, :token_width].to(torch.float64) * embed_scale, 0.0)
    if dropout is not None:  # the forward's mask, regenerated (token columns are the first ones)
        keep = reference.dropout_keep(dropout.seed, ids.numel(), token_width, dropout.threshold)
        grad_tokens = torch.where(keep, grad_tokens * dropout.scale, 0.0)
    # PyTorch's own embedding backward: sort-based and deterministic; zeroes the padding row.
    grad_weight = torch.ops.aten.embedding_dense_backward(
        grad_tokens, torch.where(in_range, ids64, 0), num_embeddings,
        padding_idx, False,
    )
    return grad_weight.to(weight_dtype)
