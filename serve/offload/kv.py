"""OffloadKV: the KV view (nosa.kv) of one layer of a batch whose KV lives in the host pool.

- ``keys`` / ``cis``: token rows read from the host pool (a state's newest compressed window,
  or its catch-up after a prefill chunk);
- ``gather_blocks``: a prefill chunk's union of blocks, copied from the host pool into a working
  buffer as whole (block, KV head) items (the context is never resident as a whole);
- ``resolve``: the decode step's blocks through the device block cache (diff, one batched recall,
  write-through of the new token; nosa.serve.offload.block_cache and .resolve).
``predicted_blocks`` is the guess of a decode step's selection that the next layer's prefetch
copies ahead (nosa.serve.offload.engine). Every read goes through nosa.ops.copy_items, which on
CUDA reads the pinned host pool directly.
"""

from __future__ import annotations

import torch

from nosa import kvquant, ops
from nosa.kvquant import QuantizedItems
from nosa.layout import NEG_INF
from nosa.select import static_selection
from nosa.serve.metadata import ForwardMetadata
from nosa.serve.offload.resolve import NewTokens, host_pages


class OffloadKV:
    """Layer ``layer_id`` of the requests of ``metadata`` (nosa.serve.metadata.ForwardMetadata): their tokens in
    the host pool ``pool`` (nosa.serve.offload.host_pool.HostKVPool) at the slots ``req_to_token``
    lists, the blocks a decode step attends to in the device block ``cache``. ``new_tokens``: the
    decode step's token of each request in this layer, written through into the cache on resolve."""

    def __init__(self, pool, cache, req_to_token: torch.Tensor, layer_id: int, metadata: ForwardMetadata, device,
                 new_tokens: NewTokens | None = None):
        self.pool, self.cache, self.req_to_token, self.layer_id = pool, cache, req_to_token, layer_id
        self.metadata, self.device, self.new_tokens = metadata, device, new_tokens
        self.block = pool.page_size
        self.host = pool.items(layer_id)  # (k [P*Hkv, B, D], v, cis [P*Hkv, B]); k, v may be QuantizedItems
        self.quantized = isinstance(self.host[0], QuantizedItems)
        self.exact_keys: dict[int, tuple[int, torch.Tensor]] = {}  # seq -> (first position, keys [n, Hkv, D])

    def length(self, i: int) -> int:
        return self.metadata.lengths[i]

    def _token_read(self, which: int, i: int, lo: int, hi: int) -> torch.Tensor:
        rows = self.pool.token_rows(self.req_to_token[self.metadata.rows[i], lo:hi]).to(self.device)  # [n, Hkv]
        src = self.host[which]
        width = src.shape[-1] if which < 2 else 1
        if isinstance(src, QuantizedItems) and src.factor is not None:  # keys with factors: token row's head
            at = rows.flatten().to(src.data.device)
            head = (at // self.block) % src.factor.shape[0]
            data, scale = src.data.view(-1, width).index_select(0, at), src.scale.view(-1).index_select(0, at)
            out = kvquant.dequantize(data, scale, src.dtype, src.factor.to(at.device)[head])
            return out.to(self.device).view(*rows.shape, width)
        out = torch.empty(rows.numel(), width, dtype=src.dtype, device=self.device)
        if isinstance(src, QuantizedItems):  # token rows [P*Hkv*B, D] with one scale each
            tokens = QuantizedItems(src.data.view(-1, width), src.scale.view(-1), src.dtype)
        else:
            tokens = src.view(-1, width)
        ops.copy_items([out], [tokens], torch.arange(rows.numel(), device=self.device), rows.flatten())
        return out.view(*rows.shape, width) if which < 2 else out.view(rows.shape)

    def keys(self, i: int, lo: int, hi: int) -> torch.Tensor:
        """Keys of tokens [lo, hi) of sequence i, from ``exact_keys`` where they cover the range (a
        quantized pool: the compressed keys the selection reads stay exact), else the host pool."""
        exact = self.exact_keys.get(i)
        if exact is not None and exact[0] <= lo and hi <= exact[0] + exact[1].shape[0]:
            return exact[1][lo - exact[0] : hi - exact[0]]
        return self._token_read(0, i, lo, hi)

    def cis(self, i: int, lo: int, hi: int) -> torch.Tensor:
        return self._token_read(2, i, lo, hi)

    def gather_blocks(self, i: int, blocks: torch.Tensor, block_size: int):
        hkv = self.pool.head_num
        table_row = self.metadata.table_rows[i : i + 1]
        pages = host_pages(self.req_to_token, table_row, blocks[None, None], self.block)[0, 0].to(self.device)  # [U]
        src = (pages[:, None] * hkv + torch.arange(hkv, device=self.device)).flatten()
        work = [torch.empty(src.numel(), *t.shape[1:], dtype=t.dtype, device=self.device) for t in self.host]
        ops.copy_items(work, list(self.host), torch.arange(src.numel(), device=self.device), src)
        u = blocks.numel()
        # items [U * Hkv, B, ...] -> token-major [U * B, Hkv, ...]
        return tuple(w.view(u, hkv, block_size, *w.shape[2:]).transpose(1, 2).reshape(u * block_size, hkv, *w.shape[2:])
                     for w in work)

    def resolve(self, blocks: torch.Tensor, lengths: torch.Tensor, block_size: int):
        pages = host_pages(self.req_to_token, self.metadata.table_rows, blocks, self.block)
        return self.cache.resolve(self.layer_id, self.metadata.groups, blocks, self.metadata.lengths, pages, self.host,
                                  self.new_tokens)


def exact_prefill_keys(pool, layer: int, row: int, state, k_new: torch.Tensor, prefix: int):
    """(first position, exact keys [n, Hkv, D]) an extend of a quantized host pool reads its
    compressed keys from (``OffloadKV.exact_keys``): the new tokens' ``k_new`` (at positions prefix..)
    and, when the row's key ring (nosa.state_pool.StatePool.tail_k) holds the tokens just before them,
    up to compress_kernel of those (the windows that straddle the chunk's start). Without the ring (a
    prefix-cache hit: the prefix was written by another request) the earlier keys come from the host
    pool, dequantized."""
    c = pool.cfg.compress_kernel
    if prefix and getattr(state.store, "tails_at", None) == prefix:
        m = min(c, prefix)
        ring = pool.tail_k[layer][row, torch.arange(prefix - m, prefix, device=pool.device) % c]
        return prefix - m, torch.cat([ring.to(k_new.device, k_new.dtype), k_new])
    return prefix, k_new


def token_rows(loc: torch.Tensor, page_size: int, head_num: int) -> torch.Tensor:
    """[T] token slots -> [T, Hkv] rows of a host pool's [P*Hkv*B, D] token view (the page-major
    layout of nosa.serve.offload.host_pool): token s, head h at ((s // B) * Hkv + h) * B + s % B."""
    loc = loc.long()
    page, off = loc // page_size, loc % page_size
    heads = torch.arange(head_num, device=loc.device)
    return (page[:, None] * head_num + heads) * page_size + off[:, None]


class TokenRowMemo:
    """``token_rows`` of the last ``loc`` seen: every layer of a forward writes the same slots, so
    their rows are computed once per forward (CPU tensors). Compared by value (one small
    ``torch.equal``): a graph runner refills its static buffer in place, and inference tensors keep
    no version counter."""

    def __init__(self, page_size: int, head_num: int):
        self.page_size, self.head_num = page_size, head_num
        self._last = None

    def __call__(self, loc: torch.Tensor) -> torch.Tensor:
        if loc.device.type != "cpu" or torch.compiler.is_compiling():
            # on a GPU the comparison would synchronise (and break a CUDA graph's capture); a compiled
            # step computes the rows in its graph
            return token_rows(loc, self.page_size, self.head_num)
        last = self._last
        if last is not None and last[0].shape == loc.shape and last[0].dtype == loc.dtype and torch.equal(last[0], loc):
            return last[1]
        rows = token_rows(loc, self.page_size, self.head_num)
        self._last = (loc.clone(), rows)
        return rows


def write_token_rows(dst: list[torch.Tensor], src: list[torch.Tensor], rows: torch.Tensor) -> None:
    """Rows of new tokens src[i] [N, W] into rows ``rows`` [N] of the host pool's token views dst[i]
    [P*Hkv*B, W]. On one device (a CPU server) a plain index_copy_ per tensor, which a compiled step
    fuses into its own code; from a GPU into pinned host memory, one nosa.ops.copy_items launch."""
    if all(d.device == s.device for d, s in zip(dst, src)):
        rows = rows.to(dst[0].device)
        for d, s in zip(dst, src):
            if d.dtype == torch.float8_e4m3fn:  # (torch has no index_copy_ for fp8 on CPU: copy its bytes)
                d, s = d.view(torch.uint8), s.view(torch.uint8)
            d.index_copy_(0, rows, s)
        return
    # contiguous: with one KV head (per TP rank) the reshape is still a strided view of SGLang's qkv.
    # The rows stay on the GPU beside the tokens: the kernel reads its index lists there, and a copy
    # of them into pageable host memory cannot be captured (found by graph_check on the H200)
    ops.copy_items(dst, [s.contiguous() for s in src], rows.to(src[0].device),
                   torch.arange(rows.numel(), device=src[0].device))


def write_kv_rows(k_items, v_items, k_new: torch.Tensor, v_new: torch.Tensor, rows: torch.Tensor,
                  extra: tuple[list, list] = ([], [])) -> None:
    """New tokens' K and V [N, D] into rows ``rows`` [N] of a host pool's items k_items, v_items
    ([P*Hkv, B, D] tensors, or nosa.kvquant.QuantizedItems: a quantized pool, NOSA_HOST_KV_DTYPE,
    each token quantized once here, unchecked for inf / nan: a host read a captured step cannot make,
    and such a token reads back as nan, as it would from a pool in the model's dtype), through the
    items' own views (a write through another view of a buffer the recall's operator touches made
    torch.compile copy the whole buffer). ``extra``: more (dst token views, src rows) in the same call."""
    d = k_new.shape[-1], v_new.shape[-1]
    if not isinstance(k_items, QuantizedItems):
        write_token_rows([k_items.view(-1, d[0]), v_items.view(-1, d[1]), *extra[0]], [k_new, v_new, *extra[1]], rows)
        return
    factor = k_items.factor  # int8 keys' factors [Hkv, D]: rows of k_new are (token, KV head), head-minor
    qk, sk = kvquant.quantize(k_new if factor is None else k_new.view(-1, *factor.shape), k_items.data.dtype,
                              check_finite=False, factor=factor)
    qk, sk = qk.view(-1, d[0]), sk.view(-1)
    qv, sv = kvquant.quantize(v_new, v_items.data.dtype, check_finite=False)
    write_token_rows([k_items.data.view(-1, d[0]), k_items.scale.view(-1, 1), v_items.data.view(-1, d[1]),
                      v_items.scale.view(-1, 1), *extra[0]], [qk, sk[:, None], qv, sv[:, None], *extra[1]], rows)


def predicted_blocks(states, lengths: list[int], cfg) -> torch.Tensor:
    """[R, Hkv, 2K] blocks the decode step of context ``lengths`` will probably select, per request
    (states: its NosaDecodeState in the layer, or None): the static part of the new token's
    selection (nosa.select.static_selection: by the locality theorem it stays selected) first, then
    the previous step's selection; every block for requests within dense_len. -1 padded."""
    known = [s for s in states if s is not None]
    if not known:
        raise ValueError("predicted_blocks: no state to predict from")
    hkv, device, k = known[0].num_kv_heads, known[0].static_keys.device, cfg.topk_blocks
    rows, nb = len(states), cfg.num_blocks(max(lengths))
    static = torch.full((rows, hkv, nb, 2), NEG_INF, device=device)
    previous = torch.full((rows, hkv, k), -1, dtype=torch.long, device=device)
    for i, state in enumerate(states):
        if state is not None:
            keys = state.static_keys[:, :nb]
            static[i, :, : keys.shape[1]] = keys
            if state.selection is not None:
                previous[i] = state.selection
    positions = torch.tensor(lengths, device=device) - 1
    out = torch.cat([static_selection(static, positions, cfg), previous], dim=-1)
    every = torch.arange(2 * k, device=device).expand(rows, hkv, 2 * k)
    count = torch.tensor([cfg.num_blocks(n) for n in lengths], device=device)[:, None, None]
    dense = (positions + 1 <= cfg.dense_len)[:, None, None]
    out = torch.where(dense, torch.where(every < count, every, -1), out)
    missing = torch.tensor([s is None for s in states], device=device)[:, None, None]
    return torch.where(missing, -1, out)
