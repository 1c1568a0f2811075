"""Step inputs: the fixed-shape tensors one engine step reads, filled in place from a list of sequence chunks.

A `StepInputs` is allocated once per bucket (T tokens, S sequence slots) on the engine's device and refilled
every step; nothing here allocates tensor storage after construction. Padding follows the kernels' sentinels:
padding token rows write no KV (slot -1) and padding sequences have context length 0; a bucket never filled
(as CUDA graph capture sees it) is all padding, so running it writes no KV row.

On a CPU device the step reads the host buffers `fill` writes. On CUDA, `fill` writes one of two pinned host
sets and copies it to the device buffers the step (and its captured graph) reads, asynchronously on the current
stream, recording an event; the next `fill` of that host set first waits for its event. So a host buffer is never
rewritten while a copy from it is in flight, even across steps that sample nothing and so never synchronise.
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


STEP_INPUT_DTYPES = (("input_ids", torch.int64), ("positions", torch.int64), ("slot_mapping", torch.int64),
                     ("query_start", torch.int32), ("slab_offset", torch.int64), ("context_len", torch.int32),
                     ("logits_indices", torch.int64))


def step_input_shapes(num_tokens: int, max_seqs: int) -> dict[str, int]:
    """Length of each step input of a bucket. logits_indices: R = logits_rows(T, S), since a step of T tokens
    holds at most T sequences, so a small bucket computes only the logits it can need (the lm_head GEMM is the
    largest of the step)."""
    t, s = num_tokens, max_seqs
    return {"input_ids": t, "positions": t, "slot_mapping": t, "query_start": s + 1, "slab_offset": s,
            "context_len": s, "logits_indices": logits_rows(t, s)}


class _HostInputs:
    """One set of host buffers (pinned when they feed a CUDA device) and the packing of chunks into them."""

    def __init__(self, num_tokens: int, max_seqs: int, pin: bool):
        self.num_tokens, self.max_seqs = num_tokens, max_seqs
        sizes = step_input_shapes(num_tokens, max_seqs)
        self.tensors = {name: torch.zeros(sizes[name], dtype=dt, pin_memory=pin) for name, dt in STEP_INPUT_DTYPES}
        self.tensors["slot_mapping"].fill_(-1)  # all padding until filled
        self._np = {name: t.numpy() for name, t in self.tensors.items()}

    def fill(self, chunks: Sequence[SeqChunk]) -> int:
        a = self._np
        total = sum(len(c.token_ids) for c in chunks)
        if len(chunks) > self.max_seqs or total > self.num_tokens:
            raise ValueError(f"step holds at most {self.max_seqs} sequences and {self.num_tokens} tokens, "
                             f"got {len(chunks)} sequences and {total} tokens")
        for s, c in enumerate(chunks):
            if c.slab_tokens and c.start_pos + len(c.token_ids) > c.slab_tokens:
                raise ValueError(f"sequence {s} needs {c.start_pos + len(c.token_ids)} KV rows but its slab holds "
                                 f"{c.slab_tokens}")
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


class StepInputs:
    """Preallocated inputs of one bucket on `device`. `fill` writes them in place and returns the number of real
    tokens; `tensors()` are the buffers the step reads (the same tensors for the engine's whole life)."""

    def __init__(self, num_tokens: int, max_seqs: int, device: torch.device | str = "cpu"):
        self.num_tokens = num_tokens
        self.max_seqs = max_seqs
        self.device = torch.device(device)
        on_host = self.device.type == "cpu"
        self._hosts = [_HostInputs(num_tokens, max_seqs, pin=not on_host) for _ in range(1 if on_host else 2)]
        if on_host:
            self._device = self._hosts[0].tensors
            self._copied: list = []
        else:
            self._device = {name: torch.empty_like(t, device=self.device) for name, t in self._hosts[0].tensors.items()}
            for name, t in self._device.items():
                t.copy_(self._hosts[0].tensors[name])  # padding until the first fill
            self._copied = [torch.cuda.Event() for _ in self._hosts]
        self._next = 0

    def tensors(self) -> dict[str, torch.Tensor]:
        return self._device

    def host_tensors(self) -> dict[str, torch.Tensor]:
        """The host set the last `fill` wrote (on CPU, the step's own buffers)."""
        return self._hosts[(self._next - 1) % len(self._hosts)].tensors

    def fill(self, chunks: Sequence[SeqChunk]) -> int:
        """Pack `chunks` (in order) into the flat batch; raise ValueError if they do not fit the bucket."""
        i = self._next
        if self._copied:
            self._copied[i].synchronize()  # the copy that last read this host set is done
        rows = self._hosts[i].fill(chunks)
        if self._copied:
            host = self._hosts[i].tensors
            for name, dst in self._device.items():
                dst.copy_(host[name], non_blocking=True)
            self._copied[i].record()
        self._next = (i + 1) % len(self._hosts)
        return rows
