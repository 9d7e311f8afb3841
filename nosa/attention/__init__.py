"""NOSA attention over selected blocks, the reference implementation (pure PyTorch, autograd).

- ``math``: the shared pieces (compute_dtype, dense_attention, attend_gathered: each query row over
  its own gathered keys with its log-sum-exp, merge_attention); imports only nosa.layout.
- ``prefill``: the entry points for prefill and training (nosa_prefill, nosa_prefill_varlen,
  prefill_attention: the serving extend, prefill_selection) and attend_selected, which picks the
  Triton kernel (CUDA), the masked path or the gathered path.
- ``masked``: masked dense SDPA (CPU, short contexts); ``gathered``: each group of rows' blocks
  gathered (CPU, long contexts), with its autograd Function and the row chunks prefill works in;
  ``paired``: the gathered path without gradients, block by block, in tiles of rows.

This file imports nothing, so importing ``nosa.attention.math`` loads neither the prefill paths
nor nosa.ops and the kernels. Decode is nosa.decode; the selection is nosa.select.
"""
