"""Step inputs: the fixed-shape tensors one engine step reads, filled in place from a list of sequence chunks.

A `StepInputs` is allocated once per bucket (T tokens, S sequence slots) and refilled every step; nothing here
allocates tensor storage after construction. Padding follows the kernels' sentinels: padding token rows write no
KV (slot -1) and padding sequences have context length 0.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class SeqChunk:
    """The tokens one sequence contributes to a step: `token_ids` go at positions start_pos, start_pos+1, ..."""

    slab_offset: int          # first KV row of the sequence's slab
    start_pos: int            # tokens of this sequence already in its slab
    token_ids: Sequence[int]  # new tokens (a prefill chunk, or one decode token)
    slab_tokens: int = 0      # capacity of the slab in rows; 0 = unchecked


def logits_rows(num_tokens: int, max_seqs: int) -> int:
    """Rows of logits a step of `num_tokens` tokens returns: one per sequence it can hold."""
    return min(num_tokens, max_seqs)


class StepInputs:
    """Preallocated inputs of one bucket. `fill` writes them in place and returns the number of real tokens."""

    def __init__(self, num_tokens: int, max_seqs: int, device: torch.device | str = "cpu"):
        self.num_tokens = num_tokens
        self.max_seqs = max_seqs
        pin = torch.device(device).type == "cuda"
        def buf(n: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(n, dtype=dtype, pin_memory=pin)
        self.input_ids = buf(num_tokens, torch.int64)       # (T,)
        self.positions = buf(num_tokens, torch.int64)       # (T,)
        self.slot_mapping = buf(num_tokens, torch.int64)    # (T,)
        self.query_start = buf(max_seqs + 1, torch.int32)   # (S+1,)
        self.slab_offset = buf(max_seqs, torch.int64)       # (S,)
        self.context_len = buf(max_seqs, torch.int32)       # (S,)
        # (R,) R = logits_rows(T, S): a step of T tokens holds at most T sequences, so a small bucket computes
        # only the logits it can need (the lm_head GEMM is the largest of the step)
        self.logits_indices = buf(logits_rows(num_tokens, max_seqs), torch.int64)
        self._np = {name: t.numpy() for name, t in self.tensors().items()}

    def tensors(self) -> dict[str, torch.Tensor]:
        return {
            "input_ids": self.input_ids, "positions": self.positions, "slot_mapping": self.slot_mapping,
            "query_start": self.query_start, "slab_offset": self.slab_offset, "context_len": self.context_len,
            "logits_indices": self.logits_indices,
        }

    def fill(self, chunks: Sequence[SeqChunk]) -> int:
        """Pack `chunks` (in order) into the flat batch; raise ValueError if they do not fit the bucket."""
        a = self._np
        total = sum(len(c.token_ids) for c in chunks)
        if len(chunks) > self.max_seqs or total > self.num_tokens:
            raise ValueError(f"step holds at most {self.max_seqs} sequences and {self.num_tokens} tokens, "
                             f"got {len(chunks)} sequences and {total} tokens")
        a["slot_mapping"][:] = -1
        a["input_ids"][:] = 0
        a["positions"][:] = 0
        a["slab_offset"][:] = 0
        a["context_len"][:] = 0
        a["logits_indices"][:] = 0
        row = 0
        for s, c in enumerate(chunks):
            n = len(c.token_ids)
            end_pos = c.start_pos + n
            if c.slab_tokens and end_pos > c.slab_tokens:
                raise ValueError(f"sequence {s} needs {end_pos} KV rows but its slab holds {c.slab_tokens}")
            a["query_start"][s] = row
            a["input_ids"][row : row + n] = c.token_ids
            a["positions"][row : row + n] = range(c.start_pos, end_pos)
            a["slot_mapping"][row : row + n] = range(c.slab_offset + c.start_pos, c.slab_offset + end_pos)
            a["slab_offset"][s] = c.slab_offset
            a["context_len"][s] = end_pos
            a["logits_indices"][s] = row + n - 1
            row += n
        a["query_start"][len(chunks) :] = row
        return row
