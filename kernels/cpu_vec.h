// Sixteen-float vectors for the CPU kernels (GCC's vector extensions: -march=native picks the ISA,
// one AVX-512 register or two AVX2 ones), and the widening and rounding of the serving dtypes.
// kernels/cpu_library.py builds every source that includes it again when it changes.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

typedef float Vec __attribute__((vector_size(64)));
typedef uint32_t Bits __attribute__((vector_size(64)));
typedef int32_t Ints __attribute__((vector_size(64)));
typedef uint16_t Half16 __attribute__((vector_size(32)));
typedef _Float16 Fp16x16 __attribute__((vector_size(32)));
constexpr int64_t kVec = 16;

// Whether a Vec is one register, as AVX-512's are. Where it is two AVX2 ones, GCC 12 moves lanes
// through the stack in places (a runtime scalar's splat, a tile of accumulators): kernels measured
// slower than their torch path so are declined there (CompiledKernel.AVX512_ONLY).
extern "C" int vec_in_one_register() {
#ifdef __AVX512F__
    return 1;
#else
    return 0;
#endif
}

inline float widen(float x) { return x; }
inline float widen(_Float16 x) { return static_cast<float>(x); }
inline float widen(uint16_t bf16) {  // bfloat16: the high half of a float
    return __builtin_bit_cast(float, static_cast<uint32_t>(bf16) << 16);
}

template <typename V, typename T>
inline V load_as(const T* x) {
    V v;
    std::memcpy(&v, x, sizeof v);
    return v;
}

inline Vec load(const float* x) { return load_as<Vec>(x); }

// Asks for the cache line holding p into L2. GCC dropped a loop of __builtin_prefetch calls and
// nothing else (as having no effect): this instruction it keeps.
inline void ask_for_line(const void* p) {
#if defined(__x86_64__)
    asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
#else
    __builtin_prefetch(p, 0, 2);
#endif
}
// fp16 to fp32 and back (round to nearest even), sixteen lanes in one instruction where AVX-512 has
// it: GCC 12 converts _Float16 vectors a lane at a time on CPUs without AVX512-FP16 (the decode
// kernel's fp16 keys took 1.4x as long as its fp32 ones so).
inline Vec widened(Fp16x16 h) {
#ifdef __AVX512F__
    return (Vec)_mm512_cvtph_ps((__m256i)h);
#else
    return __builtin_convertvector(h, Vec);
#endif
}

inline Fp16x16 halved(Vec x) {
#ifdef __AVX512F__
    return (Fp16x16)_mm512_cvtps_ph((__m512)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
    return __builtin_convertvector(x, Fp16x16);
#endif
}

inline Vec load(const _Float16* x) { return widened(load_as<Fp16x16>(x)); }

// bfloat16 bits of x, rounded to nearest even as torch rounds (a NaN stays a quiet NaN).
inline Bits bf16_bits(Vec x) {
    const Bits u = load_as<Bits>(&x);
    const Bits rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return ((u & 0x7fffffffu) > 0x7f800000u) ? ((u >> 16) | 0x40u) : rounded;
}

// bf16 to fp32 and back, in one instruction each where AVX-512 has them. GCC 12 widened through two
// halves and an insert, and narrowed through bf16_bits and a permute of a loaded table: in the LoRA
// expand's bf16 loop, the roundings took more time than its FMAs.
inline Vec widened(Half16 bf16) {
#ifdef __AVX512F__
    return (Vec)_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)bf16), 16);
#else
    const Bits bits = __builtin_convertvector(bf16, Bits) << 16;
    return load_as<Vec>(&bits);
#endif
}

// x rounded to bfloat16 (bf16_bits's values). vcvtneps2bf16 rounds so but reads a subnormal as zero,
// where torch keeps it: a vector with a subnormal lane takes bf16_bits.
inline Half16 bf16_halved(Vec x) {
#ifdef __AVX512BF16__
    if (!_mm512_fpclass_ps_mask((__m512)x, 0x20)) return (Half16)_mm512_cvtneps_pbh((__m512)x);
#endif
#ifdef __AVX512F__
    return (Half16)_mm512_cvtepi32_epi16((__m512i)bf16_bits(x));
#else
    return __builtin_convertvector(bf16_bits(x), Half16);
#endif
}

inline Vec load(const uint16_t* x) { return widened(load_as<Half16>(x)); }

// x rounded to T, as a vector of floats again.
template <typename T>
inline Vec rounded(Vec x) {
    if constexpr (std::is_same_v<T, float>) {
        return x;
    } else if constexpr (std::is_same_v<T, _Float16>) {
        return widened(halved(x));
    } else {
        return widened(bf16_halved(x));
    }
}

template <typename T>
inline void store(T* y, Vec x) {
    if constexpr (std::is_same_v<T, float>) {
        std::memcpy(y, &x, sizeof x);
    } else if constexpr (std::is_same_v<T, _Float16>) {
        const Fp16x16 h = halved(x);
        std::memcpy(y, &h, sizeof h);
    } else {
        const Half16 h = bf16_halved(x);
        std::memcpy(y, &h, sizeof h);
    }
}

template <typename T>
inline T narrow(float x) {  // one element, as rounded<T> and store<T> round sixteen
    Vec v = {};
    v[0] = x;
    T out[kVec];
    store(out, v);
    return out[0];
}

inline float lane_sum(Vec v) {  // halves added pairwise: four shuffles, not sixteen extractions
    typedef float Vec8 __attribute__((vector_size(32)));
    typedef float Vec4 __attribute__((vector_size(16)));
    const Vec8 v8 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                    __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    const Vec4 v4 = __builtin_shufflevector(v8, v8, 0, 1, 2, 3) + __builtin_shufflevector(v8, v8, 4, 5, 6, 7);
    return (v4[0] + v4[2]) + (v4[1] + v4[3]);
}

// Lane i of the result: x[i]'s lanes summed. Pairs of vectors are halved into one at each of four
// levels (15 additions for the sixteen sums, where lane_sum takes 4 for each).
inline Vec lane_sums(const Vec x[kVec]) {
    Vec y[8], z[4], w[2];
    for (int i = 0; i < 8; ++i) {  // y[i]: x[2i]'s 8 partial sums, then x[2i + 1]'s
        y[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(x[2 * i], x[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    }
    for (int i = 0; i < 4; ++i) {  // z[i]: 4 partial sums each of x[4i] .. x[4i + 3]
        z[i] = __builtin_shufflevector(y[2 * i], y[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               __builtin_shufflevector(y[2 * i], y[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    }
    for (int i = 0; i < 2; ++i) {  // w[i]: 2 partial sums each of x[8i] .. x[8i + 7]
        w[i] = __builtin_shufflevector(z[2 * i], z[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               __builtin_shufflevector(z[2 * i], z[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    }
    return __builtin_shufflevector(w[0], w[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           __builtin_shufflevector(w[0], w[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

inline float lane_max(Vec v) {  // halves compared pairwise, as lane_sum adds them
    typedef float Vec8 __attribute__((vector_size(32)));
    typedef float Vec4 __attribute__((vector_size(16)));
    const Vec8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
    const Vec8 b = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    const Vec8 v8 = a > b ? a : b;
    const Vec4 c = __builtin_shufflevector(v8, v8, 0, 1, 2, 3), d = __builtin_shufflevector(v8, v8, 4, 5, 6, 7);
    const Vec4 v4 = c > d ? c : d;
    return std::max(std::max(v4[0], v4[2]), std::max(v4[1], v4[3]));
}

// Whether the kernels multiply T's elements in bf16 pairs (vdpbf16ps: exact products, fp32 sums).
#ifdef __AVX512BF16__
template <typename T>
constexpr bool kPairs = std::is_same_v<T, uint16_t>;
#else
template <typename T>
constexpr bool kPairs = false;
#endif

constexpr float kLog2e = 1.4426950408889634f;

// 2^x, to about an ulp: 2^round(x) times a degree-7 Taylor polynomial of 2^f, |f| <= 1/2. Below
// -126 it is 2^-126 (masked scores, -inf, come out so: callers zero them); from 128 on, inf.
inline Vec exp2_vec(Vec x) {
    Vec t = x < -126.0f ? Vec{} - 126.0f : x;
    t = t > 128.0f ? Vec{} + 128.0f : t;
    const Vec magic = Vec{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
    const Vec n = (t + magic) - magic;
    const Vec f = t - n;
    constexpr float c[] = {1.0f, 0.6931471806f, 0.2402265070f, 0.0555041087f,
                           0.0096181291f, 0.0013333558f, 0.0001540353f, 0.0000152527f};
    Vec p = Vec{} + c[7];
    for (int i = 6; i >= 0; --i) p = p * f + c[i];
    const Ints bits = (__builtin_convertvector(n, Ints) + 127) << 23;
    return p * load_as<Vec>(&bits);
}
