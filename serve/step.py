"""ForwardStep: what every layer of one forward pass reads, built once per forward.

SGLang calls the backend's ``init_forward_metadata`` once per forward pass (a decode step, or an
extend: prefill, chunked prefill, prefix-cache hit) and then ``forward_decode`` /
``forward_extend`` once per layer. The batch's per-request facts are turned into plain lists and
tensors here, once, so that no layer rebuilds them.

Shapes: R requests in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ForwardStep:
    """One forward pass of the batch.

    rows: each request's row of SGLang's ReqToTokenPool; lengths: its context in tokens, this
    forward's included; extend: the tokens this forward adds (1 each in a decode step); slots: its
    token slots [length] (a view of ``req_to_token[row, :length]``); table_rows [R] long: the rows
    as a device tensor (one-gather lookups in ``req_to_token``); decode: a decode step (else an
    extend); groups [R] long: each request's device group in the offloading engine's block cache
    (None without offloading).
    """

    rows: list[int]
    lengths: list[int]
    extend: list[int]
    slots: list[torch.Tensor]
    table_rows: torch.Tensor
    decode: bool
    groups: torch.Tensor | None = None

    @classmethod
    def of(cls, forward_batch, req_to_token: torch.Tensor, groups_of=None) -> "ForwardStep":
        """From SGLang's ForwardBatch; ``groups_of(rows) -> [R]`` gives the device groups when
        offloading (nosa.serve.offload.engine.OffloadEngine.groups_of)."""
        rows = forward_batch.req_pool_indices.tolist()
        seq_lens = forward_batch.seq_lens_cpu if forward_batch.seq_lens_cpu is not None else forward_batch.seq_lens
        lengths = seq_lens.tolist()
        decode = forward_batch.forward_mode.is_decode()
        if decode:
            extend = [1] * len(rows)
        elif forward_batch.extend_seq_lens_cpu is not None:
            extend = list(forward_batch.extend_seq_lens_cpu)
        else:
            extend = forward_batch.extend_seq_lens.tolist()
        return cls(rows=rows, lengths=lengths, extend=extend,
                   slots=[req_to_token[row, :n] for row, n in zip(rows, lengths)],
                   table_rows=forward_batch.req_pool_indices.long(), decode=decode,
                   groups=None if groups_of is None else groups_of(rows))
