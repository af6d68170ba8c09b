// The linear kernel's panels and tiles (y = x W^T + b for fp32 and bf16 weights), shared by
// kernels/cpu_linear.cpp (the layer alone) and kernels/cpu_lora.cpp (the layer and its adapters in
// one call); kernels/cpu_linear.py packs W and documents the sums. W is packed in panels of kCols
// outputs: panel p holds W[p * kCols + c, k] at [p][k][c] (bf16: inputs in pairs, at
// [p][k / 2][c][k % 2]), its last panel padded with zero rows. A task is one panel and a block of
// kBlockRows rows of x (panels_by_blocks), walked kRows rows at a time: a tile of rows sums each
// block of inputs' products in fp32 registers and adds that sum to its totals, which it stores
// once, so y is written once and never read. The panel comes from memory for the first tile and
// from L2 for the rest (its blocks from L1, at 512 rows, took 1.04x as long: each block's sums went
// through y). fp32 sums blocks of s.block inputs; bf16 sums all inputs in one block and rounds
// once. int8 weights (one scale per output) multiply fp32 rows as fp32 ones do, each vector of them
// widened as it is read; the totals are scaled, then the bias added, as they are stored. They
// multiply bf16 rows as bf16 ones do, each pair widened to bf16, the totals rounded before and
// after their scales. NF4 weights (4-bit codes, an absmax per output and 64 inputs) are looked up
// and scaled as they are read, then multiply as fp32 ones.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_vec.h"
#ifdef __AVX2__
#include <immintrin.h>
#endif


struct Linear {
    int64_t rows, out, inputs, x_stride, y_stride, panels, block;
    const float* scale;  // int8: [out], each output's scale; NF4: [panels][inputs / 64][kCols], absmax
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
// read theirs, so that they come in while the tile multiplies, not once it misses them. At 8 and
// 32 rows a model's layers took 0.84 to 0.93 of the time; 4 KB to 36 KB ahead were within 3% of
// each other. A lone row's tile asks as well: on a Zen 5 EPYC a model's layers at one row took
// 0.88 to 0.93 of the time (fp32; bf16 0.985), decode steps at batch 1 0.97 to 0.99 (fp32, with an
// adapter or without; bf16 0.96 to 0.99). (A prefetch past the weights' end does not fault.)
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

// x times the panel's weights for one step of inputs: one fp32 input, or a pair of bf16 ones.
// T: x's, y's and the bias' type; W: the weights'; kBits: a weight's bits; kScaled: whether each
// output's total is multiplied by its scale (then the bias is added after, not summed from the
// start). weights(): a step's weights as madd() takes them (its own, or what they were looked up as),
// read once for every row of a tile.
struct Fp32 {
    using T = float;
    using W = float;
    static constexpr int64_t kStep = 1, kBits = 32;
    static constexpr bool kScaled = false;
    static int64_t block(const Linear& s) { return s.block; }
    static const float* weights(const float* w, const float*, int64_t) { return w; }
    static void madd(Lanes* acc, const float* x, const float* w) {
        for (int v = 0; v < kPanelVecs; ++v) acc[v] += *x * load_as<Lanes>(w + v * kLanes);
    }
};

#ifdef __AVX512BF16__
struct Bf16 {
    using T = uint16_t;
    using W = uint16_t;
    static constexpr int64_t kStep = 2, kBits = 16;
    static constexpr bool kScaled = false;
    static int64_t block(const Linear& s) { return s.inputs; }  // bf16 outputs are rounded once
    static const uint16_t* weights(const uint16_t* w, const float*, int64_t) { return w; }
    static void madd(Lanes* acc, const uint16_t* x, const uint16_t* w) {
        const __m512bh pair = (__m512bh)_mm512_set1_epi32(load_as<int32_t>(x));
        for (int v = 0; v < kPanelVecs; ++v) {
            acc[v] = (Lanes)_mm512_dpbf16_ps((__m512)acc[v], pair, (__m512bh)load_as<__m512i>(w + 2 * v * kLanes));
        }
    }
};
#endif

// fp32 rows times int8 weights (torchao's weight-only int8): each weight widened to fp32 (exact),
// multiplied and summed as Fp32's; each output's total times its scale, then the bias.
struct Int8 {
    using T = float;
    using W = int8_t;
    static constexpr int64_t kStep = 1, kBits = 8;
    static constexpr bool kScaled = true;
    static int64_t block(const Linear& s) { return s.block; }
    static const int8_t* weights(const int8_t* w, const float*, int64_t) { return w; }
    static Lanes widened(const int8_t* w) {
#ifdef __AVX512F__
        return (Lanes)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load_as<__m128i>(w)));
#else
        typedef int8_t Bytes __attribute__((vector_size(kLanes)));
        return __builtin_convertvector(load_as<Bytes>(w), Lanes);
#endif
    }
    static void madd(Lanes* acc, const float* x, const int8_t* w) {
        for (int v = 0; v < kPanelVecs; ++v) acc[v] += *x * widened(w + v * kLanes);
    }
    static Vec scaled(Vec total, Vec scale, Vec bias) { return total * scale + bias; }
};

// fp32 rows times NF4 weights (bitsandbytes' 4-bit NormalFloat, kernels/nf4_linear.py): a weight is
// its code's value times the absmax of its output's block of 64 inputs, an fp32 product, as
// dequantize_nf4 gives it; then it multiplies and sums as Fp32's do (bit for bit, on those weights).
// A step is two inputs: byte c of it holds output c's code of the first in its low nibble, of the
// second in its high one.
struct Nf4 {
    using T = float;
    using W = uint8_t;
    static constexpr int64_t kStep = 2, kBits = 4, kBlock = 64;
    static constexpr bool kScaled = false;
    // kernels/nf4_linear.py's NF4_CODE
    static constexpr float kCode[16] = {
        -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,
        -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,
        0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f, 0.33791524171829224f,
        0.44070982933044434f, 0.5626170039176941f, 0.7229568362236023f, 1.0f,
    };
    using Dense = Fp32;  // the kind whose tiles multiply the looked-up weights alike
    static constexpr int64_t kLookupTiles = 4;  // panels read by more tiles look their weights up once (panel())
    struct Step {
        Lanes first[kPanelVecs], second[kPanelVecs];  // the two inputs' weights
    };
    static int64_t block(const Linear& s) { return s.block; }
    // the step's weights in Dense's layout: 2 * kCols floats
    static void unpack(const Step& step, float* out) {
        for (int v = 0; v < kPanelVecs; ++v) {
            std::memcpy(out + v * kLanes, &step.first[v], sizeof(Lanes));
            std::memcpy(out + kCols + v * kLanes, &step.second[v], sizeof(Lanes));
        }
    }
    // w: the step's codes; absmax: the panel's [inputs / 64][kCols]; k: the step's first input
    static Step weights(const uint8_t* w, const float* absmax, int64_t k) {
        const float* scale = absmax + k / kBlock * kCols;
        Step step;
        for (int v = 0; v < kPanelVecs; ++v) {
            const Lanes s = load_as<Lanes>(scale + v * kLanes);
            Lanes first, second;
            values(w + v * kLanes, first, second);
            step.first[v] = first * s;
            step.second[v] = second * s;
        }
        return step;
    }
    // Fp32's madd, one input after the other, on the step's registers: through Fp32::madd (which
    // loads from memory) its tiles of 8 and 32 rows took 1.24x as long
    static void madd(Lanes* acc, const float* x, const Step& w) {
        for (int v = 0; v < kPanelVecs; ++v) acc[v] += x[0] * w.first[v];
        for (int v = 0; v < kPanelVecs; ++v) acc[v] += x[1] * w.second[v];
    }
    // The code values of kLanes bytes' low and high nibbles.
    static void values(const uint8_t* bytes, Lanes& low, Lanes& high) {
#ifdef __AVX512F__
        const __m512 code = _mm512_loadu_ps(kCode);
        const __m512i b = _mm512_cvtepu8_epi32(load_as<__m128i>(bytes));
        low = (Lanes)_mm512_permutexvar_ps(b, code);  // the index's low 4 bits
        high = (Lanes)_mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), code);
#elif defined(__AVX2__)
        // the table's two halves, each index's bit 3 choosing between them: this build's NF4 tiles
        // take 1.2 to 1.4x the fp32 ones' time (1 to 32 rows, weights in cache), where a lookup per
        // lane took 2.5x
        const __m256 first = _mm256_loadu_ps(kCode), second = _mm256_loadu_ps(kCode + 8);
        auto look = [&](__m256i index) {
            const __m256 upper = _mm256_castsi256_ps(_mm256_slli_epi32(index, 28));  // bit 3 as the sign
            return _mm256_blendv_ps(_mm256_permutevar8x32_ps(first, index), _mm256_permutevar8x32_ps(second, index), upper);
        };
        const __m256i b = _mm256_cvtepu8_epi32(load_as<__m128i>(bytes));  // the first 8 bytes
        low = (Lanes)look(b);
        high = (Lanes)look(_mm256_srli_epi32(b, 4));
#else
        for (int l = 0; l < kLanes; ++l) low[l] = kCode[bytes[l] & 15], high[l] = kCode[bytes[l] >> 4];
#endif
    }
};

#ifdef __AVX512BF16__
// What the kinds that widen their weights into bf16 pairs share: Bf16's step of two inputs, a
// step's weights in Bf16's layout (a register per vector of outputs: lane c holds the first input's
// weight, then the second's), Bf16's one block and its products.
struct Bf16Pairs {
    using T = uint16_t;
    static constexpr int64_t kStep = 2;
    struct Step {
        __m512i pairs[kPanelVecs];
    };
    static int64_t block(const Linear& s) { return s.inputs; }
    static void unpack(const Step& step, uint16_t* out) {  // 2 * kCols bf16
        for (int v = 0; v < kPanelVecs; ++v) std::memcpy(out + 2 * v * kLanes, &step.pairs[v], sizeof(__m512i));
    }
    static void madd(Lanes* acc, const uint16_t* x, const Step& w) {
        Bf16::madd(acc, x, reinterpret_cast<const uint16_t*>(w.pairs));
    }
};

// bf16 rows times NF4 weights: each weight looked up and scaled as Nf4's, rounded to bf16 as
// dequantize_nf4 rounds it for bf16 activations, then multiplied in pairs and summed as Bf16's
// (bit for bit the bf16 tiles on those weights).
struct Nf4Bf16 : Bf16Pairs {
    using W = uint8_t;
    static constexpr int64_t kBits = 4;
    static constexpr bool kScaled = false;
    using Dense = Bf16;
    static constexpr int64_t kLookupTiles = 1;
    static Step weights(const uint8_t* w, const float* absmax, int64_t k) {
        const Nf4::Step values = Nf4::weights(w, absmax, k);
        Step step;
        for (int v = 0; v < kPanelVecs; ++v) {
            step.pairs[v] = (__m512i)(bf16_bits(values.first[v]) | (bf16_bits(values.second[v]) << 16));
        }
        return step;
    }
};

// Bf16's tiles whose totals are then rounded to bf16, times their scales rounded to bf16, rounded,
// plus the biases, as kernels/int8_linear.py's ops round each result to the rows' dtype: the kind
// that multiplies Int8Bf16's weights once widened (panel()).
struct ScaledBf16 : Bf16 {
    static constexpr bool kScaled = true;
    static Vec scaled(Vec total, Vec scale, Vec bias) {
        return rounded<uint16_t>(rounded<uint16_t>(total) * rounded<uint16_t>(scale)) + bias;
    }
};

// bf16 rows times int8 weights (torchao's weight-only int8 under bf16 activations), in Int8's
// layout: each pair of weights widened to bf16 (exact: |q| <= 128), multiplied and summed as
// Bf16's, the totals scaled as ScaledBf16's.
struct Int8Bf16 : Bf16Pairs {
    using W = int8_t;
    static constexpr int64_t kBits = 8;
    static constexpr bool kScaled = true;
    // widened once a panel where more than 4 tiles read it: decode steps (engines alternating) at 32
    // rows took 0.99x dense bf16's time widening in every tile, 1.14x widening once; at 128 rows
    // 1.09x and 1.05x
    using Dense = ScaledBf16;
    static constexpr int64_t kLookupTiles = 4;
    // w: the step's two inputs' rows of kCols weights
    static Step weights(const int8_t* w, const float*, int64_t) {
        Step step;
        for (int v = 0; v < kPanelVecs; ++v) {  // a widened weight is a bf16 number: its bits' high half
            const Bits first = (Bits)Int8::widened(w + v * kLanes), second = (Bits)Int8::widened(w + kCols + v * kLanes);
            step.pairs[v] = (__m512i)((first >> 16) | (second & 0xffff0000u));
        }
        return step;
    }
    static Vec scaled(Vec total, Vec scale, Vec bias) { return ScaledBf16::scaled(total, scale, bias); }
};
#endif

// A panel's `cols` values of `from` (biases or scales) widened to fp32, the rest (all, where
// `from` is null) zeros.
template <typename T>
void panel_lanes(const T* from, int64_t cols, Lanes* lanes) {  // lanes [kPanelVecs]
    float b[kCols] = {};
    if (from != nullptr) std::transform(from, from + cols, b, [](T v) { return widen(v); });
    for (int v = 0; v < kPanelVecs; ++v) lanes[v] = load_as<Lanes>(b + v * kLanes);
}

// What a tile's totals start from and end with, for one panel: they start from its biases (or
// zeros) and are stored as they are; scaled kinds start from zeros and store totals * scale + bias.
// NF4 panels: their absmax, which the weights are looked up with (fp32 or bf16 rows).
struct Ends {
    Lanes start[kPanelVecs], scale[kPanelVecs], bias[kPanelVecs];
    const float* absmax;  // [inputs / 64][kCols]
};

template <typename Kind, typename T = typename Kind::T>
Ends panel_ends(const Linear& s, const T* bias, int64_t p, int64_t cols) {
    Ends ends{};
    const T* panel_bias = bias == nullptr ? nullptr : bias + p * kCols;
    panel_lanes(Kind::kScaled ? nullptr : panel_bias, cols, ends.start);
    if constexpr (Kind::kScaled) {
        panel_lanes(s.scale + p * kCols, cols, ends.scale);
        panel_lanes(panel_bias, cols, ends.bias);
    }
    if constexpr (std::is_same_v<typename Kind::W, uint8_t>) {  // NF4 codes
        ends.absmax = s.scale + p * (s.inputs / Nf4::kBlock) * kCols;
    }
    return ends;
}

// The tile's R rows of y, one panel's `cols` outputs: its totals (scaled kinds: times the scales,
// plus the biases), rounded to T.
template <typename Kind, int R, typename T = typename Kind::T>
void store_totals(const Linear& s, const Lanes (&total)[R][kPanelVecs], const Ends& ends, T* y, int64_t cols) {
    for (int r = 0; r < R; ++r) {
        T* yr = y + r * s.y_stride;
        T last[kCols];  // the last panel's outputs, written through here
        T* to = cols == kCols ? yr : last;
        for (int64_t c = 0; c < kCols; c += kVec) {
            Vec out = sixteen(total[r], c);
            if constexpr (Kind::kScaled) out = Kind::scaled(out, sixteen(ends.scale, c), sixteen(ends.bias, c));
            store(to + c, out);
        }
        if (to == last) std::copy(last, last + cols, yr);
    }
}

// R rows of x times one panel, over every input: each block's products are summed in registers
// and the sum added to the tile's totals (in L1), which are stored once.
// x: the rows' first inputs; w: the panel; ask: whether to ask for the weights kAhead bytes on.
template <typename Kind, int R, typename T = typename Kind::T, typename W = typename Kind::W>
void tile(const Linear& s, const T* x, const W* w, const Ends& ends, T* y, int64_t cols, bool ask) {
    constexpr int64_t step_bytes = Kind::kStep * kCols * Kind::kBits / 8;  // the weights of one step
    const int64_t block = Kind::block(s);
    Lanes total[R][kPanelVecs];
    for (int r = 0; r < R; ++r) std::copy(ends.start, ends.start + kPanelVecs, total[r]);
    for (int64_t k0 = 0; k0 < s.inputs; k0 += block) {
        const int64_t stop = std::min(k0 + block, s.inputs);
        Lanes acc[R][kPanelVecs] = {};
        const char* step = reinterpret_cast<const char*>(w) + k0 / Kind::kStep * step_bytes;
        for (int64_t k = k0; k < stop; k += Kind::kStep, step += step_bytes) {
            const W* wk = reinterpret_cast<const W*>(step);
            if (ask) {
                const char* ahead = reinterpret_cast<const char*>(wk) + kAhead;
                for (int64_t line = 0; line < step_bytes; line += 64) __builtin_prefetch(ahead + line);
            }
            const auto weights = Kind::weights(wk, ends.absmax, k);
            for (int r = 0; r < R; ++r) Kind::madd(acc[r], x + r * s.x_stride + k, weights);
        }
        for (int r = 0; r < R; ++r) {
            for (int v = 0; v < kPanelVecs; ++v) total[r][v] += acc[r][v];
        }
    }
    store_totals<Kind, R>(s, total, ends, y, cols);
}

// Every row of x times a panel whose totals start from ends: a tile of kRows rows at a time, the
// last rows in one smaller tile.
template <typename Kind, typename T = typename Kind::T, typename W = typename Kind::W>
void tiles(const Linear& s, const T* x, const W* w, const Ends& ends, T* y, int64_t cols) {
    int64_t m = 0;
    for (; m + kRows <= s.rows; m += kRows) {
        tile<Kind, kRows>(s, x + m * s.x_stride, w, ends, y + m * s.y_stride, cols, m < kAskRows);
    }
    x += m * s.x_stride;
    y += m * s.y_stride;
    const bool ask = m < kAskRows;
    switch (s.rows - m) {
        case 0: break;
        case 1: tile<Kind, 1>(s, x, w, ends, y, cols, ask); break;
        case 2: tile<Kind, 2>(s, x, w, ends, y, cols, ask); break;
        case 3: tile<Kind, 3>(s, x, w, ends, y, cols, ask); break;
        case 4: tile<Kind, 4>(s, x, w, ends, y, cols, ask); break;
        case 5: tile<Kind, 5>(s, x, w, ends, y, cols, ask); break;
        case 6: tile<Kind, 6>(s, x, w, ends, y, cols, ask); break;
        default: tile<Kind, 7>(s, x, w, ends, y, cols, ask); break;
    }
}

// Whether a kind looks its weights up (NF4; int8 under bf16 rows, widening them): Kind::Dense then
// multiplies what it looks up.
template <typename Kind, typename = void>
constexpr bool kLooksUp = false;
template <typename Kind>
constexpr bool kLooksUp<Kind, std::void_t<typename Kind::Dense>> = true;

// A panel's weights w (of Kind, which looks them up) into out [inputs, kCols], in Kind::Dense's layout.
template <typename Kind, typename W = typename Kind::W>
void look_up(const Linear& s, const W* w, const Ends& ends, typename Kind::Dense::W* out) {
    constexpr int64_t step_bytes = Kind::kStep * kCols * Kind::kBits / 8;
    for (int64_t k = 0; k < s.inputs; k += Kind::kStep) {
        Kind::unpack(Kind::weights(w + k / Kind::kStep * step_bytes, ends.absmax, k), out + k * kCols);
    }
}

// Panel p's weights in w.
template <typename Kind, typename W = typename Kind::W>
const W* panel_weights(const Linear& s, const W* w, int64_t p) {
    return w + p * s.inputs * kCols * Kind::kBits / (8 * sizeof(W));
}

// The outputs panel p holds: kCols, fewer in the last.
inline int64_t panel_cols(const Linear& s, int64_t p) { return std::min(kCols, s.out - p * kCols); }

// Panel p times every row of x, its totals started from its biases (panel_ends). Where a kind looks
// its weights up and more than Kind::kLookupTiles tiles read them, they are looked up once, into a
// panel of Dense's (in L2, a thread's own), which Dense's tiles then multiply: the same weights, the
// same sums. At 32 rows (4 tiles) with 8 adapters, NF4 decode steps so took 0.73 of the time in
// bf16, and 1.06x in fp32, whose lookup costs less beside its products.
template <typename Kind, typename T = typename Kind::T, typename W = typename Kind::W>
void panel(const Linear& s, const T* x, const W* w, const T* bias, T* y, int64_t p) {
    const int64_t cols = panel_cols(s, p);
    w = panel_weights<Kind>(s, w, p);
    y += p * kCols;
    const Ends ends = panel_ends<Kind>(s, bias, p, cols);
    if constexpr (kLooksUp<Kind>) {
        if (s.rows > Kind::kLookupTiles * kRows) {
            using Dense = typename Kind::Dense;
            thread_local std::vector<typename Dense::W> dense;
            dense.resize(s.inputs * kCols);
            look_up<Kind>(s, w, ends, dense.data());
            tiles<Dense>(s, x, dense.data(), panel_ends<Dense>(s, bias, p, cols), y, cols);
            return;
        }
    }
    tiles<Kind>(s, x, w, ends, y, cols);
}

// Every panel times x, kBlockRows rows of x at a time, in a parallel region (its threads split each
// block's panels): a block of x stays in cache while the panels stream past it, where every row at
// once came from memory for each panel (16,384 rows of 576 inputs are 37.7 MB). At 16,384 rows (32
// prompts of 512 tokens in one step) a layer's seven matmuls took 0.85 of that time in blocks of 128
// or 256 rows (fp32 and bf16), 0.97 to 1.0 in blocks of 512; at 512 and 2,048 rows, within noise of
// it. In an engine that step took 9.6 s in place of 10.4 to 11.3 s (32 steps of 512 rows: 9.4 to 10).
constexpr int64_t kBlockRows = 128;

// The shapes of the block of rows of s from row m.
inline Linear block_from(const Linear& s, int64_t m) {
    Linear block = s;
    block.rows = std::min(kBlockRows, s.rows - m);
    return block;
}

// panels_by_blocks for a kind that looks its weights up, over more than one block: each thread looks
// its own panels up once (a static schedule gives it the same panels in every block), into panels of
// Kind::Dense's, which every block's tiles then multiply. Against all rows in one block, NF4 and
// int8-under-bf16 layers at 512 rows took 1.02 to 1.10x the time looked up again in every block, and
// take 1.01 to 1.04x; at 4,096 rows (NF4, bf16) 1.035x, and 0.975x.
template <typename Kind, typename T = typename Kind::T, typename W = typename Kind::W>
void looked_up_by_blocks(const Linear& s, const T* x, const W* w, const T* bias, T* y) {
    using Dense = typename Kind::Dense;
    const int64_t size = s.inputs * kCols;  // a panel looked up
    thread_local std::vector<typename Dense::W> dense;  // this thread's panels from `first`
    int64_t first = s.panels, count = 0;
#pragma omp for schedule(static)
    for (int64_t p = 0; p < s.panels; ++p) {
        first = std::min(first, p);
        ++count;
    }
    dense.resize(count * size);
    for (int64_t m = 0; m < s.rows; m += kBlockRows) {
        const Linear block = block_from(s, m);
#pragma omp for schedule(static)
        for (int64_t p = 0; p < s.panels; ++p) {
            const int64_t cols = panel_cols(s, p);
            typename Dense::W* mine = dense.data() + (p - first) * size;
            if (m == 0) look_up<Kind>(s, panel_weights<Kind>(s, w, p), panel_ends<Kind>(s, bias, p, cols), mine);
            const Ends ends = panel_ends<Dense>(s, bias, p, cols);
            tiles<Dense>(block, x + m * s.x_stride, mine, ends, y + m * s.y_stride + p * kCols, cols);
        }
    }
}

template <typename Kind, typename T = typename Kind::T, typename W = typename Kind::W>
void panels_by_blocks(const Linear& s, const T* x, const W* w, const T* bias, T* y) {
    if constexpr (kLooksUp<Kind>) {
        if (s.rows > kBlockRows) return looked_up_by_blocks<Kind>(s, x, w, bias, y);
    }
    for (int64_t m = 0; m < s.rows; m += kBlockRows) {
        const Linear block = block_from(s, m);
#pragma omp for schedule(static)
        for (int64_t p = 0; p < s.panels; ++p) panel<Kind>(block, x + m * s.x_stride, w, bias, y + m * s.y_stride, p);
    }
}
