// Decode attention on the CPU, reading K and V in place in the paged cache; built, loaded and
// documented by kernels/cpu_decode_attention.py. Two passes per sequence, in parallel over them: scores = scale * q . k for every key the sequence sees, then out = sum of p * v over
// the same keys, p = softmax(scores) being computed in between by torch. Products and sums are fp32
// whatever the cache's dtype.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

namespace {

constexpr int64_t kMaxRow = 8192;  // kv_heads * head_dim at most: the launcher refuses more

struct Shape {
    int64_t decodes, kv_heads, group, head_dim, block_size, table_width, width, window;
    float scale;
};

inline float widen(float x) { return x; }
inline float widen(_Float16 x) { return static_cast<float>(x); }
inline float widen(uint16_t bf16) {  // bfloat16: the high half of a float
    return __builtin_bit_cast(float, static_cast<uint32_t>(bf16) << 16);
}

// Sixteen floats in one vector register (two on AVX2); GCC emits the ISA -march=native allows.
typedef float Vec __attribute__((vector_size(64)));
constexpr int64_t kVec = 16;

inline Vec load(const float* x) {
    Vec v;
    std::memcpy(&v, x, sizeof v);
    return v;
}

// a . b over n floats: four vectors of partial sums apart, so that no product waits for the one
// before it (one running sum of 64 products is a chain of 64 dependent additions).
inline float dot(const float* a, const float* b, int64_t n) {
    Vec sums[4] = {};
    int64_t d = 0;
    for (; d + 4 * kVec <= n; d += 4 * kVec) {
        for (int j = 0; j < 4; ++j) sums[j] += load(a + d + j * kVec) * load(b + d + j * kVec);
    }
    for (; d + kVec <= n; d += kVec) sums[0] += load(a + d) * load(b + d);
    const Vec all = (sums[0] + sums[1]) + (sums[2] + sums[3]);
    float sum = 0.0f;
    for (int64_t l = 0; l < kVec; ++l) sum += all[l];
    for (; d < n; ++d) sum += a[d] * b[d];
    return sum;
}

// y += w * x over n floats.
inline void axpy(float w, const float* x, float* y, int64_t n) {
    int64_t d = 0;
    for (; d + kVec <= n; d += kVec) {
        const Vec v = load(y + d) + w * load(x + d);
        std::memcpy(y + d, &v, sizeof v);
    }
    for (; d < n; ++d) y[d] += w * x[d];
}

// One sequence's keys or values: positions [first, context) of its blocks.
template <typename T>
struct Sequence {
    const Shape& s;
    const T* cache;  // [blocks, block_size, kv_heads, head_dim]
    const int64_t* table;  // [table_width] its blocks
    int64_t first, context;

    Sequence(const Shape& shape, const T* cache_, const int64_t* tables, const int64_t* contexts, int64_t i)
        : s(shape), cache(cache_), table(tables + i * shape.table_width), context(contexts[i]) {
        first = s.window > 0 && context > s.window ? context - s.window : 0;
    }

    // Position p's [kv_heads, head_dim], all heads at once, widened into `buffer` unless already
    // fp32: a sequence reads its blocks' bytes in order, as the prefetchers expect (a head at a
    // time, they fetched the other heads' lines too).
    const float* row(int64_t p, float* buffer) const {
        const int64_t block = table[p / s.block_size], offset = p % s.block_size;
        const int64_t n = s.kv_heads * s.head_dim;
        const T* x = cache + (block * s.block_size + offset) * n;
        if constexpr (std::is_same_v<T, float>) {
            return x;
        } else {
            for (int64_t d = 0; d < n; ++d) buffer[d] = widen(x[d]);
            return buffer;
        }
    }
};

// scores [heads, width] of the sequence's queries q [heads, head_dim]; -inf at keys not seen.
template <typename T>
void scores_of(const Sequence<T>& seq, const float* q, float* scores) {
    const Shape& s = seq.s;
    const int64_t heads = s.kv_heads * s.group;
    float buffer[kMaxRow];
    for (int64_t h = 0; h < heads; ++h) {
        std::fill(scores + h * s.width, scores + h * s.width + seq.first, -INFINITY);
        std::fill(scores + h * s.width + seq.context, scores + (h + 1) * s.width, -INFINITY);
    }
    for (int64_t p = seq.first; p < seq.context; ++p) {
        const float* key = seq.row(p, buffer);
        for (int64_t h = 0; h < heads; ++h) {
            scores[h * s.width + p] = dot(q + h * s.head_dim, key + h / s.group * s.head_dim, s.head_dim) * s.scale;
        }
    }
}

// out [heads, head_dim] = probs [heads, width] times the values seen, summed in fp32 in out.
template <typename T>
void values_of(const Sequence<T>& seq, const float* probs, float* out) {
    const Shape& s = seq.s;
    const int64_t heads = s.kv_heads * s.group;
    float buffer[kMaxRow];
    std::fill(out, out + heads * s.head_dim, 0.0f);
    for (int64_t p = seq.first; p < seq.context; ++p) {
        const float* value = seq.row(p, buffer);
        for (int64_t h = 0; h < heads; ++h) {
            axpy(probs[h * s.width + p], value + h / s.group * s.head_dim, out + h * s.head_dim, s.head_dim);
        }
    }
}

// q, out: [decodes, heads, head_dim]; scores, probs: [decodes, heads, width]; heads = kv_heads *
// group, the query heads of kv head h being [h * group, (h + 1) * group). A sequence per task.
template <typename T>
void scores(const Shape* s, const float* q, const T* k, const int64_t* tables, const int64_t* contexts, float* out) {
    const int64_t heads = s->kv_heads * s->group;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t i = 0; i < s->decodes; ++i) {
        scores_of(Sequence<T>(*s, k, tables, contexts, i), q + i * heads * s->head_dim, out + i * heads * s->width);
    }
}

template <typename T>
void values(const Shape* s, const float* probs, const T* v, const int64_t* tables, const int64_t* contexts, float* out) {
    const int64_t heads = s->kv_heads * s->group;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t i = 0; i < s->decodes; ++i) {
        values_of(Sequence<T>(*s, v, tables, contexts, i), probs + i * heads * s->width, out + i * heads * s->head_dim);
    }
}

}  // namespace

#define EXPORT(NAME, T)                                                                                     \
    extern "C" void decode_scores_##NAME(const Shape* s, const float* q, const T* k, const int64_t* tables, \
                                         const int64_t* contexts, float* out) {                            \
        scores<T>(s, q, k, tables, contexts, out);                                                          \
    }                                                                                                       \
    extern "C" void decode_values_##NAME(const Shape* s, const float* probs, const T* v,                   \
                                         const int64_t* tables, const int64_t* contexts, float* out) {     \
        values<T>(s, probs, v, tables, contexts, out);                                                      \
    }

EXPORT(float32, float)
EXPORT(bfloat16, uint16_t)
EXPORT(float16, _Float16)
