"""nosa.serve.window: the sliding-window layers' attention against dense attention with the window's
mask (the spec: transformers' sliding-window SDPA), from SGLang's pool and from the device ring,
for extends in chunks (a chunk longer than the window, one shorter, a single token) and decode."""

import pytest
import torch

pytest.importorskip("sglang")

from nosa.serve.window import PoolWindows, RingWindows, window_attention  # noqa: E402

W, HQ, HKV, D = 16, 4, 2, 8
SCALE = 0.3


def reference(q, k, v, window):
    """Every row p of q [L, Hq, D] over keys [L, Hkv, D] at positions (p - window, p]."""
    pos = torch.arange(q.shape[0])
    mask = (pos[None] <= pos[:, None]) & (pos[None] > pos[:, None] - window)
    k, v = (t.repeat_interleave(HQ // HKV, dim=1).transpose(0, 1) for t in (k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=SCALE)
    return out.transpose(0, 1)


def tokens(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, HQ, D, generator=g), torch.randn(n, HKV, D, generator=g),
            torch.randn(n, HKV, D, generator=g))


def test_tiled_window_attention_equals_the_masked_reference():
    q, k, v = tokens(83)
    torch.testing.assert_close(window_attention(q, k, v, 0, 0, W, SCALE), reference(q, k, v, W))
    # rows 50..82 with only the keys they can see (from 35)
    torch.testing.assert_close(window_attention(q[50:], k[35:], v[35:], 50, 35, W, SCALE), reference(q, k, v, W)[50:])


class FakePool:
    def __init__(self, size):
        self.k, self.v = torch.zeros(size, HKV, D), torch.zeros(size, HKV, D)

    def get_key_buffer(self, layer_id):
        return self.k

    def get_value_buffer(self, layer_id):
        return self.v


@pytest.mark.parametrize("kind", ["pool", "ring"])
def test_chunked_extends_then_decode_equal_the_reference(kind):
    """Two requests (rows 1 and 2) interleaved: extends of 37, 5 and 1 tokens, then 20 decode steps
    of both at once; every row's output equals the reference over the request's whole sequence."""
    n_total = 37 + 5 + 1 + 20
    seqs = {row: tokens(n_total, seed=row) for row in (1, 2)}
    slots = {1: torch.arange(0, n_total), 2: torch.arange(100, 100 + n_total)}  # their pool slots
    req_to_token = torch.zeros(3, 128, dtype=torch.int32)
    for row, s in slots.items():
        req_to_token[row, :n_total] = s
    pool = FakePool(200)
    windows = PoolWindows(pool, req_to_token, W) if kind == "pool" else RingWindows([5], 3, W, HKV, D, D,
                                                                                       torch.float32, "cpu")
    got = {row: [] for row in seqs}
    done = 0
    for n in (37, 5, 1):
        for row, (q, k, v) in seqs.items():
            new = slice(done, done + n)
            pool.k[slots[row][new]], pool.v[slots[row][new]] = k[new], v[new]
            got[row].append(windows.extend(5, row, slots[row][: done + n], q[new], k[new], v[new], SCALE))
        done += n
    rows = torch.tensor([1, 2])
    for _ in range(20):
        q, k, v = (torch.stack([seqs[r][i][done] for r in (1, 2)]) for i in range(3))
        for j, row in enumerate((1, 2)):
            pool.k[slots[row][done]], pool.v[slots[row][done]] = k[j], v[j]
        out = windows.decode(5, rows, torch.tensor([done + 1] * 2), q, k, v, SCALE)
        for j, row in enumerate((1, 2)):
            got[row].append(out[j : j + 1])
        done += 1
    for row, (q, k, v) in seqs.items():
        torch.testing.assert_close(torch.cat(got[row]), reference(q, k, v, W), atol=1e-5, rtol=1e-5)
