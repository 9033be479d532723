"""The Triton kernel of ``seeded_sampling`` (imported by vLLM's GPU workers only: it needs triton)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit  # launched as kernel[grid](...), every argument by position
def exponential_rows(q_ptr, q_stride, rows_ptr, seeds_ptr, steps_ptr, vocab_size, KEY_MULTIPLIER: tl.constexpr,  # noqa: PLR0917
                     SMALLEST_NOISE: tl.constexpr, BLOCK: tl.constexpr):
    """Row rows[i] of q gets Exp(1) noise from Philox keyed by seeds[i] * KEY_MULTIPLIER + steps[i], one value a
    column; a program fills BLOCK columns of one row."""
    which = tl.program_id(0)
    row = tl.load(rows_ptr + which)
    key = tl.load(seeds_ptr + which) * KEY_MULTIPLIER + tl.load(steps_ptr + which)
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    uniform = tl.rand(key, columns)  # [0, 1)
    noise = tl.maximum(-tl.log(1.0 - uniform), SMALLEST_NOISE)  # never 0: probs / q stays finite
    tl.store(q_ptr + row * q_stride + columns, noise, mask=columns < vocab_size)
