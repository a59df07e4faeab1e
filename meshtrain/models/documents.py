"""Document masking of packed samples: attention never crosses a document boundary.

Packing joins documents with EOS, so a sample of seq_len tokens may hold the end of one document and
the start of others. From the input ids alone (a token after an EOS starts a new document) come each
token's document id, the block-causal mask (a token attends to earlier tokens of its own document),
and, with ``data.reset_position_ids``, RoPE positions that restart at each document, so a packed
sample computes what its documents would compute one by one. Megatron's names: reset_attention_mask,
reset_position_ids. The mask goes to SDPA as a boolean ``attn_mask`` (the math kernel on CPU, the
memory-efficient one on CUDA).

The model asks ``attention_mask``, ``token_positions``, ``query_key_positions`` and ``every_key``
(module attributes, looked up at each call) for what a batch's ids mean; context parallelism
(parallel/context.py) replaces them while a batch is sharded over the sequence, where a rank's
queries meet every rank's keys.
"""

from __future__ import annotations

import torch


def document_ids(inputs: torch.Tensor, eos_id: int) -> torch.Tensor:
    """[batch, seq] ids: 0 for the first document of each sample, +1 after every EOS."""
    starts = torch.zeros_like(inputs, dtype=torch.int32)
    starts[:, 1:] = (inputs[:, :-1] == eos_id).to(torch.int32)
    return starts.cumsum(1, dtype=torch.int32)


def block_causal_mask(ids: torch.Tensor) -> torch.Tensor:
    """[batch, 1, seq, seq] bool: query i may attend key j iff j <= i in the same document."""
    seq = ids.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=ids.device).tril()
    return ((ids[:, :, None] == ids[:, None, :]) & causal)[:, None]


def positions_in_document(ids: torch.Tensor) -> torch.Tensor:
    """[batch, seq] each token's offset from the start of its document."""
    seq = ids.shape[1]
    index = torch.arange(seq, device=ids.device).expand_as(ids)
    new = torch.ones_like(ids, dtype=torch.bool)
    new[:, 1:] = ids[:, 1:] != ids[:, :-1]
    start = torch.where(new, index, torch.zeros_like(index)).cummax(1).values
    return index - start


def attention_mask(ids: torch.Tensor) -> torch.Tensor | None:
    """What attention uses for a batch's document ids: None where no sample holds two documents
    (plain causal attention, flash kernels), else the block-causal mask."""
    return block_causal_mask(ids) if bool(ids[:, -1].any()) else None


def query_key_positions(seq: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query's and each key's position in the whole sequence, for masks built from distances
    (sliding windows): 0..seq-1 both; under context parallelism a rank's queries are its
    load-balanced share and the keys are every rank's (parallel/context.py replaces this)."""
    positions = torch.arange(seq, device=device)
    return positions, positions


def every_key(key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values a query may meet ([batch, heads, seq, head_dim]), for attention computed
    without SDPA (soft-capped scores): these; under context parallelism every rank's."""
    return key, value


def token_positions(ids: torch.Tensor, reset: bool, mask: torch.Tensor | None) -> torch.Tensor | None:
    """Per-token RoPE positions, or None for 0, 1, ..., seq-1."""
    return positions_in_document(ids) if reset and mask is not None else None
