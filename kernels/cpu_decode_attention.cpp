// Decode attention on the CPU, reading K and V in place in the paged cache; built, loaded and
// documented by kernels/cpu_decode_attention.py. A task is one sequence, in parallel over them: its
// scores q . k for every key it sees, then their softmax, then out = sum of p * v over the same
// keys, the scores and weights kept in the task's own buffer. Products and sums are fp32 whatever
// the cache's dtype (bf16 keys, on CPUs with AVX512-BF16, in exact pair products).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_vec.h"
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

namespace {

struct Shape {
    int64_t decodes, kv_heads, group, head_dim, block_size, table_width, window, q_stride;
    float scale;
};

// A sequence's scores, then its softmax weights: [heads, span] for its positions from `first`,
// span a whole number of vectors, -inf past its context (weights of 2^-126 there, below any sum's
// last bit, which the values pass never reads).
struct Weights {
    int64_t span, first;
    std::vector<float> data;
    Weights(int64_t heads, int64_t first_, int64_t context)
        : span((context - first_ + kVec - 1) / kVec * kVec), first(first_), data(heads * span, -INFINITY) {}
    float* at(int64_t h, int64_t p) { return data.data() + h * span + (p - first); }
    const float* at(int64_t h, int64_t p) const { return data.data() + h * span + (p - first); }
};

// One sequence's keys or values: positions [first, context) of its blocks, read in place.
template <typename T>
struct Sequence {
    // A sequence's blocks lie anywhere in the cache, so the prefetchers cannot see where the next
    // one starts: while a block is read, the one kAhead blocks on is asked for, a few lines at each
    // step of the products (scores_of, values_of), which keeps reads in flight all through. At 100
    // sequences of 530 positions (bf16 and fp32) a layer took 2.1x as long asking for nothing, and
    // 1 or 4 blocks on were within 3% of 2. Asked for a head's share at once (into L2), the reads
    // and the products took about the sum of their times apart; a few lines a step, into L1, decode
    // attention at 1 and 32 sequences of 512 positions took 0.83 and 0.85 of that time in fp32, 0.84
    // and 0.98 in bf16 (in an engine, the two builds alternating).
    static constexpr int64_t kAhead = 2;
    const Shape& s;
    const T* cache;  // [blocks, block_size, kv_heads, head_dim]
    const int64_t* table;  // [table_width] its blocks
    int64_t first, context, row;  // row: kv_heads * head_dim, a position's values
    const char* next = nullptr;  // the block asked for now, its lines [asked, lines) not yet asked for
    int64_t asked = 0, lines = 0;
    int64_t block_lines, share;  // a block's cache lines; what is asked for per head

    Sequence(const Shape& shape, const T* cache_, const int64_t* tables, const int64_t* contexts, int64_t i)
        : s(shape), cache(cache_), table(tables + i * shape.table_width), context(contexts[i]),
          row(shape.kv_heads * shape.head_dim) {
        first = s.window > 0 && context > s.window ? context - s.window : 0;
        block_lines = (s.block_size * row * static_cast<int64_t>(sizeof(T)) + 63) / 64;
        share = block_lines / (s.kv_heads * s.group) + 1;
    }

    // Asks for up to n more lines of the block kAhead on.
    void ask(int64_t n) {
        for (; n > 0 && asked < lines; --n, ++asked) __builtin_prefetch(next + 64 * asked, 0, 3);
    }

    const T* raw(int64_t b) const { return cache + table[b] * s.block_size * row; }  // in the cache
    bool seen(int64_t b) const { return b * s.block_size < context; }  // whether block b holds positions seen

    // Makes block b the one asked for (none past the context).
    void ask_for(int64_t b) {
        next = seen(b) ? reinterpret_cast<const char*>(raw(b)) : nullptr;
        asked = 0;
        lines = seen(b) ? block_lines : 0;
    }

    // Calls visit(lo, hi, rows) for each block holding positions seen: they are [lo, hi), position
    // p's values at rows + (p - lo) * row. visit asks for a share of a later block's lines per
    // head; what it leaves is asked for after it.
    template <typename Visit>
    void blocks(Visit visit) {
        const int64_t start = first / s.block_size;
        for (int64_t b = start + 1; b < start + kAhead; ++b) {  // the blocks before the first one asked for in turn
            ask_for(b);
            ask(lines);
        }
        for (int64_t b = start; seen(b); ++b) {
            const int64_t lo = std::max(first, b * s.block_size);
            ask_for(b + kAhead);
            visit(lo, std::min(context, (b + 1) * s.block_size), raw(b) + (lo - b * s.block_size) * row);
            ask(lines);
        }
    }
};

// acc plus one step's products of q and a key: kVec of them in fp32, or, for bf16 queries and
// keys on CPUs with AVX512-BF16, 2 kVec in pairs (vdpbf16ps, whose products are exact and sums
// fp32, as the prefill kernel's; a subnormal bf16 reads as zero), where widening both to fp32
// first took 1.9x as long.
template <typename T>
Vec dot_step(Vec acc, const float* q, const T* key) {
    return acc + load(q) * load(key);
}

#ifdef __AVX512BF16__
Vec dot_step(Vec acc, const uint16_t* q, const uint16_t* key) {
    return (Vec)_mm512_dpbf16_ps((__m512)acc, (__m512bh)load_as<__m512i>(q), (__m512bh)load_as<__m512i>(key));
}
#endif

// The elements of q a dot_step takes.
template <typename Q>
constexpr int64_t kDotStep = std::is_same_v<Q, float> ? kVec : 2 * kVec;

// Lane i: q . keys[i] over hd elements, for n <= kVec keys `row` elements apart (lanes past n
// repeat the last key); q is fp32, or bf16 where dot_step takes pairs. Each key's products are
// summed in a vector, all sixteen in registers, and the vectors' lanes then all at once (lane_sums).
// ask() before each step's products.
template <typename Q, typename T, typename Ask>
Vec key_dots(const Q* q, const T* keys, int64_t row, int64_t n, int64_t hd, Ask ask) {
    constexpr int64_t step = kDotStep<Q>;
    const T* key[kVec];
    for (int64_t i = 0; i < kVec; ++i) key[i] = keys + std::min(i, n - 1) * row;
    Vec acc[kVec] = {};
    int64_t d = 0;
    for (; d + step <= hd; d += step) {
        ask();
        for (int64_t i = 0; i < kVec; ++i) acc[i] = dot_step(acc[i], q + d, key[i] + d);
    }
    Vec sums = lane_sums(acc);
    for (; d < hd; ++d) {
        for (int64_t i = 0; i < n; ++i) sums[i] += widen(q[d]) * widen(key[i][d]);
    }
    return sums;
}

// The sequence's scores in log2 units (q . k times scale * log2(e)) for its queries q [heads,
// head_dim] (Q: fp32, or the keys' bf16 where key_dots takes them in pairs).
template <typename T, typename Q>
void scores_of(Sequence<T> seq, const Q* q, Weights& w) {
    const Shape& s = seq.s;
    const int64_t heads = s.kv_heads * s.group, hd = s.head_dim;
    const float factor = s.scale * kLog2e;
    const int64_t steps = std::max<int64_t>(1, hd / kDotStep<Q>), each = (seq.share + steps - 1) / steps;
    auto ask = [&] { seq.ask(each); };  // a head's share over its steps
    seq.blocks([&](int64_t lo, int64_t hi, const T* keys) {
        for (int64_t h = 0; h < heads; ++h) {
            const T* k = keys + h / s.group * hd;  // position p's at k + (p - lo) * row
            for (int64_t p = lo; p < hi; p += kVec) {
                const int64_t n = std::min<int64_t>(kVec, hi - p);
                const Vec dots = key_dots(q + h * hd, k + (p - lo) * seq.row, seq.row, n, hd, ask) * factor;
                std::memcpy(w.at(h, p), &dots, n * sizeof(float));
            }
        }
    });
}

// Each head's scores to softmax weights: 2^(t - max) over their sum.
void softmax(Weights& w, int64_t heads) {
    for (int64_t h = 0; h < heads; ++h) {
        float* t = w.at(h, w.first);
        Vec most = Vec{} - INFINITY;
        for (int64_t j = 0; j < w.span; j += kVec) {
            const Vec x = load(t + j);
            most = x > most ? x : most;
        }
        const float top = lane_max(most);
        Vec total = {};
        for (int64_t j = 0; j < w.span; j += kVec) {
            const Vec e = exp2_vec(load(t + j) - top);
            store(t + j, e);
            total += e;
        }
        const float inverse = 1.0f / lane_sum(total);
        for (int64_t j = 0; j < w.span; j += kVec) store(t + j, load(t + j) * inverse);
    }
}

// out[h][d, d + V * kVec) += sum over positions [lo, hi) of probs[h][p] * values[p][d ..], for the
// H query heads from h0 (of one kv head): H * V sums in registers, each over positions in order;
// ask() before each position's products.
template <int H, int V, typename T, typename Ask>
void add_values(const Shape& s, const Weights& probs, const T* values, int64_t row, int64_t lo, int64_t hi,
                int64_t h0, int64_t d, float* out, Ask ask) {
    Vec acc[H][V];
    for (int h = 0; h < H; ++h) {
        for (int v = 0; v < V; ++v) acc[h][v] = load(out + (h0 + h) * s.head_dim + d + v * kVec);
    }
    for (int64_t p = lo; p < hi; ++p) {
        ask();
        const T* at = values + (p - lo) * row + d;
        Vec x[V];
        for (int v = 0; v < V; ++v) x[v] = load(at + v * kVec);
        for (int h = 0; h < H; ++h) {
            const float w = *probs.at(h0 + h, p);
            for (int v = 0; v < V; ++v) acc[h][v] += w * x[v];
        }
    }
    for (int h = 0; h < H; ++h) {
        for (int v = 0; v < V; ++v) std::memcpy(out + (h0 + h) * s.head_dim + d + v * kVec, &acc[h][v], sizeof(Vec));
    }
}

// add_values for n (1 to kHeads) query heads from h0, over every whole vector of head_dim.
constexpr int64_t kHeads = 4;
template <int H, typename T, typename Ask>
void add_heads(const Shape& s, const Weights& probs, const T* values, int64_t row, int64_t lo, int64_t hi,
               int64_t h0, float* out, Ask ask) {
    int64_t d = 0;
    for (; d + 4 * kVec <= s.head_dim; d += 4 * kVec) {
        add_values<H, 4>(s, probs, values, row, lo, hi, h0, d, out, ask);
    }
    for (; d + kVec <= s.head_dim; d += kVec) add_values<H, 1>(s, probs, values, row, lo, hi, h0, d, out, ask);
}

// out [heads, head_dim] = the weights times the values seen: for each block and kv head,
// up to kHeads of its query heads at once, their sums in registers over the block's positions
// (each output is still a sum over positions in order).
template <typename T>
void values_of(Sequence<T> seq, const Weights& probs, float* out) {
    const Shape& s = seq.s;
    const int64_t heads = s.kv_heads * s.group, hd = s.head_dim, whole = hd / kVec * kVec;
    std::fill(out, out + heads * hd, 0.0f);
    seq.blocks([&](int64_t lo, int64_t hi, const T* values) {
        for (int64_t kv = 0; kv < s.kv_heads; ++kv) {
            const T* v = values + kv * hd;  // position p's at v + (p - lo) * row
            for (int64_t h0 = kv * s.group; h0 < (kv + 1) * s.group; h0 += kHeads) {
                const int64_t n = std::min(kHeads, (kv + 1) * s.group - h0);
                const int64_t each = (seq.share * n + (hi - lo) - 1) / (hi - lo);
                auto ask = [&] { seq.ask(each); };  // the heads' shares over the block's positions
                switch (n) {
                    case 1: add_heads<1>(s, probs, v, seq.row, lo, hi, h0, out, ask); break;
                    case 2: add_heads<2>(s, probs, v, seq.row, lo, hi, h0, out, ask); break;
                    case 3: add_heads<3>(s, probs, v, seq.row, lo, hi, h0, out, ask); break;
                    default: add_heads<4>(s, probs, v, seq.row, lo, hi, h0, out, ask); break;
                }
            }
            for (int64_t h = kv * s.group; h < (kv + 1) * s.group; ++h) {  // head_dim past whole vectors
                for (int64_t d = whole; d < hd; ++d) {
                    for (int64_t p = lo; p < hi; ++p) out[h * hd + d] += *probs.at(h, p) * widen(v[(p - lo) * seq.row + d]);
                }
            }
        }
    });
}

// q: [decodes, heads, head_dim] at a stride of s->q_stride between decodes, in the cache's dtype,
// the query heads of kv head h being [h * group, (h + 1) * group); out: [decodes, heads,
// head_dim] in that dtype, each sum rounded to it once.
template <typename T>
void attend(const Shape* s, const T* q, const T* k, const T* v, const int64_t* tables, const int64_t* contexts,
            T* out) {
    const int64_t heads = s->kv_heads * s->group, n = heads * s->head_dim;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t i = 0; i < s->decodes; ++i) {
        const Sequence<T> keys(*s, k, tables, contexts, i), values(*s, v, tables, contexts, i);
        Weights w(heads, keys.first, keys.context);
        const T* qi = q + i * s->q_stride;
        if constexpr (kPairs<T>) {
            scores_of(keys, qi, w);
        } else {
            std::vector<float> wide(n);  // the queries in fp32
            std::transform(qi, qi + n, wide.begin(), [](T x) { return widen(x); });
            scores_of(keys, wide.data(), w);
        }
        softmax(w, heads);
        std::vector<float> sums(n);
        values_of(values, w, sums.data());
        T* o = out + i * n;
        int64_t d = 0;
        for (; d + kVec <= n; d += kVec) store(o + d, load(sums.data() + d));
        for (; d < n; ++d) o[d] = narrow<T>(sums[d]);
    }
}

}  // namespace

#define EXPORT(NAME, T)                                                                                  \
    extern "C" void decode_attention_##NAME(const Shape* s, const T* q, const T* k, const T* v,          \
                                            const int64_t* tables, const int64_t* contexts, T* out) {    \
        attend<T>(s, q, k, v, tables, contexts, out);                                                    \
    }

EXPORT(float32, float)
EXPORT(bfloat16, uint16_t)
EXPORT(float16, _Float16)
