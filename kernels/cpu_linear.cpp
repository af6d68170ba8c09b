// fp32 y = x W^T + b on the CPU, each output summed in blocks of inputs; built, loaded and
// documented by kernels/cpu_linear.py. W is packed in panels of kCols outputs: panel p holds
// W[p * kCols + c, k] at [p][k][c], its last panel padded with zero rows. A task is one panel and
// every row of x: for each block of inputs it walks the rows kRows at a time, summing the block's
// products in registers and adding that sum to the outputs, so the panel's block of W comes from
// memory once and from L1 for every further tile of rows.
#include <algorithm>
#include <cstdint>

#include "cpu_vec.h"

namespace {

struct Linear {
    int64_t rows, out, inputs, x_stride, y_stride, panels, block;
};

constexpr int kPanelVecs = 3;
constexpr int64_t kCols = kPanelVecs * kVec;  // a panel's outputs
constexpr int kRows = 8;                      // rows a tile sums at once: 24 accumulators

// Where a block's sums start: the outputs so far, or for the first block the bias (or zero).
struct Start {
    const float* bias;
    bool first;
};

// One block's sums of `count` inputs for R rows and one panel's `cols` outputs, added to y's.
// x: the rows' inputs from the block's first one on; w: the panel from that input on.
template <int R>
void tile(const Linear& s, const float* x, const float* w, int64_t count, Start start, float* y, int64_t cols) {
    Vec acc[R][kPanelVecs] = {};
    for (int64_t k = 0; k < count; ++k) {
        const float* wk = w + k * kCols;
        const Vec b0 = load(wk), b1 = load(wk + kVec), b2 = load(wk + 2 * kVec);
        for (int r = 0; r < R; ++r) {
            const float a = x[r * s.x_stride + k];
            acc[r][0] += a * b0;
            acc[r][1] += a * b1;
            acc[r][2] += a * b2;
        }
    }
    for (int r = 0; r < R; ++r) {
        float* yr = y + r * s.y_stride;
        if (cols == kCols) {
            for (int v = 0; v < kPanelVecs; ++v) {
                float* yv = yr + v * kVec;
                const Vec from = !start.first ? load(yv) : start.bias ? load(start.bias + v * kVec) : Vec{};
                store(yv, from + acc[r][v]);
            }
        } else {  // the last panel's outputs
            for (int64_t c = 0; c < cols; ++c) {
                const float from = !start.first ? yr[c] : start.bias ? start.bias[c] : 0.0f;
                yr[c] = from + acc[r][c / kVec][c % kVec];
            }
        }
    }
}

// tile<R> over every row of x, the last rows in one smaller tile.
void rows_tiles(const Linear& s, const float* x, const float* w, int64_t count, Start start, float* y, int64_t cols) {
    int64_t m = 0;
    for (; m + kRows <= s.rows; m += kRows) {
        tile<kRows>(s, x + m * s.x_stride, w, count, start, y + m * s.y_stride, cols);
    }
    x += m * s.x_stride;
    y += m * s.y_stride;
    switch (s.rows - m) {
        case 0: break;
        case 1: tile<1>(s, x, w, count, start, y, cols); break;
        case 2: tile<2>(s, x, w, count, start, y, cols); break;
        case 3: tile<3>(s, x, w, count, start, y, cols); break;
        case 4: tile<4>(s, x, w, count, start, y, cols); break;
        case 5: tile<5>(s, x, w, count, start, y, cols); break;
        case 6: tile<6>(s, x, w, count, start, y, cols); break;
        default: tile<7>(s, x, w, count, start, y, cols); break;
    }
}

void panel(const Linear& s, const float* x, const float* w, const float* bias, float* y, int64_t p) {
    const int64_t cols = std::min(kCols, s.out - p * kCols);
    w += p * s.inputs * kCols;
    bias = bias == nullptr ? nullptr : bias + p * kCols;
    for (int64_t k = 0; k < s.inputs; k += s.block) {
        const int64_t count = std::min(s.block, s.inputs - k);
        rows_tiles(s, x + k, w + k * kCols, count, Start{bias, k == 0}, y + p * kCols, cols);
    }
}

}  // namespace

extern "C" int64_t linear_panel_columns() { return kCols; }

extern "C" void linear_float32(const Linear* s, const float* x, const float* w, const float* bias, float* y) {
#pragma omp parallel for schedule(static) if (s->rows * s->out * s->inputs > 1 << 18)
    for (int64_t p = 0; p < s->panels; ++p) panel(*s, x, w, bias, y, p);
}
