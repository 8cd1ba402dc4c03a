"""Triton backend: launches the kernels in ``triton_kernels`` on CUDA GPUs, or on CPU through Triton's
interpreter (TRITON_INTERPRET=1 before the first launch).  The kernel module is imported at the first launch,
under a lock, and interpreted launches are serialised (docs/design.md, "torch integration" and "Transforms,
TorchScript, threads"); prepared launches on a GPU skip the JIT after a specialization's first call
(``triton_launch``)."""

from __future__ import annotations

import functools
import importlib.util
import os
import threading
import weakref
from typing import NamedTuple, Optional

import torch

from . import (KernelParams, PreparedLaunch, current_stream_function, gradient_rows, new_buffer,
               sort_ids_for_gradient)
from .._validate import check_id_range
from .triton_launch import KeptLaunches, int_specialization

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FLOAT64_MATH = True


def compile_options() -> dict:
    """Compile options of every launch: FMA contraction on, as the kernels are checked, unless
    TRITON_DEFAULT_FP_FUSION asks for Triton's default.  Set explicitly: left unset, Triton 3.9 warns
    that 3.10 turns it off."""
    return {} if "TRITON_DEFAULT_FP_FUSION" in os.environ else _FMA_CONTRACTION


_FMA_CONTRACTION = {"enable_fp_fusion": True}

# Sorted tokens per stage-1 program of the weight gradient (tests make it small so that runs
# cross many chunk boundaries).
GRAD_CHUNK = 32

triton = None  # the triton package, once loaded


class _Kernels:
    """``state``: the triton_kernels module, once loaded (a benchmark may stand another in); a prepared launch is
    current while it is the module the launch was made with (``backends.PreparedLaunch``)."""

    state = None


_kernels_interpreted: Optional[bool] = None  # whether they were defined under TRITON_INTERPRET=1
_load_lock = threading.Lock()
_interpreter_lock = threading.Lock()  # one interpreted launch at a time: the interpreter is not thread-safe


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _load_kernels():
    global triton, _kernels_interpreted
    if _Kernels.state is None:
        with _load_lock:
            if _Kernels.state is None:
                import triton as triton_package

                from . import triton_kernels

                triton, _kernels_interpreted = triton_package, interpreting()
                _Kernels.state = triton_kernels  # last: another thread that sees it sees the rest
    return _Kernels.state


def available(device: torch.device) -> Optional[str]:
    """None if this backend can run on ``device``, else the reason it cannot."""
    if _Kernels.state is None and importlib.util.find_spec("triton") is None:
        return ("backend='triton' needs Triton (3.5 to 3.9): pip install 'triton>=3.5,<3.10' numpy, or install "
                "posenc_fast with its [triton] extra (Triton comes with PyTorch's CUDA wheels on Linux)")
    if device.type == "cuda":
        return None
    if device.type != "cpu":
        return f"backend='triton' does not support device type {device.type!r}"
    if importlib.util.find_spec("numpy") is None:
        return ("backend='triton' on CPU tensors runs in Triton's interpreter, which needs numpy: pip install numpy "
                "(the [triton] extra of posenc_fast includes it)")
    if not interpreting():
        return (
            "backend='triton' on CPU tensors needs Triton's interpreter: set TRITON_INTERPRET=1 in the "
            "environment (or use backend='torch', or move the tensors to a CUDA device)"
        )
    if _kernels_interpreted is False:
        return (
            "backend='triton' on CPU tensors: the Triton kernels were already compiled for the GPU in this "
            "process; TRITON_INTERPRET=1 must be set before their first launch"
        )
    return None


class ForwardTiles(NamedTuple):
    block_t: int  # tokens per program
    block_p: int  # pair slots per program
    pair_slots: int  # ceil(D / 2): the pair slots of the PE, the tail column of an odd D included
    warps: int


# Add mode (see _forward_tiles): pair slots per program (a whole d_model 1024 row), and the tokens each
# program walks one after the other; each thread keeps its pairs' frequencies for all of them.
ADD_PAIRS_PER_PROGRAM = 512
ADD_TOKENS_PER_PROGRAM = 16
ADD_MAX_WARPS = 4
ADD_FLOAT64_PAIR_TOKENS_PER_THREAD = 64
# Concat mode: warps per BLOCK_T x BLOCK_P tile; the most token-copy column blocks (_forward_tiles).
FORWARD_WARPS = 4
MAX_COPY_BLOCKS = 32768


def _forward_tiles(params, num_tokens: int, element_size: int) -> ForwardTiles:
    """Tile shape and warps of the forward.

    Add mode: a program walks ``block_t`` tokens, one at a time, over ``block_p`` pair slots of their
    rows.  Each thread holds the pair slots of one 16-byte output vector per half (interleaved: (sin,
    cos) pairs, two vectors for fp32; split: one of sin and one of cos), so the per-token scalars (id,
    position, row pointers) are shared by 8 outputs; warps as many as the row slice needs.

    Concat mode: 4 warps of 8 tokens x 8 consecutive output columns per half (the PE units take twice
    the pairs in block layouts), a tile small in registers, for occupancy.
    """
    pair_slots = params.pe_width - params.num_pairs
    interleaved = params.columns.interleaved
    if not params.concat:
        block_p = min(ADD_PAIRS_PER_PROGRAM, _next_power_of_2(pair_slots))
        per_thread = 4 if interleaved else max(4, 16 // element_size)
        warps = max(1, min(ADD_MAX_WARPS, block_p // (32 * per_thread)))
        block_t = ADD_TOKENS_PER_PROGRAM
        if params.float64_math:  # the unrolled tokens' float64 temporaries: at most 64 pair slots per thread
            block_t = min(block_t, ADD_FLOAT64_PAIR_TOKENS_PER_THREAD // per_thread)
        return ForwardTiles(max(1, min(block_t, num_tokens)), block_p, pair_slots, warps)
    # The token part's copy blocks are 2 * block_p wide: beside a tiny PE, a token part wider than
    # 2 * MAX_COPY_BLOCKS columns takes wider tiles, which keep the grid's second axis within CUDA's 65535.
    copy_pairs = -(-params.token_width // (2 * MAX_COPY_BLOCKS))
    block_p = min(64 if interleaved else 128, _next_power_of_2(max(pair_slots, copy_pairs)))
    block_t = max(1, min((1024 if interleaved else 2048) // (2 * block_p), _next_power_of_2(num_tokens)))
    return ForwardTiles(block_t, block_p, pair_slots, FORWARD_WARPS)


def _forward_grid(params, tiles: ForwardTiles, num_tokens: int):
    """The forward's grid, and its number of token-copy column blocks (concat mode; they come first)."""
    num_copy_blocks = -(-params.token_width // (2 * tiles.block_p)) if params.concat else 0
    return (-(-num_tokens // tiles.block_t), num_copy_blocks - (-tiles.pair_slots // tiles.block_p)), num_copy_blocks


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _needs_wide_index(num_tokens: int, block_t: int, out_row_stride: int, num_embeddings: int,
                      weight_row_stride: int) -> bool:
    """Whether the add-mode forward needs 64-bit token indices and element offsets: a token index
    of the last program, or an element offset into ``out`` or ``weight``, may pass 2**31 - 1."""
    limit = 2**31 - 1
    last_token = num_tokens + block_t
    return (last_token > limit or last_token * max(out_row_stride, 1) > limit
            or num_embeddings * max(weight_row_stride, 1) > limit)


_turn_words_cache = {}  # id(turns) -> (weakref to turns, (low, high))
_turn_words_lock = threading.Lock()


def _turn_words(turns: torch.Tensor):
    """The int64 turns as two 16-byte aligned int32 tensors, low and high words, which the kernels
    load as contiguous 32-bit vectors (``triton_kernels._load_turn_words``).  Cached per turns tensor,
    so one small copy per spec and device (``PESpec.turns_tensor`` caches those per device)."""
    key = id(turns)
    with _turn_words_lock:
        entry = _turn_words_cache.get(key)
        if entry is not None and entry[0]() is turns:
            return entry[1]
    n = turns.numel()
    padded = max(4, -(-n // 4) * 4)
    words = torch.zeros((2, padded), dtype=torch.int32, device=turns.device)
    if n:
        words[:, :n] = turns.contiguous().view(torch.int32).view(n, 2).t()  # little-endian: low word first
    result = (words[0], words[1])
    with _turn_words_lock:
        for stale in [k for k, (ref, _) in _turn_words_cache.items() if ref() is None]:
            del _turn_words_cache[stale]
        _turn_words_cache[key] = (weakref.ref(turns), result)
    return result


# Weight-gradient column block: one warp over 1 KiB of a grad_out row (two 16-byte vectors per
# thread), so the per-token run logic is paid once per 1 KiB.
GRAD_BLOCK_BYTES = 1024
GRAD_WARPS = 1
# grad_out rows each stage-1 program has requested ahead of the one it adds (grad_chunk_kernel's
# prefetch depth; read by bench/sass_report.py's latency model).
GRAD_ROWS_IN_FLIGHT = 4


def _dropout_grouped(params: KernelParams, block_p: int) -> bool:
    """Whether every column block of the forward starts at a multiple of 4 and spans a multiple of 4
    columns, so that one Philox call serves four columns (triton_kernels.dropout_keep)."""
    pe_col0 = params.token_width if params.concat else 0
    if params.columns.interleaved:
        return block_p % 2 == 0 and pe_col0 % 4 == 0
    starts = (pe_col0 + params.columns.sin_base, pe_col0 + params.columns.cos_base)
    return block_p % 4 == 0 and all(start % 4 == 0 for start in starts)


def _one_at_a_time_if_interpreted(function):
    """``function`` under ``_interpreter_lock`` where the kernels run in Triton's interpreter (compiled
    kernels' launches may overlap)."""
    @functools.wraps(function)
    def call(*arguments):
        if _kernels_interpreted is False:
            return function(*arguments)
        with _interpreter_lock:
            return function(*arguments)
    return call


def _forward_arguments(params: KernelParams, num_tokens: int, table_rows: int, weight_row_stride: int,
                       out_row_stride: int, position_source: int, element_size: int, num_turns: int,
                       software_bf16, dropout=None):
    """``forward_kernel``'s grid, its arguments after ``seq_len``, and its constexprs and launch options."""
    tiles = _forward_tiles(params, num_tokens, element_size)
    grid, num_copy_blocks = _forward_grid(params, tiles, num_tokens)
    columns = params.columns
    arguments_after = (
        num_tokens, table_rows, weight_row_stride, out_row_stride, params.token_width, params.pe_width,
        params.num_pairs, num_turns, columns.sin_base, columns.num_sin, columns.cos_base, columns.num_cos,
        params.pe_zero_id, num_copy_blocks, params.embed_scale, params.pe_scale,
        0 if dropout is None else dropout.threshold, 1.0 if dropout is None else dropout.scale)
    constexprs = dict(
        CONCAT=params.concat, INTERLEAVED=columns.interleaved, POSITION_SOURCE=position_source,
        BLOCK_T=tiles.block_t, BLOCK_P=tiles.block_p, SOFTWARE_BF16=software_bf16, FLOAT64=params.float64_math,
        DROPOUT=dropout is not None, GROUPED=dropout is not None and _dropout_grouped(params, tiles.block_p),
        WIDE_INDEX=_needs_wide_index(num_tokens, tiles.block_t, out_row_stride, table_rows, weight_row_stride),
        ZERO_COS_TAIL=columns.num_cos > params.num_pairs, num_warps=tiles.warps, **compile_options())
    return grid, arguments_after, constexprs


@_one_at_a_time_if_interpreted
def forward(ids, weight, turns, positions, offsets, offset, seq_len, params: KernelParams, dropout):
    num_tokens = ids.numel()
    out = new_buffer((num_tokens, params.width), weight.dtype, weight.device)
    if num_tokens == 0:
        return out
    kernels = _load_kernels()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    position_source = 2 if positions is not None else (1 if offsets is not None else 0)
    grid, arguments_after, constexprs = _forward_arguments(
        params, num_tokens, weight.shape[0], weight.stride(0), out.stride(0), position_source, weight.element_size(),
        turns.numel(), _kernels_interpreted, dropout)
    turn_low, turn_high = _turn_words(turns)
    kernels.forward_kernel[grid](ids, weight, out, turns, turn_low, turn_high, positions, offsets,
                                 None if dropout is None else dropout.seed, offset, max(seq_len, 1), *arguments_after,
                                 **constexprs)
    return out


def prepare_forward(dtype, num_rows: int, device, turns, params: KernelParams) -> Optional[PreparedLaunch]:
    """``forward_kernel``'s launch for a table of ``dtype`` on ``device`` (``posenc_fast._prepared``): what
    ``forward`` works out per call is done here once (turn words), and once per token count and table size
    (``_forward_arguments``).  On a GPU only a specialization's first call goes through Triton's JIT
    (``triton_launch.KeptLaunches``)."""
    kernels = _load_kernels()
    interpreted = _kernels_interpreted
    turn_low, turn_high = _turn_words(turns)
    element_size = torch.empty((), dtype=dtype).element_size()
    # (num_tokens, table rows, row stride, position source) -> grid and arguments; a decoding loop has one or two
    shapes = {}
    # For the compiled launcher: addresses, stable because the launch keeps the tensors alive and the spec's
    # cached turns tensor is never resized.
    turns_address, turn_low_address, turn_high_address = turns.data_ptr(), turn_low.data_ptr(), turn_high.data_ptr()

    def shape_for(key):
        shape = shapes.get(key)
        if shape is None:
            num_tokens, table_rows, weight_row_stride, position_source = key
            grid, arguments_after, constexprs = _forward_arguments(
                params, num_tokens, table_rows, weight_row_stride, params.width, position_source, element_size,
                turns.numel(), interpreted)
            if len(shapes) >= 64:
                shapes.clear()
            # (The compiled launcher takes the constexprs too, after the others, in signature order.)
            shape = shapes[key] = (grid, arguments_after, constexprs,
                                   (*arguments_after, *compiled_launches.constexpr_values(constexprs)))
        return shape

    on_gpu = device.type == "cuda"
    compiled_launches = KeptLaunches(kernels.forward_kernel, device.index if on_gpu else None)

    def launch(ids, weight, weight_row_stride, out, offset, seq_len, num_tokens, last_argument, check_ids,
               positions=None):
        if not on_gpu and not interpreting():  # CPU tensors with the interpreter since turned off: as the general path
            raise RuntimeError(available(device))
        if check_ids:
            check_id_range(ids, num_rows)
        if num_tokens == 0:
            return
        # The rows the kernel may read: the table's (an embedding), or x's own (add_sinusoidal, whose launch
        # is prepared for any row count), as ``forward`` passes them.
        table_rows = weight.numel() // weight_row_stride if weight_row_stride else num_rows
        if seq_len < 1:
            seq_len = 1
        position_source = 0 if positions is None else 2  # (no per-sequence offsets, no dropout seed)
        if interpreted:
            key = (num_tokens, table_rows, weight_row_stride, position_source)
            grid, arguments_after, constexprs, _ = shapes.get(key) or shape_for(key)  # (kept: no call)
            with _interpreter_lock:
                kernels.forward_kernel[grid](ids, weight, out, turns, turn_low, turn_high, positions, None, None,
                                             offset, seq_len, *arguments_after, **constexprs)
            return
        # The compiled launcher gets addresses, not tensors: Triton's per-tensor check that the device can
        # use the address (a driver call each) has nothing to find on a launch prepared for this device.
        ids_address, weight_address, out_address = ids.data_ptr(), weight.data_ptr(), out.data_ptr()
        positions_address = None if positions is None else positions.data_ptr()
        position_bits = positions_address or 0  # (no positions count as aligned: position_source tells them apart)
        # The key: the shape and what Triton specialises the tensors, offset and length on (alignment:
        # True when 16 divides every address, else one flag each).
        key = (num_tokens, table_rows, weight_row_stride, ids.dtype,
               True if not (ids_address | weight_address | out_address | position_bits) & 15
               else (ids_address & 15 == 0, weight_address & 15 == 0, out_address & 15 == 0, position_bits & 15 == 0),
               position_source, int_specialization(offset), int_specialization(seq_len))
        # The arguments that vary between calls, in signature order; the kept kernel holds the rest.
        varying = (ids_address, weight_address, out_address, turns_address, turn_low_address, turn_high_address,
                   positions_address, None, None, offset, seq_len)
        if not compiled_launches.launch(key, last_argument, varying):
            grid, arguments_after, constexprs, launcher_arguments_after = shape_for(
                (num_tokens, table_rows, weight_row_stride, position_source))
            compiled_launches.keep(key, kernels.forward_kernel[grid](ids, weight, out, turns, turn_low, turn_high,
                                                                     positions, None, None, offset, seq_len,
                                                                     *arguments_after, **constexprs),
                                   grid, launcher_arguments_after)

    return PreparedLaunch(launch, current_stream_function(device), _Kernels, kernels, turns)


@_one_at_a_time_if_interpreted
def backward(grad_out, ids, num_embeddings, token_width, embed_scale, padding_idx, weight_dtype, dropout):
    grad_weight = torch.zeros((num_embeddings, token_width), dtype=weight_dtype, device=grad_out.device)
    num_tokens = ids.numel()
    if num_tokens == 0 or num_embeddings == 0:
        return grad_weight
    kernels = _load_kernels()
    grad_out = gradient_rows(grad_out, grad_out.dtype)
    sorted_ids, order = sort_ids_for_gradient(ids, num_embeddings)
    num_chunks = triton.cdiv(num_tokens, GRAD_CHUNK)
    partials = new_buffer((num_chunks, 2, token_width), torch.float32, grad_out.device)
    # At least 4 columns: the dropout mask is made four columns (one Philox call) at a time.
    block_d = min(GRAD_BLOCK_BYTES // grad_out.element_size(), max(4, triton.next_power_of_2(token_width)))
    grid = (num_chunks, triton.cdiv(token_width, block_d))
    if dropout is not None:
        embed_scale = embed_scale * dropout.scale  # kept rows were scaled in forward
    kernels.grad_chunk_kernel[grid](
        sorted_ids, order, grad_out, grad_weight, partials, None if dropout is None else dropout.seed,
        num_tokens, num_embeddings, token_width, grad_out.stride(0), padding_idx, embed_scale,
        0 if dropout is None else dropout.threshold,
        CHUNK=GRAD_CHUNK, BLOCK_D=block_d, SOFTWARE_BF16=_kernels_interpreted, DROPOUT=dropout is not None,
        num_warps=GRAD_WARPS, **compile_options(),
    )
    kernels.grad_carry_kernel[grid](
        sorted_ids, grad_weight, partials,
        num_tokens, num_embeddings, token_width, padding_idx, embed_scale,
        CHUNK=GRAD_CHUNK, BLOCK_D=block_d, SOFTWARE_BF16=_kernels_interpreted, num_warps=GRAD_WARPS,
        **compile_options(),
    )
    return grad_weight
