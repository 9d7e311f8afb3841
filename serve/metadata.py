"""ForwardMetadata: what every layer of one forward pass reads, built once per forward.

SGLang calls the backend's ``init_forward_metadata`` once per forward pass (a decode step, or an
extend: prefill, chunked prefill, prefix-cache hit) and then ``forward_decode`` /
``forward_extend`` once per layer. The batch's per-request facts are turned into plain lists and
tensors here, once, so that no layer rebuilds them.

Shapes: R requests in the batch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ForwardMetadata:
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

    def without_new_tokens(self) -> "ForwardMetadata":
        """The same requests as they were before this forward's tokens (lengths minus extend)."""
        return dataclasses.replace(self, lengths=[n - e for n, e in zip(self.lengths, self.extend)],
                                   slots=[s[: n - e] for s, n, e in zip(self.slots, self.lengths, self.extend)])

    @classmethod
    def decode_of(cls, rows: list[int], lengths: list[int], req_to_token: torch.Tensor, groups_of=None,
                  table_rows: torch.Tensor | None = None) -> "ForwardMetadata":
        """A decode step of requests at ``rows`` (0 = a padding row) with contexts ``lengths``."""
        if table_rows is None:
            table_rows = torch.tensor(rows, dtype=torch.long, device=req_to_token.device)
        return cls(rows=rows, lengths=lengths, extend=[1] * len(rows),
                   slots=[req_to_token[row, :n] for row, n in zip(rows, lengths)], table_rows=table_rows.long(),
                   decode=True, groups=None if groups_of is None else groups_of(rows))

    @classmethod
    def of(cls, forward_batch, req_to_token: torch.Tensor, groups_of=None) -> "ForwardMetadata":
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


def captured() -> bool:
    """Whether the code running now is being recorded rather than run: traced by torch.compile
    (SGLang's CPU graph runner) or captured into a CUDA graph. Host work (timing, counters read
    on the host, the recall scheduler's threads) is skipped then: a captured step must not
    synchronise with the host, and it would not run at replay anyway."""
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


@dataclass(frozen=True)
class ReadSpans:
    """How far a decode step reads per request: ``windows`` compressed keys, ``blocks`` static
    keys and ``width`` blocks to attend (nosa.decode.read_blocks). ``static``: the step may be
    captured, so nothing may synchronise with the host and the shapes may not follow the batch:
    ``windows`` / ``blocks`` are the longest context's (a CUDA graph), or None, a context bucket
    the selection picks on the lengths (SGLang's CPU graph runner: StatePool.select);
    otherwise they follow the batch (a shorter context reads less). In a step that is not
    captured, what the host knows lets it skip work: ``completes``, whether a request's new token
    may complete a compressed window or a block (else the state only records the token);
    ``dense``, when every request is within dense_len, their (row, length): the step skips the
    selection and attends each context densely, as torch_native does."""

    windows: int | None
    blocks: int | None
    width: int
    static: bool
    completes: bool = True
    dense: tuple[tuple[int, int], ...] | None = None


@dataclass
class StepInputs:
    """A decode step's per-request tensors, R rows (R = the batch, or its graph's padded size):
    rows [R] long, the ReqToTokenPool row (0 for a padding row); lengths [R] long, the context with
    the new token; num_real [] long, how many leading rows are requests (the rest pad a graph's
    batch); real [R] bool, a request row; groups [R] long, the offloading engine's device group
    (its spare group for padding); warm [R] bool, the group's blocks were resident after its
    previous step (counters); spans: what the step reads (ReadSpans). The tensors are views of
    buffers allocated once (``InputBuffers``), written in place before each step, so a captured
    step reads them at the same addresses."""

    rows: torch.Tensor
    lengths: torch.Tensor
    num_real: torch.Tensor
    real: torch.Tensor
    groups: torch.Tensor
    warm: torch.Tensor
    spans: ReadSpans | None = None


class InputBuffers:
    """The buffers behind StepInputs, for up to ``capacity`` requests, with one StepInputs per
    batch size (the same object every step of that size)."""

    def __init__(self, capacity: int, device):
        self.device = device
        self._views: dict[int, StepInputs] = {}
        self._alloc(capacity)

    def _alloc(self, capacity: int) -> None:
        long = dict(dtype=torch.long, device=self.device)
        self.rows = torch.zeros(capacity, **long)
        self.lengths = torch.ones(capacity, **long)
        self.num_real = torch.zeros((), **long)
        self.real = torch.zeros(capacity, dtype=torch.bool, device=self.device)
        self.groups = torch.zeros(capacity, **long)
        self.warm = torch.zeros(capacity, dtype=torch.bool, device=self.device)
        self._views.clear()

    @property
    def capacity(self) -> int:
        return self.rows.shape[0]

    def view(self, size: int, grow: bool = True) -> StepInputs:
        """The inputs of a batch of ``size`` rows; more rows than allocated reallocate (only when
        ``grow``: a captured step holds the old addresses)."""
        if size > self.capacity:
            if not grow:
                raise ValueError(f"nosa backend: a decode batch of {size} is larger than its graph buffers "
                                 f"({self.capacity})")
            self._alloc(max(size, 2 * self.capacity))
        inputs = self._views.get(size)
        if inputs is None:
            inputs = self._views[size] = StepInputs(self.rows[:size], self.lengths[:size], self.num_real,
                                                    self.real[:size], self.groups[:size], self.warm[:size])
        return inputs
