// Rotary position embeddings on the CPU, in place on q and k where the qkv projection left them;
// built, loaded and documented by kernels/cpu_rope.py. Each element is what torch's apply_rope
// (inference_service/model/rope.py) computes: x * cos and rotate_half(x) * sin each rounded to the
// dtype, then their sum, so fp32 products are not fused into one rounding here.
#pragma GCC optimize("fp-contract=off")
#include <cstdint>

#include "cpu_vec.h"

namespace {

struct Rope {
    int64_t tokens, heads, head_dim, row;  // heads: q's and k's, one after the other in a row
};

// One head's halves x1 = x[:half], x2 = x[half:] become x1 cos1 - x2 sin1 and x2 cos2 + x1 sin2.
template <typename T>
void rotate(T* x, const T* cos, const T* sin, int64_t half) {
    int64_t d = 0;
    for (; d + kVec <= half; d += kVec) {
        const Vec x1 = load(x + d), x2 = load(x + half + d);
        const Vec low = rounded<T>(rounded<T>(x1 * load(cos + d)) + rounded<T>(-x2 * load(sin + d)));
        const Vec high = rounded<T>(rounded<T>(x2 * load(cos + half + d)) + rounded<T>(x1 * load(sin + half + d)));
        store(x + d, low);
        store(x + half + d, high);
    }
    for (; d < half; ++d) {
        const float x1 = widen(x[d]), x2 = widen(x[half + d]);
        const float low = widen(narrow<T>(x1 * widen(cos[d]))) + widen(narrow<T>(-x2 * widen(sin[d])));
        const float high = widen(narrow<T>(x2 * widen(cos[half + d]))) + widen(narrow<T>(x1 * widen(sin[half + d])));
        x[d] = narrow<T>(low);
        x[half + d] = narrow<T>(high);
    }
}

template <typename T>
void rope(const Rope* r, T* x, const T* cos, const T* sin) {
#pragma omp parallel for schedule(static) if (r->tokens * r->heads > 64)
    for (int64_t t = 0; t < r->tokens; ++t) {
        for (int64_t h = 0; h < r->heads; ++h) {
            rotate(x + t * r->row + h * r->head_dim, cos + t * r->head_dim, sin + t * r->head_dim, r->head_dim / 2);
        }
    }
}

}  // namespace

#define EXPORT(NAME, T) \
    extern "C" void rope_##NAME(const Rope* r, T* x, const T* cos, const T* sin) { rope<T>(r, x, cos, sin); }

EXPORT(float32, float)
EXPORT(bfloat16, uint16_t)
EXPORT(float16, _Float16)
