// LoRA shrink and expand on the CPU, reading the adapters' pages in place in adapter memory;
// built, loaded and documented by kernels/cpu_lora.py. The semantics are those of the Triton pair
// (kernels/lora_shrink.py, kernels/lora_expand.py) on one step's segment table: shrink writes each
// LoRA token's fp32 sums A x, expand adds B times them (rounded to the pool's dtype first, as PEFT's
// lora_A output is) into y. Products and sums are fp32 whatever the dtype; bf16 shrinks and expands,
// on CPUs with AVX512-BF16, multiply in pairs (vdpbf16ps: exact products, a subnormal read as zero).
// lora_linear runs a layer's base matmul (kernels/cpu_panels.h; fp32, bf16, int8 or NF4 weights) and
// its adapters in one call.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_panels.h"
#include "cpu_vec.h"
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPageRank = 8;  // kernels/lora_batch.py's PAGE_RANK
constexpr int64_t kMaxSlices = 3;  // q/k/v
constexpr int kTile = 4;  // tokens (and shrink's rank rows) per register tile
constexpr int64_t kTaskTokens = 32;  // a long segment (a prefill chunk) is cut into tasks of these

// One call's shapes, and the step's segment table (SegmentTable: int32, contiguous).
struct Lora {
    int64_t segments, max_pages, first_target, slices, in_features, unit, x_stride, y_stride, lanes, gathered;
    int64_t offsets[kMaxSlices], sizes[kMaxSlices];
    const int32_t *tokens, *starts, *lengths, *ranks, *pages;  // ranks [targets, segments]; pages [.., max_pages]
};

#ifdef __AVX512BF16__
// dot_tile's sums of bf16 elements [0, k) for the k it returns (whole vectors of pairs): products
// of pairs at once (vdpbf16ps), exact as widened ones are, with no widening.
inline int64_t dot_pairs(const uint16_t* const* xs, const uint16_t* const* as, int64_t n, bool ahead, Vec acc[kTile][kTile]) {
    int64_t k = 0;
    for (; k + 2 * kVec <= n; k += 2 * kVec) {
        __m512bh xv[kTile], av[kTile];
        if (ahead) {
            for (int r = 0; r < kTile; ++r) __builtin_prefetch(as[r] + k + kTile * n);
        }
        for (int t = 0; t < kTile; ++t) xv[t] = (__m512bh)load_as<__m512i>(xs[t] + k);
        for (int r = 0; r < kTile; ++r) av[r] = (__m512bh)load_as<__m512i>(as[r] + k);
        for (int t = 0; t < kTile; ++t) {
            for (int r = 0; r < kTile; ++r) acc[t][r] = (Vec)_mm512_dpbf16_ps((__m512)acc[t][r], xv[t], av[r]);
        }
    }
    return k;
}
#endif

// out[t][r] = xs[t] . as[r] over n elements, for a tile of kTile tokens and kTile rank rows: each
// row of A read once for the tile's tokens, sixteen independent sums in registers. `ahead`: ask
// for the next tile's rows as these are read (the first tile of a task's tokens; the later ones
// find them in cache, where asking again took 1.2x as long on a 512-token run's 1536-input rows).
template <typename T>
void dot_tile(const T* const* xs, const T* const* as, int64_t n, bool ahead, float out[kTile][kTile]) {
    Vec acc[kTile][kTile] = {};
    int64_t k = 0;
#ifdef __AVX512BF16__
    if constexpr (kPairs<T>) k = dot_pairs(xs, as, n, ahead, acc);
#endif
    for (; k + kVec <= n; k += kVec) {
        Vec xv[kTile], av[kTile];
        if (ahead && k % (64 / sizeof(T)) == 0) {  // a line of the next tile's rows (the next page's B^T after the last)
            for (int r = 0; r < kTile; ++r) __builtin_prefetch(as[r] + k + kTile * n);
        }
        for (int t = 0; t < kTile; ++t) xv[t] = load(xs[t] + k);
        for (int r = 0; r < kTile; ++r) av[r] = load(as[r] + k);
        for (int t = 0; t < kTile; ++t) {
            for (int r = 0; r < kTile; ++r) acc[t][r] += xv[t] * av[r];
        }
    }
    for (int t = 0; t < kTile; ++t) {
        for (int r = 0; r < kTile; ++r) {
            float sum = lane_sum(acc[t][r]);
            for (int64_t j = k; j < n; ++j) sum += widen(xs[t][j]) * widen(as[r][j]);
            out[t][r] = sum;
        }
    }
}

// A task: the tokens [first, last) of one segment (rows of its run in the table) on one slice.
struct Task {
    int64_t segment, first, last, slice;
};

std::vector<Task> tasks_of(const Lora& a) {
    std::vector<Task> tasks;
    for (int64_t seg = 0; seg < a.segments; ++seg) {
        for (int64_t first = 0; first < a.lengths[seg]; first += kTaskTokens) {
            for (int64_t s = 0; s < a.slices; ++s) {
                tasks.push_back({seg, first, std::min<int64_t>(a.lengths[seg], first + kTaskTokens), s});
            }
        }
    }
    return tasks;
}

template <typename Work>
void each_task(const Lora& a, Work work) {
    const std::vector<Task> tasks = tasks_of(a);
    const int64_t n = static_cast<int64_t>(tasks.size());
#pragma omp parallel for schedule(dynamic, 1) if (n > 1)
    for (int64_t i = 0; i < n; ++i) work(tasks[i]);
}

// What a task reads of its segment on its slice's target.
template <typename T>
struct Pages {
    const Lora& a;
    const T* pool;
    int64_t target, rank;
    const int32_t* units;  // [max_pages] the first unit of each page, rank order

    Pages(const Lora& lora, const T* pool_, const Task& task)
        : a(lora), pool(pool_), target(lora.first_target + task.slice),
          rank(lora.ranks[target * lora.segments + task.segment]),
          units(lora.pages + (target * lora.segments + task.segment) * lora.max_pages) {}

    const T* page(int64_t j) const { return pool + static_cast<int64_t>(units[j / kPageRank]) * a.unit; }
    const T* a_row(int64_t j) const { return page(j) + (j % kPageRank) * a.in_features; }
    // B^T row of rank row j read by the shrink of tensor-parallel rank `held` (0 unless gathered)
    const T* b_row(int64_t held, int64_t j, int64_t size) const {
        return page(j) + kPageRank * a.in_features + (held * kPageRank + j % kPageRank) * size;
    }
};

// The task's shrinks: out(i) [lanes] for its i-th token (i in [first, last)), lanes past the rank
// 0 as the Triton kernel's.
template <typename T, typename Out>
void shrink_task(const Lora& a, const Task& task, const T* x, const Pages<T>& p, Out out) {
    const int32_t* tokens = a.tokens + a.starts[task.segment];
    for (int64_t i0 = task.first; i0 < task.last; i0 += kTile) {
        const int64_t n_tok = std::min<int64_t>(kTile, task.last - i0);
        const T* xs[kTile];  // a tile past the task's tokens repeats its last one, its sums unused
        for (int t = 0; t < kTile; ++t) xs[t] = x + tokens[i0 + std::min<int64_t>(t, n_tok - 1)] * a.x_stride;
        for (int64_t t = 0; t < n_tok; ++t) std::fill(out(i0 + t) + p.rank, out(i0 + t) + a.lanes, 0.0f);
        for (int64_t j0 = 0; j0 < p.rank; j0 += kTile) {
            const int64_t n_rows = std::min<int64_t>(kTile, p.rank - j0);
            const T* as[kTile];
            for (int r = 0; r < kTile; ++r) as[r] = p.a_row(j0 + std::min<int64_t>(r, n_rows - 1));
            float sums[kTile][kTile];
            dot_tile(xs, as, a.in_features, i0 == task.first, sums);
            for (int64_t t = 0; t < n_tok; ++t) std::copy(sums[t], sums[t] + n_rows, out(i0 + t) + j0);
        }
    }
}

// out[0, n) = in[0, n) rounded to T.
template <typename T>
void rounded_row(const float* in, int64_t n, float* out) {
    int64_t j = 0;
    for (; j + kVec <= n; j += kVec) store(out + j, rounded<T>(load(in + j)));
    for (; j < n; ++j) out[j] = widen(narrow<T>(in[j]));
}

#ifdef __AVX512BF16__
// out[t] = 32 columns from c of kTile tokens' bf16 shrinks times B's bf16 rows, in pairs of rows
// (vdpbf16ps: exact products, fp32 sums, twice the products of an FMA of widened ones). pairs
// [kTile, half]: lanes 2j (low) and 2j + 1's bits in one int; a missing last row reads as zeros.
// Rows 2j and 2j + 1 interleaved (within each 128-bit lane) give the column pairs it takes, and
// the sums come out in the interleave's column order: put back once, after the last row. Against
// widened rows: gate/up's call on 128 tokens over 8 adapters took 0.73 of the time (hot pages), and
// decode at 128 requests kept 0.921 of the base model's speed where it kept 0.873 (one engine).
inline void pair_sums(const uint16_t* const* b_rows, int64_t lanes, const uint32_t* pairs, int64_t c,
                      Vec out[kTile][2]) {
    const int64_t half = (lanes + 1) / 2;
    __m512 acc[kTile][2];
    for (int t = 0; t < kTile; ++t) acc[t][0] = acc[t][1] = _mm512_setzero_ps();
    for (int64_t j = 0; j < half; ++j) {
        const uint16_t* even = b_rows[2 * j] + c;
        const uint16_t* odd = 2 * j + 1 < lanes ? b_rows[2 * j + 1] + c : nullptr;
        __builtin_prefetch(even + 4 * kVec);
        if (odd) __builtin_prefetch(odd + 4 * kVec);
        const __m512i e = load_as<__m512i>(even), o = odd ? load_as<__m512i>(odd) : _mm512_setzero_si512();
        const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(e, o), hi = (__m512bh)_mm512_unpackhi_epi16(e, o);
        for (int t = 0; t < kTile; ++t) {
            const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[t * half + j]));
            acc[t][0] = _mm512_dpbf16_ps(acc[t][0], lo, w);
            acc[t][1] = _mm512_dpbf16_ps(acc[t][1], hi, w);
        }
    }
    // lo's lane 4q + k holds column 8q + k, hi's column 8q + 4 + k (q: a 128-bit lane, k < 4)
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int t = 0; t < kTile; ++t) {
        out[t][0] = (Vec)_mm512_permutex2var_ps(acc[t][0], first, acc[t][1]);
        out[t][1] = (Vec)_mm512_permutex2var_ps(acc[t][0], second, acc[t][1]);
    }
}

// pairs [kTile, half] of pair_sums from buf [kTile, lanes] (floats rounded to bf16).
inline void pack_pairs(const float* buf, int64_t lanes, uint32_t* pairs) {
    const int64_t half = (lanes + 1) / 2;
    for (int t = 0; t < kTile; ++t) {
        for (int64_t j = 0; j < half; ++j) {
            uint32_t even, odd = 0;
            std::memcpy(&even, &buf[t * lanes + 2 * j], 4);
            if (2 * j + 1 < lanes) std::memcpy(&odd, &buf[t * lanes + 2 * j + 1], 4);
            pairs[t * half + j] = (even >> 16) | (odd & 0xffff0000u);
        }
    }
}

// ys[t] (its first n_tok) += the tile's products (pair_sums), 32 columns at a time of `size`;
// returns the first column left for the widening loop.
inline int64_t add_pair_sums(const uint16_t* const* b_rows, int64_t lanes, const float* buf, uint32_t* pairs,
                             int64_t size, int64_t n_tok, uint16_t* const* ys) {
    pack_pairs(buf, lanes, pairs);
    int64_t c = 0;
    for (; c + 2 * kVec <= size; c += 2 * kVec) {
        Vec sums[kTile][2];
        pair_sums(b_rows, lanes, pairs, c, sums);
        for (int t = 0; t < kTile; ++t) {  // bounded by kTile, as expand_task's stores are
            if (t < n_tok) {
                store(ys[t] + c, load(ys[t] + c) + rounded<uint16_t>(sums[t][0]));
                store(ys[t] + c + kVec, load(ys[t] + c + kVec) + rounded<uint16_t>(sums[t][1]));
            }
        }
    }
    return c;
}
#endif

// y's slice columns of the task's tokens += their shrinks in(i) [gathered * lanes] times B.
template <typename T, typename In>
void expand_task(const Lora& a, const Task& task, In in_of, const Pages<T>& p, T* y) {
    if (p.rank == 0) return;
    const int32_t* tokens = a.tokens + a.starts[task.segment];
    const int64_t size = a.sizes[task.slice], lanes = a.gathered * p.rank;
    std::vector<const T*> b_rows(lanes);
    for (int64_t held = 0; held < a.gathered; ++held) {
        for (int64_t j = 0; j < p.rank; ++j) b_rows[held * p.rank + j] = p.b_row(held, j, size);
    }
    std::vector<float> buf(kTile * lanes);  // the tile's shrinks, rounded to the pool's dtype
    std::vector<uint32_t> pairs(kPairs<T> ? kTile * ((lanes + 1) / 2) : 0);  // buf's bf16 pairs
    for (int64_t i0 = task.first; i0 < task.last; i0 += kTile) {
        const int64_t n_tok = std::min<int64_t>(kTile, task.last - i0);
        T* ys[kTile];
        for (int t = 0; t < kTile; ++t) {
            const int64_t i = i0 + std::min<int64_t>(t, n_tok - 1);
            ys[t] = y + tokens[i] * a.y_stride + a.offsets[task.slice];
            for (int64_t held = 0; held < a.gathered; ++held) {
                rounded_row<T>(in_of(i) + held * a.lanes, p.rank, &buf[t * lanes + held * p.rank]);
            }
        }
        int64_t c = 0;
#ifdef __AVX512BF16__
        if constexpr (kPairs<T>) {
            c = add_pair_sums(b_rows.data(), lanes, buf.data(), pairs.data(), size, n_tok, ys);
        }
#endif
        for (; c + kVec <= size; c += kVec) {
            Vec acc[kTile] = {};
            for (int64_t l = 0; l < lanes; ++l) {
                if (c % (64 / sizeof(T)) == 0) __builtin_prefetch(b_rows[l] + c + 4 * kVec);
                const Vec b = load(b_rows[l] + c);
                for (int t = 0; t < kTile; ++t) acc[t] += buf[t * lanes + l] * b;
            }
            // Bounded by kTile, not n_tok: acc stays in registers. Bounded by n_tok, GCC kept it on
            // the stack, each FMA above waiting on the store of the last (decode steps' LoRA: 1.1-1.3x).
            for (int t = 0; t < kTile; ++t) {
                if (t < n_tok) store(ys[t] + c, load(ys[t] + c) + rounded<T>(acc[t]));  // store rounds the sum
            }
        }
        for (; c < size; ++c) {
            for (int64_t t = 0; t < n_tok; ++t) {
                float sum = 0.0f;
                for (int64_t l = 0; l < lanes; ++l) sum += buf[t * lanes + l] * widen(b_rows[l][c]);
                ys[t][c] = narrow<T>(widen(ys[t][c]) + widen(narrow<T>(sum)));
            }
        }
    }
}

// partials [tokens, slices, gathered * lanes]: a task's row of its i-th token.
inline float* partials_row(const Lora& a, const Task& task, float* partials, int64_t i) {
    const int64_t token = a.tokens[a.starts[task.segment] + i];
    return partials + (token * a.slices + task.slice) * a.gathered * a.lanes;
}

template <typename T>
void shrink(const Lora& a, const T* x, const T* pool, float* partials) {
    each_task(a, [&](const Task& task) {
        shrink_task(a, task, x, Pages<T>(a, pool, task), [&](int64_t i) { return partials_row(a, task, partials, i); });
    });
}

template <typename T>
void expand(const Lora& a, float* partials, const T* pool, T* y) {
    each_task(a, [&](const Task& task) {
        expand_task(a, task, [&](int64_t i) { return partials_row(a, task, partials, i); }, Pages<T>(a, pool, task), y);
    });
}

// The bytes of a task's page: kPageRank rows of A, then their B^T rows (of every rank gathered).
template <typename T>
int64_t page_bytes(const Lora& a, const Task& task) {
    return kPageRank * (a.in_features + a.gathered * a.sizes[task.slice]) * sizeof(T);
}

// Asks for every line of a task's pages (into L2) before reading any: at decode they come from
// memory, a few tens of KB a task, and asked for at once more of them are on their way together
// than the rows' own prefetches bring (a decode step's LoRA calls, batches 1 and 8 in bf16: 0.89 to
// 0.95 of the time). A segment's later tasks (a prefill's) find them in cache.
template <typename T>
void ask_for_pages(const Lora& a, const Task& task, const Pages<T>& p) {
    if (task.first != 0) return;
    const int64_t bytes = page_bytes<T>(a, task);
    for (int64_t j = 0; j < p.rank; j += kPageRank) {
        const char* page = reinterpret_cast<const char*>(p.page(j));
        for (int64_t k = 0; k < bytes; k += 64) ask_for_line(page + k);
    }
}

// A task's pages asked for, then its shrinks, kept for its own expand (where no tensor-parallel
// exchange comes between).
template <typename T>
void shrink_expand_task(const Lora& a, const Task& task, const T* x, const T* pool, T* y) {
    const Pages<T> p(a, pool, task);
    ask_for_pages(a, task, p);
    std::vector<float> shrunk(kTaskTokens * a.lanes);
    auto row = [&](int64_t i) { return shrunk.data() + (i - task.first) * a.lanes; };
    shrink_task(a, task, x, p, row);
    expand_task(a, task, row, p, y);
}

template <typename T>
void shrink_expand(const Lora& a, const T* x, const T* pool, T* y) {
    each_task(a, [&](const Task& task) { shrink_expand_task(a, task, x, pool, y); });
}

// lora_linear at decode, where each segment's tokens are one task: the panels first, then each task
// (of any thread) asks for its pages, as shrink_expand's do, shrinks its tokens and adds their
// expands, once every panel is in y. With each thread's shrinks before its panels (as
// prefill_linear's), decode steps at 32 requests over 8 adapters kept 0.880 (bf16) and 0.882 (fp32)
// of the base model's speed, and kept 0.914 and 0.902 so. Each panel also asked for a share of the
// pages as its weights streamed, until that was measured apart (one engine each, alternating, on a
// Zen 5 EPYC): without it, steps with adapters took 0.93 to 0.96 of the time at 1 to 8 requests and
// 0.97 at 128 in fp32, 0.97 to 0.99 at 1 to 32 in bf16; 1.00 and 1.02 at 32 in fp32 and 128 in bf16,
// within what the base model's own steps moved between the engines.
// What bounds it there is reading the pages more than multiplying them. 8 adapters' fp32 pages are
// 5.2 MB a layer of the default model: read and nothing else, they took 90 to 120 us a layer (about
// 45 GB/s, what two threads read of scattered 67 KB pages on that machine), where the adapters took
// 143 to 174 us in all at 32 tokens and 218 to 321 at 128. On rows in cache the shrink's tiles
// multiply at 75 to 95% of the panels' rate, the expand's at 60%. Asking for the next task's pages
// between the current one's tiles, or running the shrinks between the panels, did not hide the
// reads (0.96 to 1.16 of the time); each panel asking for a share of them, into L2 or L3, took
// 1.01 to 1.04, though pages already in L3 would have saved 45 to 68 us a layer at 32 tokens. The
// expands cost most of the rest: with them left out (pages still read), layers took 80 us less at
// 32 tokens and 181 at 128. Run as each panel's epilogue instead (the same sums, B's rows asked for
// a panel ahead, y in L1), they took 1.04 to 1.13 of the time, and 1.00 even with B's rows in L1.
template <typename Kind, typename T = typename Kind::T, typename W = typename Kind::W>
void decode_linear(const Linear& s, const Lora& a, const std::vector<Task>& tasks, const T* x, const W* w,
                   const T* bias, const T* pool, T* y) {
    const int64_t n = static_cast<int64_t>(tasks.size());
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t p = 0; p < s.panels; ++p) panel<Kind>(s, x, w, bias, y, p);
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n; ++i) shrink_expand_task(a, tasks[i], x, pool, y);
    }
}

// lora_linear where a segment is cut into several tasks (a prefill chunk): each thread takes the
// shrinks first, while x is in cache, and goes on to its panels as soon as none is left; the
// expands follow the last panel. In decode_linear's order 512-token prefills in fp32 kept less of
// the base model's speed than in this one in each of 6 runs side by side (0.899 to 0.946 against
// 0.903 to 1.005).
template <typename Kind, typename T = typename Kind::T, typename W = typename Kind::W>
void prefill_linear(const Linear& s, const Lora& a, const std::vector<Task>& tasks, const T* x, const W* w,
                    const T* bias, const T* pool, T* y) {
    const int64_t n = static_cast<int64_t>(tasks.size());
    std::vector<float> shrunk(n * kTaskTokens * a.lanes);  // task i's tokens' rows from i * kTaskTokens
    auto rows_of = [&](int64_t i) {
        return [&, i](int64_t token) { return shrunk.data() + (i * kTaskTokens + token - tasks[i].first) * a.lanes; };
    };
#pragma omp parallel
    {
#pragma omp for schedule(dynamic, 1) nowait
        for (int64_t i = 0; i < n; ++i) {
            const Pages<T> p(a, pool, tasks[i]);
            ask_for_pages(a, tasks[i], p);
            shrink_task(a, tasks[i], x, p, rows_of(i));
        }
        panels_by_blocks<Kind>(s, x, w, bias, y);
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n; ++i) expand_task(a, tasks[i], rows_of(i), Pages<T>(a, pool, tasks[i]), y);
    }
}

// y = x W^T + b (the panels of cpu_panels.h), then y += the adapters' products, as linear's call
// and shrink_expand's would give, in one parallel region: decode_linear's order where every
// segment is one task, prefill_linear's otherwise. Apart, at decode batch 1, each call paid its
// fixed cost (Python, the threads' wake-up) and its pages' reads with nothing else under way:
// decode steps with an adapter kept 0.91 (fp32) and 0.88 (bf16) of the base model's speed, and
// 0.95 and 0.92 to 0.95 in one call (one engine, alternating).
template <typename Kind, typename T = typename Kind::T, typename W = typename Kind::W>
void lora_linear(const Linear& s, const Lora& a, const T* x, const W* w, const T* bias, const T* pool, T* y) {
    const std::vector<Task> tasks = tasks_of(a);
    if (std::all_of(tasks.begin(), tasks.end(), [](const Task& task) { return task.first == 0; })) {
        decode_linear<Kind>(s, a, tasks, x, w, bias, pool, y);
    } else {
        prefill_linear<Kind>(s, a, tasks, x, w, bias, pool, y);
    }
}

// lora_linear of int8 or NF4 weights: their scales (absmax) are the call's own (a step's shape
// serves every layer of its shape).
template <typename Kind, typename T = typename Kind::T, typename W = typename Kind::W>
void scaled_linear(const Linear* s, const Lora* a, const T* x, const W* w, const T* bias, const T* pool, T* y,
                   const float* scale) {
    Linear scaled = *s;
    scaled.scale = scale;
    lora_linear<Kind>(scaled, *a, x, w, bias, pool, y);
}

}  // namespace

extern "C" int64_t lora_panel_columns() { return kCols; }

extern "C" void lora_linear_float32(const Linear* s, const Lora* a, const float* x, const float* w,
                                    const float* bias, const float* pool, float* y) {
    lora_linear<Fp32>(*s, *a, x, w, bias, pool, y);
}

extern "C" void lora_linear_int8(const Linear* s, const Lora* a, const float* x, const int8_t* w, const float* bias,
                                 const float* pool, float* y, const float* scale) {
    scaled_linear<Int8>(s, a, x, w, bias, pool, y, scale);
}

extern "C" void lora_linear_nf4(const Linear* s, const Lora* a, const float* x, const uint8_t* w, const float* bias,
                                const float* pool, float* y, const float* absmax) {
    scaled_linear<Nf4>(s, a, x, w, bias, pool, y, absmax);
}

#ifdef __AVX512BF16__
extern "C" void lora_linear_bfloat16(const Linear* s, const Lora* a, const uint16_t* x, const uint16_t* w,
                                     const uint16_t* bias, const uint16_t* pool, uint16_t* y) {
    lora_linear<Bf16>(*s, *a, x, w, bias, pool, y);
}

extern "C" void lora_linear_int8_bfloat16(const Linear* s, const Lora* a, const uint16_t* x, const int8_t* w,
                                          const uint16_t* bias, const uint16_t* pool, uint16_t* y, const float* scale) {
    scaled_linear<Int8Bf16>(s, a, x, w, bias, pool, y, scale);
}

extern "C" void lora_linear_nf4_bfloat16(const Linear* s, const Lora* a, const uint16_t* x, const uint8_t* w,
                                         const uint16_t* bias, const uint16_t* pool, uint16_t* y, const float* absmax) {
    scaled_linear<Nf4Bf16>(s, a, x, w, bias, pool, y, absmax);
}
#endif

#define EXPORT(NAME, T)                                                                               \
    extern "C" void lora_shrink_##NAME(const Lora* a, const T* x, const T* pool, float* partials) {    \
        shrink<T>(*a, x, pool, partials);                                                             \
    }                                                                                                 \
    extern "C" void lora_expand_##NAME(const Lora* a, float* partials, const T* pool, T* y) {          \
        expand<T>(*a, partials, pool, y);                                                             \
    }                                                                                                 \
    extern "C" void lora_shrink_expand_##NAME(const Lora* a, const T* x, const T* pool, T* y) {        \
        shrink_expand<T>(*a, x, pool, y);                                                             \
    }

EXPORT(float32, float)
EXPORT(bfloat16, uint16_t)
EXPORT(float16, _Float16)
