// y = x W^T + b on the CPU for fp32 and bf16 weights; built, loaded and documented by
// kernels/cpu_linear.py. W is packed in panels of kCols outputs: panel p holds W[p * kCols + c, k]
// at [p][k][c] (bf16: inputs in pairs, at [p][k / 2][c][k % 2]), its last panel padded with zero
// rows. A task is one panel and every row of x: for each block of inputs it walks the rows kRows
// at a time, summing the block's products in fp32 registers and adding that sum to the outputs,
// so the panel's block of W comes from memory once and from L1 for every further tile of rows.
// fp32 sums blocks of s.block inputs; bf16 sums all inputs in one block and rounds once.
#include <algorithm>
#include <cstdint>

#include "cpu_vec.h"
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

namespace {

struct Linear {
    int64_t rows, out, inputs, x_stride, y_stride, panels, block;
};

// The accumulators are the ISA's own vectors, so that a tile's stay in registers.
#ifdef __AVX512F__
typedef Vec Lanes;
constexpr int kLanes = 16, kPanelVecs = 3, kRows = 8;  // 24 accumulators of 32 registers
#else
typedef float Lanes __attribute__((vector_size(32)));
constexpr int kLanes = 8, kPanelVecs = 2, kRows = 6;  // AVX2: 12 of 16
#endif
constexpr int64_t kCols = kPanelVecs * kLanes;  // a panel's outputs, a multiple of kVec

// A thread's panels lie one after another, so its weights are one stream. The tiles of the first
// kAskRows rows (every tile, at decode batch sizes) ask for the weights kAhead bytes on as they
// read theirs: the next block's come in while this block's tiles multiply from L1, where they
// came in only once the first tile missed them. At 8 and 32 rows a model's layers took 0.84 to
// 0.93 of the time; 4 KB to 36 KB ahead were within 3% of each other. A lone row streams at the
// memory's rate already, so its tile does not ask. (A prefetch past the weights' end does
// not fault.)
constexpr int64_t kAhead = 16 << 10, kAskRows = 32;

// Sums c to c + kVec of a row's accumulators, as a Vec.
inline Vec sixteen(const Lanes* acc, int64_t c) {
#ifdef __AVX512F__
    return acc[c / kLanes];
#else
    const Lanes a = acc[c / kLanes], b = acc[c / kLanes + 1];
    return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#endif
}

// Where a block's sums start: the outputs so far, or for the first block the bias (or zero).
template <typename T>
struct Start {
    const T* bias;
    bool first;
};

// x times the panel's weights for one step of inputs: one fp32 input, or a pair of bf16 ones.
struct Fp32 {
    using T = float;
    static constexpr int64_t kStep = 1;
    static int64_t block(const Linear& s) { return s.block; }
    static void madd(Lanes* acc, const float* x, const float* w) {
        for (int v = 0; v < kPanelVecs; ++v) acc[v] += *x * load_as<Lanes>(w + v * kLanes);
    }
};

#ifdef __AVX512BF16__
struct Bf16 {
    using T = uint16_t;
    static constexpr int64_t kStep = 2;
    static int64_t block(const Linear& s) { return s.inputs; }  // bf16 outputs are rounded once
    static void madd(Lanes* acc, const uint16_t* x, const uint16_t* w) {
        const __m512bh pair = (__m512bh)_mm512_set1_epi32(load_as<int32_t>(x));
        for (int v = 0; v < kPanelVecs; ++v) {
            acc[v] = (Lanes)_mm512_dpbf16_ps((__m512)acc[v], pair, (__m512bh)load_as<__m512i>(w + 2 * v * kLanes));
        }
    }
};
#endif

// to = from (or zero) + a row's sums, for a panel's outputs.
template <typename T>
void add_sums(const Lanes* sums, const T* from, T* to) {
    for (int64_t c = 0; c < kCols; c += kVec) {
        store(to + c, (from != nullptr ? load(from + c) : Vec{}) + sixteen(sums, c));
    }
}

// One block's sums of `count` inputs for R rows and one panel's `cols` outputs, added to y's.
// x: the rows' inputs from the block's first one on; w: the panel from that input on; ask: whether
// to ask for the weights kAhead bytes on.
template <typename Kind, int R, typename T = typename Kind::T>
void tile(const Linear& s, const T* x, const T* w, int64_t count, Start<T> start, T* y, int64_t cols, bool ask) {
    constexpr int64_t step_bytes = Kind::kStep * kCols * sizeof(T);  // the weights of one step
    Lanes acc[R][kPanelVecs] = {};
    for (int64_t k = 0; k < count; k += Kind::kStep) {
        const T* wk = w + k * kCols;
        if (R > 1 && ask) {
            const char* ahead = reinterpret_cast<const char*>(wk) + kAhead;
            for (int64_t line = 0; line < step_bytes; line += 64) __builtin_prefetch(ahead + line);
        }
        for (int r = 0; r < R; ++r) Kind::madd(acc[r], x + r * s.x_stride + k, wk);
    }
    for (int r = 0; r < R; ++r) {
        T* yr = y + r * s.y_stride;
        const T* from = !start.first ? yr : start.bias;
        if (cols == kCols) {
            add_sums(acc[r], from, yr);
            continue;
        }
        T last[kCols] = {};  // the last panel's outputs, read and written through here
        if (from != nullptr) std::copy(from, from + cols, last);
        add_sums(acc[r], from != nullptr ? last : nullptr, last);
        std::copy(last, last + cols, yr);
    }
}

// tile over every row of x, the last rows in one smaller tile.
template <typename Kind, typename T = typename Kind::T>
void rows_tiles(const Linear& s, const T* x, const T* w, int64_t count, Start<T> start, T* y, int64_t cols) {
    int64_t m = 0;
    for (; m + kRows <= s.rows; m += kRows) {
        tile<Kind, kRows>(s, x + m * s.x_stride, w, count, start, y + m * s.y_stride, cols, m < kAskRows);
    }
    x += m * s.x_stride;
    y += m * s.y_stride;
    const bool ask = m < kAskRows;
    switch (s.rows - m) {
        case 0: break;
        case 1: tile<Kind, 1>(s, x, w, count, start, y, cols, ask); break;
        case 2: tile<Kind, 2>(s, x, w, count, start, y, cols, ask); break;
        case 3: tile<Kind, 3>(s, x, w, count, start, y, cols, ask); break;
        case 4: tile<Kind, 4>(s, x, w, count, start, y, cols, ask); break;
        case 5: tile<Kind, 5>(s, x, w, count, start, y, cols, ask); break;
        case 6: tile<Kind, 6>(s, x, w, count, start, y, cols, ask); break;
        default: tile<Kind, 7>(s, x, w, count, start, y, cols, ask); break;
    }
}

template <typename Kind, typename T = typename Kind::T>
void panel(const Linear& s, const T* x, const T* w, const T* bias, T* y, int64_t p) {
    const int64_t cols = std::min(kCols, s.out - p * kCols), block = Kind::block(s);
    w += p * s.inputs * kCols;
    bias = bias == nullptr ? nullptr : bias + p * kCols;
    for (int64_t k = 0; k < s.inputs; k += block) {
        const int64_t count = std::min(block, s.inputs - k);
        rows_tiles<Kind>(s, x + k, w + k * kCols, count, Start<T>{bias, k == 0}, y + p * kCols, cols);
    }
}

template <typename Kind, typename T = typename Kind::T>
void linear(const Linear* s, const T* x, const T* w, const T* bias, T* y) {
#pragma omp parallel for schedule(static) if (s->rows * s->out * s->inputs > 1 << 18)
    for (int64_t p = 0; p < s->panels; ++p) panel<Kind>(*s, x, w, bias, y, p);
}

}  // namespace

extern "C" int64_t linear_panel_columns() { return kCols; }

extern "C" void linear_float32(const Linear* s, const float* x, const float* w, const float* bias, float* y) {
    linear<Fp32>(s, x, w, bias, y);
}

#ifdef __AVX512BF16__
extern "C" void linear_bfloat16(const Linear* s, const uint16_t* x, const uint16_t* w, const uint16_t* bias,
                                uint16_t* y) {
    linear<Bf16>(s, x, w, bias, y);
}
#endif
