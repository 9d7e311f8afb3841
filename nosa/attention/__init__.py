"""NOSA attention over selected blocks, the reference implementation (pure PyTorch, autograd).

- ``math``: the shared pieces, imported by everything else (decode, the KV views, the serving
  engine, the kernels' torch references): NEG_INF, compute_dtype, dense_attention,
  attend_gathered (each query row over its own gathered keys, with its log-sum-exp),
  merge_attention, selected_tokens, gather_heads. It imports nothing of nosa.
- ``prefill``: the entry points for prefill and training, nosa_prefill and nosa_prefill_varlen,
  prefill_attention (the serving extend: no selections for rows within dense_len),
  prefill_selection, and attend_selected, which picks the Triton kernel (CUDA), the masked path
  or the gathered path.
- ``masked``: selected-block attention as masked dense SDPA (CPU, short contexts).
- ``gathered``: selected-block attention by gathering each group of rows' blocks (CPU, long
  contexts), with its autograd Function; also the row chunks prefill works in.
- ``paired``: the gathered path without gradients, block by block: each block's keys against
  the rows that selected it, in tiles through torch's fused CPU attention.

This file imports nothing, so importing ``nosa.attention.math`` loads neither the prefill paths
nor nosa.ops and the kernels. Decode is nosa.decode; the selection is nosa.select.
"""
