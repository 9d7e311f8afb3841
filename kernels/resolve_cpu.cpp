// One decode layer's resolve through the device block cache, fused, for CPU servers.
//
// The spec is the torch code of nosa.serve.offload.block_cache.DeviceBlockCache.resolve_layer (its
// path without a prefetch); nosa.kernels.resolve_cpu loads this file and tests compare the two.
// On a CPU that code is about 190 small torch ops per layer, and their dispatch, not the bytes,
// was most of what offloading cost a decode step; here it is one call.
//
// Per (request r, KV head h), every pointer below row-major and contiguous:
//   1. slot diff: a wanted block already in a slot of the group's row is a hit (its first such
//      slot); the misses, in order, take the slots sorted by what they offer (empty, then holding
//      a block not wanted, then kept, then without a column; stable), the k-th miss the k-th slot;
//   2. the misses' blocks written into the slot map, their items copied from the host pool (every
//      buffer: K, V, cis), or listed for the caller to copy (do_copy = 0: the recall scheduler);
//   3. the step's new token written into its tail block's slot (write-through, nosa_write_tokens;
//      the caller's after its own copy);
//   4. counters, and the rows attention reads.
// Rows are diffed against the slot map as it was before the call (padding rows share the spare
// group), then written in row order, as the torch code's index_select / index_copy_ do.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline int64_t item_of(const int64_t* col_of_row, int64_t slot, int64_t h, int64_t hkv, int64_t home) {
    // physical column -> device item of KV head h (python floor division and modulo)
    int64_t col = col_of_row[slot];
    int64_t q = col >= 0 ? col / home : -((-col + home - 1) / home);
    int64_t m = col - q * home;
    return (q * hkv + h) * home + m;
}

// Every entry m with src_idx[m] >= 0 inside [0, src_items) and its dst_idx[m] inside [0, dst_items).
inline bool items_in_range(int64_t M, const int64_t* dst_idx, const int64_t* src_idx, int64_t dst_items,
                           int64_t src_items) {
    for (int64_t m = 0; m < M; ++m)
        if (src_idx[m] >= 0 && (src_idx[m] >= src_items || dst_idx[m] < 0 || dst_idx[m] >= dst_items)) return false;
    return true;
}

// Every wanted block's item inside [0, dev_items) (the tail blocks the new tokens go to among them).
inline bool tail_items_in_range(int64_t n, const int64_t* wanted, const int64_t* item, int64_t dev_items) {
    for (int64_t o = 0; o < n; ++o)
        if (wanted[o] >= 0 && item[o] >= dev_items) return false;
    return true;
}

// nosa_copy_items' copy, its indices checked.
inline void copy_checked(int64_t nbufs, char* const* dst, char* const* src, const int64_t* item_bytes, int64_t M,
                         const int64_t* dst_idx, const int64_t* src_idx) {
    for (int64_t b = 0; b < nbufs; ++b)
        for (int64_t m = 0; m < M; ++m)
            if (src_idx[m] >= 0)
                std::memcpy(dst[b] + dst_idx[m] * item_bytes[b], src[b] + src_idx[m] * item_bytes[b], item_bytes[b]);
}

// nosa_write_tokens' write, its items checked.
inline void write_checked(int64_t R, int64_t H, int64_t W, int64_t B, const int64_t* wanted, const int64_t* lengths,
                          const int64_t* item, int64_t nbufs, char* const* dev, const int64_t* item_bytes,
                          const char* const* new_tok, int64_t dump_row) {
    for (int64_t r = 0; r < R; ++r) {
        const int64_t last = lengths[r] - 1, tail = last / B;
        for (int64_t h = 0; h < H; ++h) {
            int64_t slot_item = -1;
            for (int64_t w = 0; w < W; ++w) {
                const int64_t o = (r * H + h) * W + w;
                if (wanted[o] == tail) slot_item = std::max(slot_item, item[o]);
            }
            const int64_t row = slot_item >= 0 ? slot_item * B + last % B : dump_row;
            for (int64_t b = 0; b < nbufs; ++b) {
                const int64_t tok = item_bytes[b] / B;
                std::memcpy(dev[b] + row * tok, new_tok[b] + (r * H + h) * tok, tok);
            }
        }
    }
}

// float8_e4m3fn byte -> float32 (exact), as a table of the 256 codes (NaN codes never written).
struct Fp8Table {
    float value[256];
    Fp8Table() {
        for (int b = 0; b < 256; ++b) {
            const int exp = (b >> 3) & 15, man = b & 7;
            const float v = exp == 0 ? man / 512.0f : std::ldexp(1.0f + man / 8.0f, exp - 7);
            value[b] = (b & 128) ? -v : v;
        }
    }
};

// float32 -> bfloat16 bits, nearest, ties to even (torch's rounding; inputs are finite)
inline uint16_t bf16_bits(float x) {
    uint32_t bits;
    std::memcpy(&bits, &x, 4);
    return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

// One row of ``per`` dequantized values: value(e) * s (* fac[e]) into ``out`` (bf16 bits or float32).
// The branches are taken once per row, so each loop is a plain one the compiler can vectorise.
template <class Value>
inline void dequant_row(bool bf16, int64_t per, float s, const float* fac, char* out, Value value) {
    if (bf16) {
        uint16_t* o = reinterpret_cast<uint16_t*>(out);
        if (fac == nullptr)
            for (int64_t e = 0; e < per; ++e) o[e] = bf16_bits(value(e) * s);
        else
            for (int64_t e = 0; e < per; ++e) o[e] = bf16_bits(value(e) * s * fac[e]);
    } else {
        float* o = reinterpret_cast<float*>(out);
        if (fac == nullptr)
            for (int64_t e = 0; e < per; ++e) o[e] = value(e) * s;
        else
            for (int64_t e = 0; e < per; ++e) o[e] = value(e) * s * fac[e];
    }
}

}  // namespace

extern "C" {

// copy_items from a quantized host pool (nosa.kvquant): for buffer b, kind[b] 0 copies item_bytes[b]
// bytes as nosa_copy_items does; 1 (int8) and 2 (float8_e4m3fn) dequantize the item's elems[b]
// one-byte values, row[b] per scale (scale[b]: float32 per row), into float32 (out_bf16[b] 0) or
// bfloat16 (1): float(q) * scale (* factor), rounded once, exactly nosa.kvquant.dequantize.
// factor[b]: null, or the key factors [hkv[b], row[b]] float32, item s being KV head s % hkv[b].
// Returns -1, copying nothing, if an index (src_idx >= 0) is outside [0, dst_items) /
// [0, src_items); else 0.
int64_t nosa_copy_items_dequant(int64_t nbufs, char* const* dst, char* const* src, char* const* scale,
                                char* const* factor, const int64_t* kind, const int64_t* out_bf16,
                                const int64_t* item_bytes, const int64_t* elems, const int64_t* row,
                                const int64_t* hkv, int64_t M, const int64_t* dst_idx, const int64_t* src_idx,
                                int64_t dst_items, int64_t src_items) {
    static const Fp8Table fp8;
    if (!items_in_range(M, dst_idx, src_idx, dst_items, src_items)) return -1;
    for (int64_t b = 0; b < nbufs; ++b) {
        for (int64_t m = 0; m < M; ++m) {
            if (src_idx[m] < 0) continue;
            if (kind[b] == 0) {
                std::memcpy(dst[b] + dst_idx[m] * item_bytes[b], src[b] + src_idx[m] * item_bytes[b], item_bytes[b]);
                continue;
            }
            const int64_t n = elems[b], per = row[b];
            const int8_t* q = reinterpret_cast<const int8_t*>(src[b]) + src_idx[m] * n;
            const uint8_t* qb = reinterpret_cast<const uint8_t*>(q);
            const float* sc = reinterpret_cast<const float*>(scale[b]) + src_idx[m] * (n / per);
            const float* fac = factor[b] == nullptr
                ? nullptr : reinterpret_cast<const float*>(factor[b]) + (src_idx[m] % hkv[b]) * per;
            for (int64_t r = 0; r < n / per; ++r) {
                const float s = sc[r];
                const int64_t lo = r * per;
                char* out = dst[b] + (dst_idx[m] * n + lo) * (out_bf16[b] ? 2 : 4);
                if (kind[b] == 1)
                    dequant_row(out_bf16[b] != 0, per, s, fac, out, [&](int64_t e) { return float(q[lo + e]); });
                else
                    dequant_row(out_bf16[b] != 0, per, s, fac, out, [&](int64_t e) { return fp8.value[qb[lo + e]]; });
            }
        }
    }
    return 0;
}

// Item src_idx[m] -> dst_idx[m] of every buffer pair where src_idx[m] >= 0 (nosa.ops.copy_items on
// CPU: the recall, the scheduler's demand and prefetch copies, a prefill's block gather). Returns -1,
// copying nothing, if such an index is outside [0, dst_items) / [0, src_items); else 0.
int64_t nosa_copy_items(int64_t nbufs, char* const* dst, char* const* src, const int64_t* item_bytes, int64_t M,
                        const int64_t* dst_idx, const int64_t* src_idx, int64_t dst_items, int64_t src_items) {
    if (!items_in_range(M, dst_idx, src_idx, dst_items, src_items)) return -1;
    copy_checked(nbufs, dst, src, item_bytes, M, dst_idx, src_idx);
    return 0;
}

// Each request's new token into its tail block's slot (write-through; after the recall, which
// would overwrite it): item [R, H, W] from nosa_resolve_layer; the dump row where the tail block is
// not wanted, e.g. a padding row's. Returns -1, writing nothing, if a tail item is outside
// [0, dev_items); else 0.
int64_t nosa_write_tokens(int64_t R, int64_t H, int64_t W, int64_t B, const int64_t* wanted, const int64_t* lengths,
                          const int64_t* item, int64_t nbufs, char* const* dev, const int64_t* item_bytes,
                          const char* const* new_tok, int64_t dump_row, int64_t dev_items) {
    if (!tail_items_in_range(R * H * W, wanted, item, dev_items)) return -1;
    write_checked(R, H, W, B, wanted, lengths, item, nbufs, dev, item_bytes, new_tok, dump_row);
    return 0;
}

// Returns the number of demand misses M (their items in miss_dst[:M] / miss_src[:M]), or -1 when an
// item index falls outside the buffers (a slot without a column, a page past the host pool). W <= NS.
int64_t nosa_resolve_layer(
    int64_t R, int64_t H, int64_t NS, int64_t W, int64_t B, int64_t home,
    int64_t* blocks,            // [G+1, H, NS] slot map of the layer (updated)
    const int64_t* col_of,      // [G+1, NS] slot -> physical column (-1: none)
    const int64_t* groups,      // [R]
    const int64_t* wanted,      // [R, H, W] block ids, -1 padded
    const int64_t* pages,       // [R, H, W] host page of each wanted block, or null: looked up in
    const int32_t* req_to_token,  // [rows, rtt_stride] SGLang's token slots of each request row
    int64_t rtt_stride,
    const int64_t* table_rows,  // [R] the request rows (page = slot of the block's first token / B)
    const int64_t* lengths,     // [R] context lengths (the new token included)
    const uint8_t* warm,        // [R]
    const uint8_t* real,        // [R], or null: every row counts
    int64_t nbufs,
    char* const* dev,           // [nbufs] device item buffers (k [S, B, D], v, cis [S, B])
    char* const* host,          // [nbufs] host item buffers (k [P*H, B, D], ...)
    const int64_t* item_bytes,  // [nbufs] bytes of one item
    const char* const* new_tok, // [nbufs] new tokens [R, H, ...] (same dtype as the buffer), or null;
                                // written only with do_copy (else: nosa_write_tokens after the copy)
    int64_t dump_row,
    int64_t* counts,            // [7]: steps, selected, hits, misses, warm_selected, warm_hits, prefetch_hits
    int64_t* max_warm_misses,   // [1]
    int64_t* group_misses,      // [G+1]
    int64_t do_copy,
    int64_t* out_item,          // [R, H, W] device item of each wanted block, -1 where none
    int64_t* out_rows,          // [R, H, W*B] buffer rows (item * B + offset; 0 where none)
    uint8_t* out_valid,         // [R, H, W*B]
    int32_t* out_fill,          // [R, H, W] tokens of each block before the sequence's end
    int64_t* miss_dst,          // [R*H*W] demand misses: device item, host item
    int64_t* miss_src,
    int64_t* empty_out,         // [1]: slots with a column but no block left in the counted rows' groups
    int64_t dev_items,          // items in each device / host buffer: an index outside them makes the
    int64_t host_items) {       // call return -1 before it copies anything
    // the slot maps of the step's groups as they were before (rows may share the spare group)
    std::vector<int64_t> before(R * H * NS);
    for (int64_t r = 0; r < R; ++r)
        std::memcpy(&before[r * H * NS], blocks + groups[r] * H * NS, sizeof(int64_t) * H * NS);
    std::vector<int64_t> slot_of(W), order(NS);
    std::vector<uint8_t> keep(NS), hit(W), offer(NS);
    int64_t misses_total = 0, miss_counted = 0, sel_total = 0, hit_total = 0, warm_sel = 0, warm_hit = 0;
    int64_t worst_warm = 0, empty = 0;
    for (int64_t r = 0; r < R; ++r) {
        const int64_t g = groups[r];
        const bool counted = real == nullptr || real[r];
        const bool is_warm = counted && warm[r];
        const int64_t* col_row = col_of + g * NS;
        int64_t row_misses = 0;
        for (int64_t h = 0; h < H; ++h) {
            const int64_t* cur = &before[(r * H + h) * NS];
            const int64_t* want = wanted + (r * H + h) * W;
            std::fill(keep.begin(), keep.end(), 0);
            int64_t n_sel = 0, n_hit = 0, n_miss = 0;
            for (int64_t w = 0; w < W; ++w) {
                hit[w] = 0;
                if (want[w] < 0) continue;
                ++n_sel;
                for (int64_t s = 0; s < NS; ++s) {
                    if (cur[s] == want[w]) {
                        if (!hit[w]) slot_of[w] = s;
                        hit[w] = 1;
                        keep[s] = 1;
                    }
                }
                n_hit += hit[w];
            }
            // slots in the order misses take them: empty, stale, kept, no column (stable)
            for (int64_t s = 0; s < NS; ++s)
                offer[s] = col_row[s] < 0 ? 3 : keep[s] ? 2 : cur[s] >= 0 ? 1 : 0;
            int64_t k = 0;
            for (uint8_t kind = 0; kind < 4; ++kind)
                for (int64_t s = 0; s < NS; ++s)
                    if (offer[s] == kind) order[k++] = s;
            int64_t* map = blocks + (g * H + h) * NS;
            for (int64_t w = 0; w < W; ++w) {
                if (want[w] < 0 || hit[w]) continue;
                const int64_t s = order[n_miss++];
                slot_of[w] = s;
                map[s] = want[w];
            }
            // items, the demand list, the rows attention reads
            const int64_t len = lengths[r];
            for (int64_t w = 0; w < W; ++w) {
                const int64_t o = (r * H + h) * W + w;
                int64_t* rows = out_rows + o * B;
                uint8_t* valid = out_valid + o * B;
                if (want[w] < 0) {
                    out_item[o] = -1;
                    out_fill[o] = 0;
                    for (int64_t t = 0; t < B; ++t) rows[t] = t, valid[t] = 0;
                    continue;
                }
                const int64_t item = item_of(col_row, slot_of[w], h, H, home);
                out_item[o] = item;
                const int64_t start = want[w] * B;
                out_fill[o] = (int32_t)std::min<int64_t>(B, std::max<int64_t>(0, len - start));
                for (int64_t t = 0; t < B; ++t) rows[t] = item * B + t, valid[t] = start + t < len;
                if (!hit[w]) {
                    miss_dst[misses_total] = item;
                    const int64_t page = pages != nullptr ? pages[o]
                                                          : req_to_token[table_rows[r] * rtt_stride + start] / B;
                    miss_src[misses_total] = page * H + h;
                    ++misses_total;
                }
            }
            if (counted) {
                for (int64_t s = 0; s < NS; ++s) empty += col_row[s] >= 0 && map[s] < 0;
                sel_total += n_sel;
                hit_total += n_hit;
                row_misses += n_miss;
                miss_counted += n_miss;
                if (is_warm) {
                    warm_sel += n_sel;
                    warm_hit += n_hit;
                    worst_warm = std::max(worst_warm, n_miss);
                }
            }
        }
        if (counted) group_misses[g] += row_misses;
    }
    const int64_t M = misses_total;
    for (int64_t m = M; m < R * H * W; ++m) miss_dst[m] = miss_src[m] = -1;
    for (int64_t m = 0; m < M; ++m)
        if (miss_dst[m] < 0 || miss_dst[m] >= dev_items || miss_src[m] < 0 || miss_src[m] >= host_items) return -1;
    if (do_copy) {  // the misses were checked just above; the tail items before anything is copied
        if (new_tok != nullptr && !tail_items_in_range(R * H * W, wanted, out_item, dev_items)) return -1;
        copy_checked(nbufs, dev, host, item_bytes, M, miss_dst, miss_src);
        if (new_tok != nullptr)
            write_checked(R, H, W, B, wanted, lengths, out_item, nbufs, dev, item_bytes, new_tok, dump_row);
    }
    counts[0] += 1;
    counts[1] += sel_total;
    counts[2] += hit_total;
    counts[3] += miss_counted;  // every miss is a demand miss here (no prefetch)
    counts[4] += warm_sel;
    counts[5] += warm_hit;
    max_warm_misses[0] = std::max(max_warm_misses[0], worst_warm);
    empty_out[0] = empty;
    return M;
}

}  // extern "C"
