// Prefill attention on the CPU, reading K and V in place in the paged cache; built, loaded and
// documented by kernels/cpu_prefill_attention.py. Flash attention: a task takes up to kRows query
// rows of one chunk and the query heads of one KV head, and walks the keys they see kKeys at a
// time (from the first row's window start to the last row's position) with an fp32 online softmax;
// scores are in log2 units (q pre-scaled by scale * log2(e)) and exponentials are 2^x.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_vec.h"

namespace {

constexpr int64_t kRows = 16;  // query rows per task
constexpr int64_t kKeys = 64;  // keys per step of the online softmax: four vectors
constexpr int kTile = 4;  // (row, head) pairs per register tile

struct Prefill {
    int64_t chunks, kv_heads, group, head_dim, block_size, table_width, q_stride, out_stride, window;
    float scale;
    const int32_t *tables, *starts, *lens, *contexts;
};

// One chunk's keys and values of one KV head, fp32, gathered once for all of its tasks: K
// transposed [width, stride] (a dim's keys contiguous), V [stride, width]; stride: the context
// padded to whole steps of kKeys keys (zeros past it), width: head_dim padded to whole vectors.
struct Keys {
    int64_t stride, width;
    std::vector<float> kt, v;
};

template <typename T>
Keys gather(const Prefill& p, const T* cache_k, const T* cache_v, int64_t chunk, int64_t kv_head, int64_t width) {
    const int64_t context = p.contexts[chunk];
    Keys keys{(context + kKeys - 1) / kKeys * kKeys, width, {}, {}};
    keys.kt.assign(width * keys.stride, 0.0f);
    keys.v.assign(keys.stride * width, 0.0f);
    const int32_t* table = p.tables + chunk * p.table_width;
    for (int64_t pos = 0; pos < context; ++pos) {
        const int64_t row = static_cast<int64_t>(table[pos / p.block_size]) * p.block_size + pos % p.block_size;
        const int64_t at = (row * p.kv_heads + kv_head) * p.head_dim;
        for (int64_t d = 0; d < p.head_dim; ++d) {
            keys.kt[d * keys.stride + pos] = widen(cache_k[at + d]);
            keys.v[pos * width + d] = widen(cache_v[at + d]);
        }
    }
    return keys;
}

// A task: up to kRows query rows of a chunk with the query heads of one KV head, as (row, head)
// pairs, pair m being row m / group and head kv_head * group + m % group; their scaled queries,
// running maxima, sums and outputs.
struct Task {
    int64_t chunk, kv_head, first_row, rows, pairs;
    const Keys* keys;
    std::vector<float> q, out, max, sum;  // q, out [pairs, width]; max, sum [pairs]
};

// s[r][k]: pair m0 + r's score (log2 units) of key k0 + k, -inf where its query does not see it;
// pairs past the last repeat it, their scores unused.
void scores(const Prefill& p, const Task& t, int64_t m0, int64_t k0, int64_t end, float s[kTile][kKeys]) {
    const Keys& keys = *t.keys;
    int64_t m[kTile];
    const float* q[kTile];
    for (int r = 0; r < kTile; ++r) m[r] = std::min(m0 + r, t.pairs - 1), q[r] = t.q.data() + m[r] * keys.width;
    Vec acc[kTile][kKeys / kVec] = {};
    for (int64_t d = 0; d < p.head_dim; ++d) {
        Vec k[kKeys / kVec];
        for (int j = 0; j < kKeys / kVec; ++j) k[j] = load(keys.kt.data() + d * keys.stride + k0 + j * kVec);
        for (int r = 0; r < kTile; ++r) {
            for (int j = 0; j < kKeys / kVec; ++j) acc[r][j] += q[r][d] * k[j];
        }
    }
    const int64_t cached = p.contexts[t.chunk] - p.lens[t.chunk];
    const Ints lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    for (int r = 0; r < kTile; ++r) {
        const int64_t pos = cached + t.first_row + m[r] / p.group;
        const int64_t low = p.window > 0 ? pos - p.window + 1 : 0, high = std::min(pos + 1, end);
        const bool seen = k0 >= low && k0 + kKeys <= high;  // every key of the step: nothing masked
        for (int j = 0; j < kKeys / kVec; ++j) {
            const Ints key = lane + static_cast<int32_t>(k0 + j * kVec);
            const Ints outside = (key < static_cast<int32_t>(low)) | (key >= static_cast<int32_t>(high));
            const Vec masked = outside ? Vec{} - INFINITY : acc[r][j];
            std::memcpy(s[r] + j * kVec, seen ? &acc[r][j] : &masked, sizeof(Vec));
        }
    }
}

// out[m0 + r][d, d + V * kVec) = out * scale[r] + s[r] . values, for the n pairs from m0: V
// vectors of each pair's output at once, so that 4 V sums are in flight at every key.
template <int V>
void add_values(Task& t, int64_t m0, int64_t n, int64_t d, int64_t k0, const float s[kTile][kKeys],
                const float scale[kTile]) {
    const Keys& keys = *t.keys;
    Vec acc[kTile][V];
    for (int r = 0; r < kTile; ++r) {
        const float* out = t.out.data() + (m0 + r) * keys.width + d;
        for (int j = 0; j < V; ++j) acc[r][j] = r < n ? load(out + j * kVec) * scale[r] : Vec{};
    }
    for (int64_t k = 0; k < kKeys; ++k) {
        const float* row = keys.v.data() + (k0 + k) * keys.width + d;
        Vec v[V];
        for (int j = 0; j < V; ++j) v[j] = load(row + j * kVec);
        for (int r = 0; r < kTile; ++r) {
            for (int j = 0; j < V; ++j) acc[r][j] += s[r][k] * v[j];
        }
    }
    for (int64_t r = 0; r < n; ++r) {
        float* out = t.out.data() + (m0 + r) * keys.width + d;
        for (int j = 0; j < V; ++j) std::memcpy(out + j * kVec, &acc[r][j], sizeof(Vec));
    }
}

// The online softmax step of pairs m0.. (up to kTile) over these keys: each pair's sums rescaled
// to its new maximum, then 2^(s - max) times the values added (a value row read once for them all).
void accumulate(Task& t, int64_t m0, int64_t k0, float s[kTile][kKeys]) {
    const Keys& keys = *t.keys;
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
        t.sum[m] = t.sum[m] * scale[r] + lane_sum(total);
    }
    int64_t d = 0;
    for (; d + 4 * kVec <= keys.width; d += 4 * kVec) add_values<4>(t, m0, n, d, k0, s, scale);
    for (; d < keys.width; d += kVec) add_values<1>(t, m0, n, d, k0, s, scale);
}

template <typename T>
void run_task(const Prefill& p, const T* q, T* out, Task& t) {
    const int64_t width = t.keys->width, cached = p.contexts[t.chunk] - p.lens[t.chunk];
    const int64_t first_pos = cached + t.first_row, end = cached + t.first_row + t.rows;
    const int64_t first_key = p.window > 0 ? std::max<int64_t>(0, first_pos - p.window + 1) / kKeys * kKeys : 0;
    const float factor = p.scale * kLog2e;
    const int64_t start = p.starts[t.chunk] + t.first_row;
    for (int64_t m = 0; m < t.pairs; ++m) {
        const T* src = q + (start + m / p.group) * p.q_stride + (t.kv_head * p.group + m % p.group) * p.head_dim;
        for (int64_t d = 0; d < p.head_dim; ++d) t.q[m * width + d] = widen(src[d]) * factor;
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
        for (int64_t d = 0; d < p.head_dim; ++d) dst[d] = narrow<T>(t.out[m * width + d] / t.sum[m]);
    }
}

template <typename T>
void prefill(const Prefill* p, const T* q, const T* cache_k, const T* cache_v, T* out) {
    const int64_t width = (p->head_dim + kVec - 1) / kVec * kVec, heads = p->chunks * p->kv_heads;
    std::vector<Keys> keys(heads);
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t c = 0; c < heads; ++c) keys[c] = gather(*p, cache_k, cache_v, c / p->kv_heads, c % p->kv_heads, width);
    std::vector<int64_t> work;  // (chunk, kv head, first row), flattened
    for (int64_t i = 0; i < p->chunks; ++i) {
        for (int64_t h = 0; h < p->kv_heads; ++h) {
            for (int64_t r = 0; r < p->lens[i]; r += kRows) work.insert(work.end(), {i, h, r});
        }
    }
    const int64_t tasks = static_cast<int64_t>(work.size()) / 3;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t w = 0; w < tasks; ++w) {
        Task t;
        t.chunk = work[3 * w], t.kv_head = work[3 * w + 1], t.first_row = work[3 * w + 2];
        t.rows = std::min(kRows, p->lens[t.chunk] - t.first_row);
        t.pairs = t.rows * p->group, t.keys = &keys[t.chunk * p->kv_heads + t.kv_head];
        t.q.assign(t.pairs * width, 0.0f), t.out.assign(t.pairs * width, 0.0f);
        t.max.assign(t.pairs, -INFINITY), t.sum.assign(t.pairs, 0.0f);
        run_task(*p, q, out, t);
    }
}

}  // namespace

#define EXPORT(NAME, T)                                                                                  \
    extern "C" void prefill_attention_##NAME(const Prefill* p, const T* q, const T* k, const T* v, T* out) { \
        prefill<T>(p, q, k, v, out);                                                                     \
    }

EXPORT(float32, float)
EXPORT(bfloat16, uint16_t)
EXPORT(float16, _Float16)
