"""Variable-length attention over a packed row: each sequence attends causally within itself, no pad token.

A packed micro-batch (``SequenceBatch.packed``) is one row of N tokens holding
B sequences back to back; ``cu_seqlens`` [B+1] (int32) are where each starts,
then N. Under transformers' sdpa a packed row gets a dense [N x N] block mask
built from its position ids and attention over the whole row: no pad tokens,
but N^2 memory and work. Here attention runs per sequence instead:

- on a GPU, in half precision: the flash-attention kernel's variable-length
  form (``torch.ops.aten._flash_attention_forward`` with the cumulative
  sequence lengths, causal; it takes fewer key/value heads than query heads,
  so grouped-query attention needs no copy; its backward is registered with
  autograd);
- elsewhere (CPU, float32/64): ``scaled_dot_product_attention`` on each
  sequence's slice, causal, the same computation one sequence at a time.

The function is registered with transformers' ``AttentionInterface`` under
``VARLEN``; a model loaded with ``attn_implementation=VARLEN`` calls it in
every attention layer. transformers builds no mask for an implementation
that has no mask function registered, so no [N x N] mask exists; the
sequence bounds arrive as the forward's keyword arguments ``cu_seq_lens_q``
and ``max_length_q`` (transformers' flash-attention names, ``varlen_kwargs``),
which the model hands down to each attention call.
"""

from __future__ import annotations

import itertools

import torch

VARLEN = "meshrl_varlen"
FLASH_DTYPES = (torch.float16, torch.bfloat16)


def varlen_kwargs(starts: torch.Tensor, longest: int) -> dict:
    """The model's keyword arguments that carry a packed row's sequence bounds down to its attention calls."""
    return {"cu_seq_lens_q": starts, "cu_seq_lens_k": starts, "max_length_q": longest, "max_length_k": longest}


def causal_per_sequence(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, starts: torch.Tensor,
                        scale: float | None) -> torch.Tensor:
    """SDPA on each sequence's slice. query [Hq, N, D], key and value [Hkv, N, D] -> [N, Hq, D]."""
    bounds = starts.tolist()
    pieces = [torch.nn.functional.scaled_dot_product_attention(
        query[None, :, start:end], key[None, :, start:end], value[None, :, start:end], is_causal=True, scale=scale,
        enable_gqa=True)[0] for start, end in itertools.pairwise(bounds)]
    return torch.cat(pieces, dim=1).transpose(0, 1)


def causal_flash(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, starts: torch.Tensor, longest: int,
                 scale: float | None) -> torch.Tensor:
    """The flash kernel's variable-length causal attention.

    query [N, Hq, D], key and value [N, Hkv, D] -> [N, Hq, D]."""
    output, *_ = torch.ops.aten._flash_attention_forward(query, key, value, starts, starts, longest, longest, 0.0, True,
                                                         False, scale=scale)
    return output


# transformers calls an attention function with five positional arguments: module, query, key, value, mask
def varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,  # noqa: PLR0917
                     value: torch.Tensor, attention_mask: torch.Tensor | None, *, dropout: float = 0.0,
                     scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention function: query [1, Hq, N, D], key and value [1, Hkv, N, D] of one packed row ->
    ([1, N, Hq, D], no weights). The bounds come from ``varlen_kwargs``; ValueError without them."""
    starts = kwargs.get("cu_seq_lens_q")
    if starts is None or query.shape[0] != 1:
        raise ValueError(f"{VARLEN} attention takes one packed row with its cu_seq_lens_q (use_remove_padding); got "
                         f"{query.shape[0]} rows{'' if starts is None else ' with cu_seq_lens_q'}")
    if dropout > 0.0 or kwargs.get("sliding_window") is not None:
        raise ValueError(f"{VARLEN} attention has no attention dropout or sliding window; this model asks for "
                         f"dropout {dropout}, sliding_window {kwargs.get('sliding_window')}")
    starts = starts.to(query.device)
    if query.is_cuda and query.dtype in FLASH_DTYPES:
        output = causal_flash(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), starts=starts,
                              longest=int(kwargs["max_length_q"]), scale=scaling)
    else:
        output = causal_per_sequence(query[0], key[0], value[0], starts=starts, scale=scaling)
    return output[None], None


def register() -> None:
    """Make ``VARLEN`` a name transformers accepts as ``attn_implementation`` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN, varlen_attention)
