"""The eager layer users write, as real code does it; the comparison point for ``check`` and bench/.

``EagerSinusoidalEmbedding``: nn.Embedding + a registered fp32 sinusoid table buffer
(Annotated Transformer / fairseq style), embed scale, add (or torch.cat), cast.
Its angles are fp32 products, so it is inexact at large positions by construction.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn


class EagerSinusoidalEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, d_model: int, *, mode: str = "add", d_pos: Optional[int] = None,
                 max_len: int = 8192, base: float = 10000.0, embed_scale: float = 1.0, padding_idx=None,
                 device=None, dtype=None):
        super().__init__()
        self.mode = mode
        pe_width = d_pos if mode == "concat" else d_model
        token_width = d_model - pe_width if mode == "concat" else d_model
        self.embed = nn.Embedding(num_embeddings, token_width, padding_idx=padding_idx, device=device, dtype=dtype)
        self.embed_scale = embed_scale
        position = torch.arange(max_len, dtype=torch.float32, device=device).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, pe_width, 2, dtype=torch.float32, device=device)
                             * (-math.log(base) / pe_width))
        table = torch.zeros(max_len, pe_width, device=device)
        table[:, 0::2] = torch.sin(position * div_term)
        table[:, 1::2] = torch.cos(position * div_term[: pe_width // 2])
        self.register_buffer("pe", table)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        tokens = self.embed(ids) * self.embed_scale
        pe = self.pe[: ids.shape[-1]]
        if self.mode == "concat":
            return torch.cat([tokens, pe.to(tokens.dtype).expand(ids.shape + pe.shape[-1:])], dim=-1)
        return (tokens + pe).to(tokens.dtype)
