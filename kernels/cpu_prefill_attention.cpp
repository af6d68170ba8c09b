// Prefill attention on the CPU, reading K and V in place in the paged cache; built, loaded and
// documented by kernels/cpu_prefill_attention.py. Flash attention: a task takes up to kRows query
// rows of one chunk and the query heads of one KV head, and walks the keys they see kKeys at a
// time (from the first row's window start to the last row's position) with an fp32 online softmax;
// scores are in log2 units (q . k times scale * log2(e)) and exponentials are 2^x.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_vec.h"
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kRows = 16;  // query rows per task
constexpr int64_t kKeys = 64;  // keys per step of the online softmax: four vectors
constexpr int kTile = 6;  // (row, head) pairs per register tile: 24 accumulators of 32 registers

struct Prefill {
    int64_t chunks, kv_heads, group, head_dim, block_size, table_width, q_stride, out_stride, window;
    float scale;
    const int32_t *tables, *starts, *lens, *contexts;
};

// How a kernel multiplies: Widened keeps K, V and q in fp32 and multiplies by FMA; Bf16Pairs (bf16
// on CPUs with AVX512-BF16) keeps them in bf16 and multiplies pairs at once (vdpbf16ps), with the
// softmax's weights rounded to bf16 before they multiply V, as torch's CPU flash attention and the
// Triton kernel round them; products are exact and sums fp32 either way (vdpbf16ps reads a
// subnormal bf16 as zero).
template <typename T>
struct Widened {
    using Elem = float;
    static constexpr int64_t kPair = 1;  // the elements one product step takes from each side
    static float elem(T x) { return widen(x); }
    static void madd(Vec& acc, const float* a, const float* b) { acc += *a * load(b); }
};

#ifdef __AVX512BF16__
struct Bf16Pairs {
    using Elem = uint16_t;
    static constexpr int64_t kPair = 2;
    static uint16_t elem(uint16_t x) { return x; }
    static void madd(Vec& acc, const uint16_t* a, const uint16_t* b) {  // a: a pair, b: 16 pairs
        const __m512bh pair = (__m512bh)_mm512_set1_epi32(load_as<int32_t>(a));
        acc = (Vec)_mm512_dpbf16_ps((__m512)acc, pair, (__m512bh)load_as<__m512i>(b));
    }
};
#endif

// One chunk's keys and values of one KV head, in the kind's Elem, gathered once for all of its
// tasks, a step of kKeys keys contiguous (it stays in L1 while every tile reads it), products' pairs
// innermost: K [steps, width / kPair, kKeys, kPair] (a step's keys of a dim pair side by side), V
// [steps * kKeys / kPair, width, kPair] (a key pair's values of a dim side by side); zeros past
// the context and past head_dim, width: head_dim padded to whole vectors.
template <typename Kind>
struct Keys {
    using Elem = typename Kind::Elem;
    int64_t width;
    std::vector<Elem> k, v;
    const Elem* k_step(int64_t k0) const { return k.data() + k0 * width; }  // [width / kPair, kKeys, kPair]
    const Elem* v_step(int64_t k0) const { return v.data() + k0 * width; }  // [kKeys / kPair, width, kPair]
};

template <typename Kind, typename T>
Keys<Kind> gather(const Prefill& p, const T* cache_k, const T* cache_v, int64_t chunk, int64_t kv_head, int64_t width) {
    constexpr int64_t kPair = Kind::kPair;
    const int64_t context = p.contexts[chunk], stride = (context + kKeys - 1) / kKeys * kKeys;
    Keys<Kind> keys{width, {}, {}};
    keys.k.assign(stride * width, 0);
    keys.v.assign(stride * width, 0);
    const int32_t* table = p.tables + chunk * p.table_width;
    for (int64_t pos = 0; pos < context; ++pos) {
        const int64_t row = static_cast<int64_t>(table[pos / p.block_size]) * p.block_size + pos % p.block_size;
        const int64_t at = (row * p.kv_heads + kv_head) * p.head_dim, key = pos % kKeys;
        typename Kind::Elem* k = keys.k.data() + pos / kKeys * kKeys * width + key * kPair;
        typename Kind::Elem* v = keys.v.data() + (pos / kPair * width) * kPair + pos % kPair;
        for (int64_t d = 0; d < p.head_dim; ++d) {
            k[(d / kPair * kKeys) * kPair + d % kPair] = Kind::elem(cache_k[at + d]);
            v[d * kPair] = Kind::elem(cache_v[at + d]);
        }
    }
    return keys;
}

// A task: up to kRows query rows of a chunk with the query heads of one KV head, as (row, head)
// pairs, pair m being row m / group and head kv_head * group + m % group; their queries (in the
// kind's Elem), running maxima, sums and outputs.
template <typename Kind>
struct Task {
    int64_t chunk, kv_head, first_row, rows, pairs;
    const Keys<Kind>* keys;
    std::vector<typename Kind::Elem> q;  // [pairs, width]
    std::vector<float> out, max, sum;  // out [pairs, width]; max, sum [pairs]
};

// s[r][k]: pair m0 + r's score (log2 units: q . k times factor) of key k0 + k, -inf where its
// query does not see it; pairs past the last repeat it, their scores unused.
template <typename Kind>
void scores(const Prefill& p, const Task<Kind>& t, int64_t m0, int64_t k0, int64_t end, float s[kTile][kKeys]) {
    constexpr int64_t kPair = Kind::kPair;
    const auto* step = t.keys->k_step(k0);
    int64_t m[kTile];
    const typename Kind::Elem* q[kTile];
    for (int r = 0; r < kTile; ++r) m[r] = std::min(m0 + r, t.pairs - 1), q[r] = t.q.data() + m[r] * t.keys->width;
    Vec acc[kTile][kKeys / kVec] = {};
    for (int64_t d = 0; d < p.head_dim; d += kPair) {
        for (int j = 0; j < kKeys / kVec; ++j) {
            const auto* k = step + (d / kPair * kKeys + j * kVec) * kPair;
            for (int r = 0; r < kTile; ++r) Kind::madd(acc[r][j], q[r] + d, k);
        }
    }
    const float factor = p.scale * kLog2e;
    const int64_t cached = p.contexts[t.chunk] - p.lens[t.chunk];
    const Ints lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    for (int r = 0; r < kTile; ++r) {
        const int64_t pos = cached + t.first_row + m[r] / p.group;
        const int64_t low = p.window > 0 ? pos - p.window + 1 : 0, high = std::min(pos + 1, end);
        const bool seen = k0 >= low && k0 + kKeys <= high;  // every key of the step: nothing masked
        for (int j = 0; j < kKeys / kVec; ++j) {
            const Ints key = lane + static_cast<int32_t>(k0 + j * kVec);
            const Ints outside = (key < static_cast<int32_t>(low)) | (key >= static_cast<int32_t>(high));
            const Vec score = acc[r][j] * factor, masked = outside ? Vec{} - INFINITY : score;
            std::memcpy(s[r] + j * kVec, seen ? &score : &masked, sizeof(Vec));
        }
    }
}

// out[m0 + r][d, d + V * kVec) = out * scale[r] + w[r] . values, for the n pairs from m0: V
// vectors of each pair's output at once, so that 4 V sums are in flight at every key.
template <int V, typename Kind>
void add_values(Task<Kind>& t, int64_t m0, int64_t n, int64_t d, int64_t k0,
                const typename Kind::Elem w[kTile][kKeys], const float scale[kTile]) {
    constexpr int64_t kPair = Kind::kPair;
    const int64_t width = t.keys->width;
    const auto* step = t.keys->v_step(k0);
    Vec acc[kTile][V];
    for (int r = 0; r < kTile; ++r) {
        const float* out = t.out.data() + (m0 + r) * width + d;
        for (int j = 0; j < V; ++j) acc[r][j] = r < n ? load(out + j * kVec) * scale[r] : Vec{};
    }
    for (int64_t k = 0; k < kKeys; k += kPair) {
        for (int j = 0; j < V; ++j) {
            const auto* v = step + (k / kPair * width + d + j * kVec) * kPair;
            for (int r = 0; r < kTile; ++r) Kind::madd(acc[r][j], w[r] + k, v);
        }
    }
    for (int64_t r = 0; r < n; ++r) {
        float* out = t.out.data() + (m0 + r) * width + d;
        for (int j = 0; j < V; ++j) std::memcpy(out + j * kVec, &acc[r][j], sizeof(Vec));
    }
}

// add_values over every output vector of pairs m0.. .
template <typename Kind>
void add_all_values(Task<Kind>& t, int64_t m0, int64_t n, int64_t k0, const typename Kind::Elem w[kTile][kKeys],
                    const float scale[kTile]) {
    int64_t d = 0;
    for (; d + 4 * kVec <= t.keys->width; d += 4 * kVec) add_values<4>(t, m0, n, d, k0, w, scale);
    for (; d < t.keys->width; d += kVec) add_values<1>(t, m0, n, d, k0, w, scale);
}

// The online softmax step of pairs m0.. (up to kTile) over these keys: each pair's sums rescaled
// to its new maximum, then 2^(s - max) times the values added (a value row read once for them all).
template <typename Kind>
void accumulate(Task<Kind>& t, int64_t m0, int64_t k0, float s[kTile][kKeys]) {
    const int64_t n = std::min<int64_t>(kTile, t.pairs - m0);
    float scale[kTile] = {};
    for (int64_t r = 0; r < n; ++r) {
        const int64_t m = m0 + r;
        Vec x[kKeys / kVec], most = Vec{} + t.max[m];
        for (int j = 0; j < kKeys / kVec; ++j) {
            std::memcpy(&x[j], s[r] + j * kVec, sizeof(Vec));
            most = x[j] > most ? x[j] : most;
        }
        const float top = lane_max(most);
        if (top == -INFINITY) {  // nothing seen yet: its weights are all 0
            std::fill(s[r], s[r] + kKeys, 0.0f);
            scale[r] = 1.0f;
            continue;
        }
        scale[r] = t.max[m] == -INFINITY ? 0.0f : exp2_vec(Vec{} + (t.max[m] - top))[0];
        t.max[m] = top;
        Vec total = {};
        for (int j = 0; j < kKeys / kVec; ++j) {
            const Vec w = x[j] == -INFINITY ? Vec{} : exp2_vec(x[j] - top);
            std::memcpy(s[r] + j * kVec, &w, sizeof w);
            total += w;
        }
        t.sum[m] = t.sum[m] * scale[r] + lane_sum(total);  // of the weights before any rounding
    }
    using Elem = typename Kind::Elem;
    if constexpr (std::is_same_v<Elem, float>) {
        add_all_values(t, m0, n, k0, s, scale);
    } else {  // the weights rounded to the values' dtype
        Elem w[kTile][kKeys];
        for (int r = 0; r < kTile; ++r) {
            for (int j = 0; j < kKeys / kVec; ++j) store(w[r] + j * kVec, load(s[r] + j * kVec));
        }
        add_all_values(t, m0, n, k0, w, scale);
    }
}

template <typename Kind, typename T>
void run_task(const Prefill& p, const T* q, T* out, Task<Kind>& t) {
    const int64_t width = t.keys->width, cached = p.contexts[t.chunk] - p.lens[t.chunk];
    const int64_t first_pos = cached + t.first_row, end = cached + t.first_row + t.rows;
    const int64_t first_key = p.window > 0 ? std::max<int64_t>(0, first_pos - p.window + 1) / kKeys * kKeys : 0;
    const int64_t start = p.starts[t.chunk] + t.first_row;
    for (int64_t m = 0; m < t.pairs; ++m) {
        const T* src = q + (start + m / p.group) * p.q_stride + (t.kv_head * p.group + m % p.group) * p.head_dim;
        for (int64_t d = 0; d < p.head_dim; ++d) t.q[m * width + d] = Kind::elem(src[d]);
    }
    float s[kTile][kKeys];
    for (int64_t k0 = first_key; k0 < end; k0 += kKeys) {
        for (int64_t m0 = 0; m0 < t.pairs; m0 += kTile) {
            scores(p, t, m0, k0, end, s);
            accumulate(t, m0, k0, s);
        }
    }
    for (int64_t m = 0; m < t.pairs; ++m) {
        T* dst = out + (start + m / p.group) * p.out_stride + (t.kv_head * p.group + m % p.group) * p.head_dim;
        const float* sums = t.out.data() + m * width;
        const Vec total = Vec{} + t.sum[m];
        int64_t d = 0;
        for (; d + kVec <= p.head_dim; d += kVec) store(dst + d, load(sums + d) / total);
        for (; d < p.head_dim; ++d) dst[d] = narrow<T>(sums[d] / t.sum[m]);
    }
}

template <typename Kind, typename T>
void prefill(const Prefill* p, const T* q, const T* cache_k, const T* cache_v, T* out) {
    const int64_t width = (p->head_dim + kVec - 1) / kVec * kVec, heads = p->chunks * p->kv_heads;
    std::vector<Keys<Kind>> keys(heads);
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t c = 0; c < heads; ++c) {
        keys[c] = gather<Kind>(*p, cache_k, cache_v, c / p->kv_heads, c % p->kv_heads, width);
    }
    std::vector<int64_t> work;  // (chunk, kv head, first row), flattened
    for (int64_t i = 0; i < p->chunks; ++i) {
        for (int64_t h = 0; h < p->kv_heads; ++h) {
            for (int64_t r = 0; r < p->lens[i]; r += kRows) work.insert(work.end(), {i, h, r});
        }
    }
    const int64_t tasks = static_cast<int64_t>(work.size()) / 3;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t w = 0; w < tasks; ++w) {
        Task<Kind> t;
        t.chunk = work[3 * w], t.kv_head = work[3 * w + 1], t.first_row = work[3 * w + 2];
        t.rows = std::min(kRows, p->lens[t.chunk] - t.first_row);
        t.pairs = t.rows * p->group, t.keys = &keys[t.chunk * p->kv_heads + t.kv_head];
        t.q.assign(t.pairs * width, 0), t.out.assign(t.pairs * width, 0.0f);
        t.max.assign(t.pairs, -INFINITY), t.sum.assign(t.pairs, 0.0f);
        run_task(*p, q, out, t);
    }
}

#ifdef __AVX512BF16__
using Bf16Kind = Bf16Pairs;
#else
using Bf16Kind = Widened<uint16_t>;
#endif

}  // namespace

#define EXPORT(NAME, T, KIND)                                                                            \
    extern "C" void prefill_attention_##NAME(const Prefill* p, const T* q, const T* k, const T* v, T* out) { \
        prefill<KIND>(p, q, k, v, out);                                                                  \
    }

EXPORT(float32, float, Widened<float>)
EXPORT(bfloat16, uint16_t, Bf16Kind)
EXPORT(float16, _Float16, Widened<_Float16>)
