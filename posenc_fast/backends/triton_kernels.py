"""Triton kernels: fused gather + exact-angle sinusoid + add/concat (forward) and the
deterministic sort-based weight gradient (backward).

Numerics (docs/design.md): the phase of pair i at position p is the wrapping
int64 product ``p * R_i``, the fractional turn scaled by 2**64.  Its top bits
pick the nearest quarter turn exactly; the remainder, at most 1/8 turn, becomes
an fp32 angle |a| <= pi/4 whose sin and cos come from short Taylor polynomials
(truncation < 2e-9, below fp32 rounding).  No table and no large fp32 angle
exists anywhere, and the result is the same on GPU and in the interpreter.
"""

import math

import triton
import triton.language as tl

# 2*pi radians per 2**64 units of turn.
RADIANS_PER_UNIT: tl.constexpr = tl.constexpr(2.0 * math.pi / 2.0**64)
EIGHTH_TURN: tl.constexpr = tl.constexpr(1 << 61)
QUARTER_TURN_MASK: tl.constexpr = tl.constexpr((1 << 62) - 1)
# Taylor coefficients of sin (odd) and cos (even) up to x^9 / x^10.
SIN_3: tl.constexpr = tl.constexpr(-1.0 / 6.0)
SIN_5: tl.constexpr = tl.constexpr(1.0 / 120.0)
SIN_7: tl.constexpr = tl.constexpr(-1.0 / 5040.0)
SIN_9: tl.constexpr = tl.constexpr(1.0 / 362880.0)
COS_2: tl.constexpr = tl.constexpr(-0.5)
COS_4: tl.constexpr = tl.constexpr(1.0 / 24.0)
COS_6: tl.constexpr = tl.constexpr(-1.0 / 720.0)
COS_8: tl.constexpr = tl.constexpr(1.0 / 40320.0)
COS_10: tl.constexpr = tl.constexpr(-1.0 / 3628800.0)
# float64 mode: Taylor terms up to x^17 / x^18 (truncation < 1e-19 for |x| <= pi/4).
SIN_11: tl.constexpr = tl.constexpr(-1.0 / 39916800.0)
SIN_13: tl.constexpr = tl.constexpr(1.0 / 6227020800.0)
SIN_15: tl.constexpr = tl.constexpr(-1.0 / 1307674368000.0)
SIN_17: tl.constexpr = tl.constexpr(1.0 / 355687428096000.0)
COS_12: tl.constexpr = tl.constexpr(1.0 / 479001600.0)
COS_14: tl.constexpr = tl.constexpr(-1.0 / 87178291200.0)
COS_16: tl.constexpr = tl.constexpr(1.0 / 20922789888000.0)
COS_18: tl.constexpr = tl.constexpr(-1.0 / 6402373705728000.0)


@triton.jit
def sin_cos_of_turns(turn_units, FLOAT64: tl.constexpr):
    """(sin, cos) of the angle 2*pi * turn_units / 2**64, for int64 turn_units of any value,
    in fp32 (or float64 when FLOAT64)."""
    # Wrapping add: shifted's top two bits are the nearest quarter turn (mod 4).
    shifted = turn_units + EIGHTH_TURN
    quadrant = (shifted >> 62) & 3
    remainder = (shifted & QUARTER_TURN_MASK) - EIGHTH_TURN  # in [-2**61, 2**61): |a| <= pi/4
    if FLOAT64:
        a = remainder.to(tl.float64) * RADIANS_PER_UNIT
        z = a * a
        sin_a = a + a * z * (SIN_3 + z * (SIN_5 + z * (SIN_7 + z * (SIN_9 + z * (
            SIN_11 + z * (SIN_13 + z * (SIN_15 + z * SIN_17)))))))
        cos_a = 1.0 + z * (COS_2 + z * (COS_4 + z * (COS_6 + z * (COS_8 + z * (COS_10 + z * (
            COS_12 + z * (COS_14 + z * (COS_16 + z * COS_18))))))))
    else:
        a = remainder.to(tl.float32) * RADIANS_PER_UNIT
        z = a * a
        sin_a = a + a * z * (SIN_3 + z * (SIN_5 + z * (SIN_7 + z * SIN_9)))
        cos_a = 1.0 + z * (COS_2 + z * (COS_4 + z * (COS_6 + z * (COS_8 + z * COS_10))))
    # Rotate by quadrant * 90 degrees: (sin, cos) -> (cos, -sin) -> (-sin, -cos) -> (-cos, sin).
    odd = (quadrant & 1) == 1
    sin_unsigned = tl.where(odd, cos_a, sin_a)
    cos_unsigned = tl.where(odd, sin_a, cos_a)
    sin = tl.where(quadrant >= 2, -sin_unsigned, sin_unsigned)
    cos = tl.where((quadrant == 1) | (quadrant == 2), -cos_unsigned, cos_unsigned)
    return sin, cos


@triton.jit
def round_for_store(value, ptr, SOFTWARE_BF16: tl.constexpr):
    """fp32 or float64 ``value`` rounded to nearest even in the element type of ``ptr``.

    GPUs convert to bf16 with round-to-nearest-even in hardware; Triton's interpreter
    truncates, so there (SOFTWARE_BF16) the rounding is done on the bits.  float64 goes
    to 16-bit types through fp32 (two roundings, as Triton converts anyway).
    """
    if value.dtype == tl.float64 and ptr.dtype.element_ty != tl.float64:
        if ptr.dtype.element_ty != tl.float32:
            value = value.to(tl.float32)
    if SOFTWARE_BF16 and ptr.dtype.element_ty == tl.bfloat16:
        bits = value.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return value.to(ptr.dtype.element_ty)


@triton.jit
def _token_positions(tokens, token_ok, positions_ptr, offsets_ptr, offset, seq_len, POSITION_SOURCE: tl.constexpr):
    if POSITION_SOURCE == 0:  # offset + t
        pos = offset + tokens % seq_len
    elif POSITION_SOURCE == 1:  # offsets[sequence] + t
        start = tl.load(offsets_ptr + tokens // seq_len, mask=token_ok, other=0)
        pos = start + tokens % seq_len
    else:  # explicit positions
        pos = tl.load(positions_ptr + tokens, mask=token_ok, other=0)
    return pos.to(tl.int64)


@triton.jit
def _store_columns(out_rows, weight_rows, id_ok, out_cols, weight_cols, pe, mask, embed_scale, ADD_TOKENS: tl.constexpr,
                   SOFTWARE_BF16: tl.constexpr):
    """out[:, out_cols] = embed_scale * W[:, weight_cols] + pe (add) or pe (concat), rounded once.
    ``embed_scale`` and ``pe`` are in the compute dtype (fp32, or float64)."""
    value = pe
    if ADD_TOKENS:
        w = tl.load(weight_rows[:, None] + weight_cols[None, :], mask=mask & id_ok[:, None], other=0.0)
        value = w.to(pe.dtype) * embed_scale + pe
    tl.store(out_rows[:, None] + out_cols[None, :], round_for_store(value, out_rows, SOFTWARE_BF16), mask=mask)


@triton.jit
def _pe_block(
    out_rows, weight_rows, id_ok, token_ok, pe_on, pos, turns_ptr, pair_block, num_turns, num_pairs, pe_width,
    pe_col0, sin_base, num_sin, cos_base, num_cos, embed_scale, pe_scale,
    ADD_TOKENS: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr,
    SOFTWARE_BF16: tl.constexpr, FLOAT64: tl.constexpr,
):
    """The PE columns of BLOCK_P pair slots for BLOCK_T tokens (plus the token columns they share in add mode).

    Slot i >= num_turns (an odd D's zero tail) has no frequency: sin 0 = 0.  A cos slot
    i >= num_pairs (the tail slot of a cos block) is a zero column.  See _spec.PEColumns.
    """
    pairs = pair_block * BLOCK_P + tl.arange(0, BLOCK_P)
    turns = tl.load(turns_ptr + pairs, mask=pairs < num_turns, other=0)
    sin, cos = sin_cos_of_turns(pos[:, None] * turns[None, :], FLOAT64)  # one sin/cos per pair
    scale = tl.where(pe_on, pe_scale, 0.0)[:, None]  # tokens with the pe_zero_id get no PE
    sin = sin * scale
    cos = tl.where((pairs < num_pairs)[None, :], cos * scale, 0.0)
    if INTERLEAVED:
        # (sin, cos) of slot i into contiguous columns 2i, 2i+1; an odd D's tail cos falls outside the mask.
        pe = tl.join(sin, cos).reshape(BLOCK_T, 2 * BLOCK_P)
        cols = pair_block * (2 * BLOCK_P) + tl.arange(0, 2 * BLOCK_P)
        mask = token_ok[:, None] & (cols < pe_width)[None, :]
        _store_columns(out_rows, weight_rows, id_ok, pe_col0 + cols, cols, pe, mask, embed_scale, ADD_TOKENS,
                       SOFTWARE_BF16)
    else:
        sin_mask = token_ok[:, None] & (pairs < num_sin)[None, :]
        cos_mask = token_ok[:, None] & (pairs < num_cos)[None, :]
        _store_columns(out_rows, weight_rows, id_ok, pe_col0 + sin_base + pairs, sin_base + pairs, sin, sin_mask,
                       embed_scale, ADD_TOKENS, SOFTWARE_BF16)
        _store_columns(out_rows, weight_rows, id_ok, pe_col0 + cos_base + pairs, cos_base + pairs, cos, cos_mask,
                       embed_scale, ADD_TOKENS, SOFTWARE_BF16)


@triton.jit
def forward_kernel(
    ids_ptr, weight_ptr, out_ptr, turns_ptr, positions_ptr, offsets_ptr,
    offset, seq_len, num_tokens, num_embeddings, weight_row_stride, out_row_stride,
    token_width, pe_width, num_pairs, num_turns, sin_base, num_sin, cos_base, num_cos, pe_zero_id,
    num_copy_blocks, embed_scale: tl.float64, pe_scale: tl.float64,
    CONCAT: tl.constexpr, INTERLEAVED: tl.constexpr, POSITION_SOURCE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, SOFTWARE_BF16: tl.constexpr, FLOAT64: tl.constexpr,
):
    """Grid: (token blocks, column blocks).  A column block is BLOCK_P pair slots;
    in concat mode the first ``num_copy_blocks`` column blocks copy 2*BLOCK_P token columns each.
    Arithmetic in fp32, or float64 when FLOAT64 (the scales arrive as float64 either way)."""
    if FLOAT64:
        embed_scale = tl.full([], embed_scale, tl.float64)
        pe_scale = tl.full([], pe_scale, tl.float64)
    else:
        embed_scale = tl.full([], embed_scale, tl.float32)
        pe_scale = tl.full([], pe_scale, tl.float32)
    pid_t = tl.program_id(0)
    pid_c = tl.program_id(1)
    tokens = pid_t.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_ok = tokens < num_tokens
    ids = tl.load(ids_ptr + tokens, mask=token_ok, other=0).to(tl.int64)
    # Guard every access: an out-of-range id (range check off) reads nothing and counts as a zero vector.
    id_ok = token_ok & (ids >= 0) & (ids < num_embeddings)
    pe_on = (ids != pe_zero_id) | (pe_zero_id < 0)  # pe_zero_id -1 means none, even for an id of -1
    weight_rows = weight_ptr + tl.where(id_ok, ids, 0) * weight_row_stride
    out_rows = out_ptr + tokens * out_row_stride
    if CONCAT:
        if pid_c < num_copy_blocks:
            cols = pid_c * (2 * BLOCK_P) + tl.arange(0, 2 * BLOCK_P)
            mask = token_ok[:, None] & (cols < token_width)[None, :]
            w = tl.load(weight_rows[:, None] + cols[None, :], mask=mask & id_ok[:, None], other=0.0)
            tl.store(out_rows[:, None] + cols[None, :], round_for_store(w.to(embed_scale.dtype) * embed_scale,
                                                                         out_rows, SOFTWARE_BF16), mask=mask)
        else:
            pos = _token_positions(tokens, token_ok, positions_ptr, offsets_ptr, offset, seq_len, POSITION_SOURCE)
            _pe_block(out_rows, weight_rows, id_ok, token_ok, pe_on, pos, turns_ptr, pid_c - num_copy_blocks,
                      num_turns, num_pairs, pe_width, token_width, sin_base, num_sin, cos_base, num_cos,
                      embed_scale, pe_scale, False, INTERLEAVED, BLOCK_T, BLOCK_P, SOFTWARE_BF16, FLOAT64)
    else:
        pos = _token_positions(tokens, token_ok, positions_ptr, offsets_ptr, offset, seq_len, POSITION_SOURCE)
        _pe_block(out_rows, weight_rows, id_ok, token_ok, pe_on, pos, turns_ptr, pid_c,
                  num_turns, num_pairs, pe_width, 0, sin_base, num_sin, cos_base, num_cos,
                  embed_scale, pe_scale, True, INTERLEAVED, BLOCK_T, BLOCK_P, SOFTWARE_BF16, FLOAT64)


@triton.jit
def grad_chunk_kernel(
    sorted_ids_ptr, order_ptr, grad_out_ptr, grad_weight_ptr, partials_ptr,
    num_tokens, num_embeddings, token_width, grad_out_row_stride, padding_idx, embed_scale,
    CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, SOFTWARE_BF16: tl.constexpr,
):
    """Stage 1 of the weight gradient.  Grid: (chunks of CHUNK sorted tokens, column blocks).

    Walks its chunk in sorted order summing runs of equal ids in fp32.  A run that
    lies wholly inside the chunk is final: written once to grad_weight.  A run that
    crosses the chunk's start leaves its partial sum in slot 0, one that starts here
    and crosses the end in slot 1; stage 2 combines those in chunk order.
    """
    chunk = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < token_width
    start = chunk * CHUNK
    end = tl.minimum(start + CHUNK, num_tokens)
    # Sorted ids may be int32 or int64; widen them: id * token_width can pass 2**31.
    previous_id = tl.load(sorted_ids_ptr + start - 1, mask=start > 0, other=-1).to(tl.int64)
    current_id = tl.load(sorted_ids_ptr + start).to(tl.int64)
    started_here = previous_id != current_id
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in range(CHUNK):
        i = start + j
        valid = i < end
        token = tl.load(order_ptr + i, mask=valid, other=0)
        row = tl.load(grad_out_ptr + token * grad_out_row_stride + cols, mask=col_ok & valid, other=0.0)
        acc += row.to(tl.float32)
        next_id = tl.load(sorted_ids_ptr + i + 1, mask=i + 1 < num_tokens, other=-1).to(tl.int64)
        is_last = i == end - 1
        run_ends = valid & ((next_id != current_id) | is_last)
        continues_after = is_last & (next_id == current_id)
        writable = (current_id != padding_idx) & (current_id < num_embeddings)
        final = run_ends & started_here & ~continues_after
        tl.store(grad_weight_ptr + current_id * token_width + cols,
                 round_for_store(acc * embed_scale, grad_weight_ptr, SOFTWARE_BF16), mask=col_ok & final & writable)
        slot = tl.where(started_here, 1, 0)
        tl.store(partials_ptr + (chunk * 2 + slot) * token_width + cols, acc, mask=col_ok & run_ends & ~final)
        acc = tl.where(run_ends, 0.0, acc)
        started_here = started_here | run_ends
        current_id = tl.where(run_ends, next_id, current_id)


@triton.jit
def grad_carry_kernel(
    sorted_ids_ptr, grad_weight_ptr, partials_ptr,
    num_tokens, num_embeddings, token_width, padding_idx, embed_scale,
    CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, SOFTWARE_BF16: tl.constexpr,
):
    """Stage 2: each run that starts in chunk k and crosses its end is owned by program k,
    which adds slot 1 of chunk k and slot 0 of the following chunks the run covers, in order."""
    chunk = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < token_width
    start = chunk * CHUNK
    end = tl.minimum(start + CHUNK, num_tokens)
    run_id = tl.load(sorted_ids_ptr + end - 1).to(tl.int64)  # widened: run_id * token_width can pass 2**31
    next_id = tl.load(sorted_ids_ptr + end, mask=end < num_tokens, other=-1).to(tl.int64)
    first_id = tl.load(sorted_ids_ptr + start).to(tl.int64)
    previous_id = tl.load(sorted_ids_ptr + start - 1, mask=start > 0, other=-1).to(tl.int64)
    started_before = (first_id == run_id) & (previous_id == run_id)
    owner = (next_id == run_id) & ~started_before
    acc = tl.load(partials_ptr + (chunk * 2 + 1) * token_width + cols, mask=col_ok & owner, other=0.0)
    later = chunk + 1
    going = owner
    while going:
        acc += tl.load(partials_ptr + (later * 2) * token_width + cols, mask=col_ok, other=0.0)
        later_end = tl.minimum((later + 1) * CHUNK, num_tokens)
        after = tl.load(sorted_ids_ptr + later_end, mask=later_end < num_tokens, other=-1).to(tl.int64)
        going = after == run_id
        later += 1
    writable = owner & (run_id != padding_idx) & (run_id < num_embeddings)
    tl.store(grad_weight_ptr + run_id * token_width + cols,
             round_for_store(acc * embed_scale, grad_weight_ptr, SOFTWARE_BF16), mask=col_ok & writable)
