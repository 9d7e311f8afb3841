// The block selection of a decode step's rows, for CPU servers.
//
// The spec is nosa.select.select_blocks (the one implementation training and serving share);
// nosa.kernels.select_cpu loads this file and tests compare the two on every input they share. On a
// CPU that function is about a hundred small torch ops per call, each a pass over every block of the
// context, and their dispatch grew the decode step with the context (a 64K-token request has 1,024
// blocks of 64). Here each (row, KV head) is one pass over its blocks and two partial selections.
//
// Everything the torch code compares is an integer key built from the float32 scores, so the result
// is the same bit for bit:
//   ordered(x)   float32 -> int64 keeping the order (-0.0 as 0.0; NaN was made -inf before);
//   index key    MASK - block: a larger key for a lower block, unique per block;
//   free picks   the query_blocks largest (cand ? ordered(q) : ordered(-inf)) << 29 | index key,
//                of which the candidates (existing, not forced, finite score) join the query set;
//   major        tier (2: query set, 1: other existing, 0: future) << 32 | ordered(evict) + 2**31;
//   minor        live head: ordered(block mean) << 29 | index key;
//                A = 0 head: mean class (-inf 0, finite 1, inf 2) << 61
//                            | (ordered(q) + 2**31) << 29 | index key;
//   the budget   every block whose major key beats the k-th largest, then the blocks at that key
//                with the largest minor keys; written as ascending existing blocks, -1 after them.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

namespace {

constexpr int kIndexBits = 29;
constexpr int64_t kIndexMask = (int64_t(1) << kIndexBits) - 1;

inline float no_nan(float x) { return std::isnan(x) ? -std::numeric_limits<float>::infinity() : x; }

inline int64_t ordered(float x) {
    float y = x + 0.0f;  // -0.0 -> 0.0
    int32_t bits;
    std::memcpy(&bits, &y, sizeof bits);
    return bits < 0 ? int64_t(bits ^ 0x7FFFFFFF) : int64_t(bits);
}

inline int64_t shl(int64_t v, int s) { return int64_t(uint64_t(v) << s); }  // no UB for negative v

inline int64_t floor_div(int64_t a, int64_t b) {
    int64_t q = a / b;
    return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}

inline bool keyed(float x) { return std::isfinite(x) && x != 0.0f; }

}  // namespace

// query_scores [R, Hkv, NB] float32; evict [E, Hkv, NB, 2] float32 with E = 1 (shared by every row)
// or R; positions [R] int64; out [R, Hkv, topk_blocks] int64. Returns 0, or -1 on a bad argument.
extern "C" int64_t nosa_select_blocks(int64_t rows, int64_t hkv, int64_t nb, const float* query_scores,
                                      const float* evict, int64_t evict_rows, const int64_t* positions,
                                      int64_t block_size, int64_t sink_blocks, int64_t window_blocks,
                                      int64_t query_blocks, int64_t topk_blocks, int64_t* out) {
    if (rows < 0 || hkv < 1 || nb < 0 || block_size < 1 || topk_blocks < 0 || query_blocks < 0 ||
        (evict_rows != 1 && evict_rows != rows))
        return -1;
    const int64_t ord_neg_inf = ordered(-std::numeric_limits<float>::infinity());
    const int64_t k = std::min(topk_blocks, nb);
    const int64_t picks = std::min(query_blocks, nb);
    std::vector<int64_t> major(nb), minor(nb), keys(nb);
    std::vector<float> q(nb);
    std::vector<char> exists(nb), in_query(nb), cand(nb), chosen(nb);
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t cur = floor_div(positions[r], block_size);
        for (int64_t h = 0; h < hkv; ++h) {
            const float* qs = query_scores + (r * hkv + h) * nb;
            const float* ev = evict + ((evict_rows == 1 ? 0 : r) * hkv + h) * nb * 2;
            int64_t* dst = out + (r * hkv + h) * topk_blocks;
            bool live = false;
            for (int64_t b = 0; b < nb; ++b) {
                q[b] = no_nan(qs[b]);
                exists[b] = b <= cur;
                in_query[b] = exists[b] && (b < sink_blocks || b > cur - window_blocks);  // forced
                live = live || (exists[b] && (keyed(no_nan(ev[2 * b])) || keyed(no_nan(ev[2 * b + 1]))));
            }
            // free picks: the largest pick keys; the candidates among them join the query set
            if (picks > 0) {
                for (int64_t b = 0; b < nb; ++b) {
                    cand[b] = exists[b] && !in_query[b] && std::isfinite(q[b]);
                    keys[b] = shl(cand[b] ? ordered(q[b]) : ord_neg_inf, kIndexBits) | (kIndexMask - b);
                }
                std::nth_element(keys.begin(), keys.begin() + (picks - 1), keys.end(), std::greater<int64_t>());
                for (int64_t i = 0; i < picks; ++i) {
                    const int64_t b = kIndexMask - (keys[i] & kIndexMask);
                    if (cand[b]) in_query[b] = 1;
                }
            }
            for (int64_t b = 0; b < nb; ++b) {
                const float e0 = no_nan(ev[2 * b]), mean = no_nan(ev[2 * b + 1]);
                const int64_t index_key = kIndexMask - b;
                if (live) {
                    minor[b] = shl(ordered(mean), kIndexBits) | index_key;
                } else {
                    const int64_t mean_class = int64_t(mean > -std::numeric_limits<float>::infinity()) +
                                               int64_t(mean == std::numeric_limits<float>::infinity());
                    minor[b] = shl(mean_class, 61) | shl(ordered(q[b]) + (int64_t(1) << 31), kIndexBits) | index_key;
                }
                const int64_t tier = int64_t(exists[b]) + int64_t(in_query[b]);
                major[b] = shl(tier, 32) | (ordered(e0) + (int64_t(1) << 31));
                chosen[b] = 0;
            }
            int64_t written = 0;
            if (k > 0) {
                // the k-th largest major key; every block above it is in, then the best ties by minor
                keys.assign(major.begin(), major.end());
                std::nth_element(keys.begin(), keys.begin() + (k - 1), keys.end(), std::greater<int64_t>());
                const int64_t threshold = keys[k - 1];
                int64_t need = k, ties = 0;
                for (int64_t b = 0; b < nb; ++b) {
                    if (major[b] > threshold) {
                        chosen[b] = 1;
                        --need;
                    } else if (major[b] == threshold) {
                        keys[ties++] = minor[b];
                    }
                }
                if (need > 0) {
                    std::nth_element(keys.begin(), keys.begin() + (need - 1), keys.begin() + ties,
                                     std::greater<int64_t>());
                    for (int64_t i = 0; i < need; ++i) chosen[kIndexMask - (keys[i] & kIndexMask)] = 1;
                }
                for (int64_t b = 0; b < nb; ++b)
                    if (chosen[b] && exists[b]) dst[written++] = b;
            }
            for (int64_t i = written; i < topk_blocks; ++i) dst[i] = -1;
        }
    }
    return 0;
}
