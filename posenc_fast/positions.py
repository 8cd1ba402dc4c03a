"""Position rules other libraries use, computed on the ids' device without a host sync: they produce the
integer ``positions`` the op takes, so the kernels never need to know which rule a model uses."""

from __future__ import annotations

from typing import Union

import torch

from . import config
from ._validate import check_cu_seqlens, check_offset, id_value_fits, refuse_nested


def make_positions(ids: torch.Tensor, padding_idx: int, past_length: Union[int, torch.Tensor] = 0,
                   shift_padding: bool = False) -> torch.Tensor:
    """fairseq's padding-aware positions (also HF M2M100/NLLB, Speech2Text, Kosmos-2, and FSMT).

    Non-padding tokens are numbered ``padding_idx + 1, padding_idx + 2, ...`` along the
    last axis, counting only non-padding tokens (so left and right padding both work),
    shifted by ``past_length`` when decoding with a cache; padding tokens get position
    ``padding_idx`` (whose PE fairseq zeroes: use ``zero_pe_at_padding=True``).
    ``past_length``: an int, or one per sequence (shape ``ids.shape[:-1]``).
    ``shift_padding=True`` is HF FSMT's variant: the past length moves padding tokens too
    (to ``padding_idx + past_length``, which has a PE once the past length is not 0).
    """
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"ids must be an int32 or int64 tensor, got {getattr(ids, 'dtype', type(ids).__name__)}")
    if isinstance(padding_idx, bool) or not isinstance(padding_idx, int):
        raise TypeError(f"padding_idx must be an int, got {padding_idx!r}")
    if not -(1 << 63) <= padding_idx < (1 << 63):
        raise ValueError(f"padding_idx={padding_idx} does not fit in int64")
    if isinstance(past_length, torch.Tensor):
        if past_length.is_floating_point() or past_length.dtype == torch.bool:
            raise TypeError(f"past_length must be integer, got dtype {past_length.dtype}")
        if past_length.is_meta and not ids.is_meta:
            raise ValueError(f"past_length is a meta tensor (no values) but ids are on {ids.device}")
        if past_length.dim() and tuple(past_length.shape) != tuple(ids.shape[:-1]):
            raise ValueError(f"past_length of shape {list(past_length.shape)} must be 0-d or ids.shape[:-1] "
                             f"= {list(ids.shape[:-1])}")
        past_length = past_length.to(device=ids.device, dtype=torch.int64).unsqueeze(-1)
    else:  # an int in int64 range, or a traced past length (torch.export: ``past.shape[1]``), kept symbolic
        check_offset(past_length, ids, "past_length")
    # Unlike the op's padding_idx, a negative one here is a real padding id.
    if id_value_fits(ids, padding_idx):
        real = (ids != padding_idx).to(torch.int64)
    else:  # no id can be the padding one
        real = torch.ones_like(ids, dtype=torch.int64)
    if shift_padding:
        return torch.cumsum(real, dim=-1) * real + past_length + padding_idx
    return (torch.cumsum(real, dim=-1) + past_length) * real + padding_idx


def packed_positions(cu_seqlens: torch.Tensor, total_tokens: int) -> torch.Tensor:
    """Positions of packed sequences: restart at 0 at each start in ``cu_seqlens``.

    ``cu_seqlens`` holds cumulative lengths ``[0, l0, l0 + l1, ...]`` (flash-attention /
    TransformerEngine convention); returns int64 ``[total_tokens]``, token t of sequence
    k at position ``t - cu_seqlens[k]``.  Computed on cu_seqlens' device (searchsorted).

    Its contents are checked (start at 0, never decrease, end at ``total_tokens``; ValueError
    otherwise) together with the ids, under the same switch (``posenc_fast.set_id_check``): one
    device-to-host copy on GPU.  The check is skipped while the id check is off, under
    ``torch.compile``, ``torch.vmap`` and CUDA graph capture; invalid contents then give wrong
    positions, never an out-of-bounds access.
    """
    refuse_nested("cu_seqlens", cu_seqlens)
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1:
        raise ValueError(f"cu_seqlens must be a 1-D integer tensor, got {getattr(cu_seqlens, 'shape', cu_seqlens)!r}")
    if cu_seqlens.is_floating_point() or cu_seqlens.is_complex() or cu_seqlens.dtype == torch.bool:
        raise TypeError(f"cu_seqlens must be integer, got dtype {cu_seqlens.dtype}")
    if cu_seqlens.layout != torch.strided:
        raise TypeError(f"cu_seqlens must be a dense (strided) tensor, got layout {cu_seqlens.layout}")
    if cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens needs at least 2 entries ([0, total]), got {cu_seqlens.numel()}")
    if isinstance(total_tokens, bool) or not isinstance(total_tokens, (int, torch.SymInt)) or total_tokens < 0:
        raise ValueError(f"total_tokens must be an int >= 0, got {total_tokens!r}")
    if (config.id_check_enabled() and not torch.compiler.is_compiling()
            and not torch._C._are_functorch_transforms_active()
            and not (cu_seqlens.is_cuda and torch.cuda.is_current_stream_capturing())):
        check_cu_seqlens(cu_seqlens, total_tokens)
    starts = cu_seqlens.to(torch.int64)
    t = torch.arange(total_tokens, device=cu_seqlens.device, dtype=torch.int64)
    # The last start at or before t (its sequence's; searched over all of cu_seqlens, not a slice of it, so that
    # torch.export keeps the number of sequences symbolic).  Invalid contents index -1: wrong, never out of bounds.
    return t - starts[torch.searchsorted(starts, t, right=True) - 1]
