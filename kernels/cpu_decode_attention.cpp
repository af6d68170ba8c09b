// Decode attention on the CPU, reading K and V in place in the paged cache; built, loaded and
// documented by kernels/cpu_decode_attention.py. Two passes per sequence, in parallel over them: scores = scale * q . k for every key the sequence sees, then out = sum of p * v over
// the same keys, p = softmax(scores) being computed in between by torch. Products and sums are fp32
// whatever the cache's dtype.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_vec.h"

namespace {

struct Shape {
    int64_t decodes, kv_heads, group, head_dim, block_size, table_width, width, window, q_stride;
    float scale;
};

// n elements of x as floats in `buffer`, read in order.
template <typename T>
const float* widened(const T* x, int64_t n, std::vector<float>& buffer) {
    buffer.resize(n);
    int64_t d = 0;
    for (; d + kVec <= n; d += kVec) store(buffer.data() + d, load(x + d));
    for (; d < n; ++d) buffer[d] = widen(x[d]);
    return buffer.data();
}

// One sequence's keys or values: positions [first, context) of its blocks.
template <typename T>
struct Sequence {
    const Shape& s;
    const T* cache;  // [blocks, block_size, kv_heads, head_dim]
    const int64_t* table;  // [table_width] its blocks
    int64_t first, context, row;  // row: kv_heads * head_dim, a position's values
    std::vector<float> buffer;  // a block, as floats
    const char* next = nullptr;  // the block read after this one, its lines [asked, lines) not yet asked for
    int64_t asked = 0, lines = 0;
    int64_t block_lines, share;  // a block's cache lines; what fp32 asks for before the copy and per head

    Sequence(const Shape& shape, const T* cache_, const int64_t* tables, const int64_t* contexts, int64_t i)
        : s(shape), cache(cache_), table(tables + i * shape.table_width), context(contexts[i]),
          row(shape.kv_heads * shape.head_dim) {
        first = s.window > 0 && context > s.window ? context - s.window : 0;
        block_lines = s.block_size * row * static_cast<int64_t>(sizeof(T)) / 64;
        share = block_lines / (s.kv_heads * s.group + 1) + 1;
    }

    // Asks for up to n more lines of the next block. A sequence's blocks lie anywhere in the
    // cache, so the prefetchers cannot see where the next one starts; asking for it a few lines
    // at a time while this block is read keeps reads in flight all through (asking for all of it
    // before the copy took 1.25x as long).
    void ask(int64_t n) {
        for (; n > 0 && asked < lines; --n, ++asked) __builtin_prefetch(next + 64 * asked);
    }

    // The sequence's b-th block [block_size, kv_heads, head_dim] as floats, copied even where it
    // is fp32: the copy reads the block's bytes in order, as the prefetchers expect, and the
    // readers then take a head at a time from L1 (read in place a head at a time, 30% slower).
    // A 2-byte block, which comes in faster than its heads are multiplied, asks for the next
    // block's lines as it copies its own; an fp32 block, which comes in slower, leaves them to its
    // heads (at 32 x 512 tokens, each way round took 1.2x as long).
    const float* block(int64_t b) {
        constexpr int64_t line = 64 / sizeof(T);  // elements in a cache line, a multiple of kVec
        const T* x = raw(b);
        const int64_t n = s.block_size * row;
        buffer.resize(n);
        int64_t d = 0;
        for (; d + kVec <= n; d += kVec) {
            if (sizeof(T) < 4 && d % line == 0) ask(1);
            store(buffer.data() + d, load(x + d));
        }
        for (; d < n; ++d) buffer[d] = widen(x[d]);
        return buffer.data();
    }

    const T* raw(int64_t b) const { return cache + table[b] * s.block_size * row; }  // in the cache

    // Calls visit(lo, hi, rows) for each block holding positions seen: they are [lo, hi), position
    // p's values at rows + (p - lo) * row. visit asks for a share of the next block's lines per
    // head; what it leaves is asked for after it.
    template <typename Visit>
    void blocks(Visit visit) {
        for (int64_t b = first / s.block_size; b * s.block_size < context; ++b) {
            const int64_t start = b * s.block_size, lo = std::max(first, start);
            const bool last = (b + 1) * s.block_size >= context;
            next = last ? nullptr : reinterpret_cast<const char*>(raw(b + 1));
            asked = 0;
            lines = last ? 0 : block_lines;
            if (sizeof(T) == 4) ask(share);
            visit(lo, std::min(context, start + s.block_size), block(b) + (lo - start) * row);
            ask(lines);
        }
    }
};

// n rows' dot products with q over hd floats, rows `row` floats apart, n <= kVec: lane i is
// q . rows[i]. Each row's products are summed in vectors and then all rows' vectors at once
// (lane_sums), not one row at a time. Out of line: inlined into scores_of, GCC 12's code took
// 1.15x as long for bf16 caches.
__attribute__((noinline)) Vec row_dots(const float* q, const float* rows, int64_t row, int64_t n, int64_t hd) {
    Vec acc[kVec] = {};
    int64_t d = 0;
    for (; d + kVec <= hd; d += kVec) {
        const Vec qd = load(q + d);
        for (int64_t i = 0; i < n; ++i) acc[i] += qd * load(rows + i * row + d);
    }
    Vec sums = lane_sums(acc);
    for (; d < hd; ++d) {
        for (int64_t i = 0; i < n; ++i) sums[i] += q[d] * rows[i * row + d];
    }
    return sums;
}

// scores [heads, width] of the sequence's queries q [heads, head_dim]; -inf at keys not seen.
template <typename T>
void scores_of(Sequence<T> seq, const float* q, float* scores) {
    const Shape& s = seq.s;
    const int64_t heads = s.kv_heads * s.group, hd = s.head_dim;
    for (int64_t h = 0; h < heads; ++h) {
        std::fill(scores + h * s.width, scores + h * s.width + seq.first, -INFINITY);
        std::fill(scores + h * s.width + seq.context, scores + (h + 1) * s.width, -INFINITY);
    }
    seq.blocks([&](int64_t lo, int64_t hi, const float* keys) {
        for (int64_t h = 0; h < heads; ++h) {
            seq.ask(seq.share);
            const float* k = keys + h / s.group * hd;  // position p's at k + (p - lo) * row
            for (int64_t p = lo; p < hi; p += kVec) {
                const int64_t n = std::min<int64_t>(kVec, hi - p);
                const Vec dots = row_dots(q + h * hd, k + (p - lo) * seq.row, seq.row, n, hd) * s.scale;
                std::memcpy(scores + h * s.width + p, &dots, n * sizeof(float));
            }
        }
    });
}

// out [heads, head_dim] = probs [heads, width] times the values seen: for each block, a head's
// sums stay in registers over its positions (each output is still a sum over positions in order).
template <typename T>
void values_of(Sequence<T> seq, const float* probs, float* out) {
    const Shape& s = seq.s;
    const int64_t heads = s.kv_heads * s.group, hd = s.head_dim;
    std::fill(out, out + heads * hd, 0.0f);
    seq.blocks([&](int64_t lo, int64_t hi, const float* values) {
        for (int64_t h = 0; h < heads; ++h) {
            seq.ask(seq.share);
            const float* w = probs + h * s.width;
            const float* v = values + h / s.group * hd;  // position p's at v + (p - lo) * row
            float* o = out + h * hd;
            int64_t d = 0;
            for (; d + kVec <= hd; d += kVec) {
                Vec sum = load(o + d);
                for (int64_t p = lo; p < hi; ++p) sum += w[p] * load(v + (p - lo) * seq.row + d);
                std::memcpy(o + d, &sum, sizeof sum);
            }
            for (; d < hd; ++d) {
                for (int64_t p = lo; p < hi; ++p) o[d] += w[p] * v[(p - lo) * seq.row + d];
            }
        }
    });
}

// Calls work(i) for every sequence i, a sequence per OpenMP task. q, out: [decodes, heads,
// head_dim]; scores, probs: [decodes, heads, width]; heads = kv_heads * group, the query heads of
// kv head h being [h * group, (h + 1) * group).
template <typename Work>
void each_sequence(const Shape* s, Work work) {
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t i = 0; i < s->decodes; ++i) work(i);
}

// q: [decodes, heads, head_dim] at a stride of s->q_stride between decodes, in the cache's dtype.
template <typename T>
void scores(const Shape* s, const T* q, const T* k, const int64_t* tables, const int64_t* contexts, float* out) {
    const int64_t heads = s->kv_heads * s->group;
    each_sequence(s, [&](int64_t i) {
        std::vector<float> buffer;
        const float* qi = widened(q + i * s->q_stride, heads * s->head_dim, buffer);
        scores_of(Sequence<T>(*s, k, tables, contexts, i), qi, out + i * heads * s->width);
    });
}

// out: [decodes, heads, head_dim] in the cache's dtype, each sum rounded to it once.
template <typename T>
void values(const Shape* s, const float* probs, const T* v, const int64_t* tables, const int64_t* contexts, T* out) {
    const int64_t heads = s->kv_heads * s->group, n = heads * s->head_dim;
    each_sequence(s, [&](int64_t i) {
        std::vector<float> sums(n);
        values_of(Sequence<T>(*s, v, tables, contexts, i), probs + i * heads * s->width, sums.data());
        T* o = out + i * n;
        int64_t d = 0;
        for (; d + kVec <= n; d += kVec) store(o + d, load(sums.data() + d));
        for (; d < n; ++d) o[d] = narrow<T>(sums[d]);
    });
}

}  // namespace

#define EXPORT(NAME, T)                                                                                     \
    extern "C" void decode_scores_##NAME(const Shape* s, const T* q, const T* k, const int64_t* tables,     \
                                         const int64_t* contexts, float* out) {                            \
        scores<T>(s, q, k, tables, contexts, out);                                                          \
    }                                                                                                       \
    extern "C" void decode_values_##NAME(const Shape* s, const float* probs, const T* v,                   \
                                         const int64_t* tables, const int64_t* contexts, T* out) {         \
        values<T>(s, probs, v, tables, contexts, out);                                                      \
    }

EXPORT(float32, float)
EXPORT(bfloat16, uint16_t)
EXPORT(float16, _Float16)
