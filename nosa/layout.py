"""The tensor layout, NEG_INF and the index primitives that nosa/ and the kernels' references share.

Dimension letters (every shape in nosa/, kernels/ and serve/ uses them): n query rows (the last n
tokens of an L-token context); L context tokens; R sequences (rows) of a batch; Hq query heads,
Hkv KV heads, G = Hq // Hkv; D head dim (Dv of values); B block size; NB blocks of a context;
C compressed windows; K selected blocks per row (topk_blocks); T keys gathered per row
(e.g. K * B); W blocks per (sequence, KV head) being resolved; U blocks of a chunk's union; N rows
of a token-slot pool; P pages (blocks) of a host pool; S slots of a device block cache; NS slots
per (sequence, KV head); M items of a copy. Layout is token-major as in SGLang: q [n, Hq, D];
k, v [L, Hkv, D]; cis [L, Hkv]; sel [n, Hkv, K] (-1 = no block). Imports only torch.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")  # the logit of a key to skip, and the lse of a row with no key


def selected_tokens(sel: torch.Tensor, lengths: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens of the selected blocks: sel [n, Hkv, K] (-1 = none), lengths [n] (tokens each row
    may see) -> (tokens [n, Hkv, K * block_size], valid [n, Hkv, K * block_size]). Invalid entries
    (missing blocks, tokens at or past the length) are clamped to a real token and must be masked."""
    lengths = lengths[:, None, None]
    blocks = torch.where(sel >= 0, sel, lengths)  # missing blocks land past the end
    tokens = (blocks[..., None] * block_size + torch.arange(block_size, device=sel.device)).flatten(-2)
    valid = tokens < lengths
    return torch.minimum(tokens, lengths - 1), valid


def block_token_ids(blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """[U] block ids -> [U * B] token positions."""
    return (blocks[:, None] * block_size + torch.arange(block_size, device=blocks.device)).flatten()


def gather_heads(x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """x [L, Hkv, ...] (any strides), tokens [Hkv, T] -> [Hkv, T, ...]: row tokens[h] of head h.
    One index_select per KV head: several times faster on CPU than x[tokens, heads]."""
    return torch.stack([x[:, h].index_select(0, tokens[h]) for h in range(tokens.shape[0])])
