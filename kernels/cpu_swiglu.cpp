// SwiGLU on the CPU, one call for every row; built, loaded and documented by
// kernels/cpu_swiglu.py. Each row of x holds gate then up (a gate_up projection's output), and
// out = silu(gate) * up as the torch path (F.silu(gate) * up) rounds it: silu in fp32, rounded to
// the dtype, then the product, rounded again.
#include <algorithm>
#include <cstdint>

#include "cpu_vec.h"

namespace {

struct Swiglu {
    int64_t rows, size, x_stride, out_stride;
};

// silu(gate) * up for kVec elements: silu(g) = g / (1 + e^-g), e^-g = 2^(-g log2 e).
template <typename T>
Vec swiglu_vec(Vec gate, Vec up) {
    return rounded<T>(gate / (1.0f + exp2_vec(gate * -kLog2e))) * up;
}

template <typename T>
void swiglu_row(const Swiglu& s, const T* x, T* out) {
    const T* up = x + s.size;
    int64_t i = 0;
    for (; i + kVec <= s.size; i += kVec) store(out + i, swiglu_vec<T>(load(x + i), load(up + i)));
    if (i == s.size) return;
    T gate_tail[kVec] = {}, up_tail[kVec] = {}, out_tail[kVec];  // the last elements, padded
    std::copy(x + i, x + s.size, gate_tail);
    std::copy(up + i, up + s.size, up_tail);
    store(out_tail, swiglu_vec<T>(load(gate_tail), load(up_tail)));
    std::copy(out_tail, out_tail + (s.size - i), out + i);
}

template <typename T>
void swiglu(const Swiglu* s, const T* x, T* out) {
#pragma omp parallel for schedule(static) if (s->rows * s->size > 1 << 16)
    for (int64_t r = 0; r < s->rows; ++r) swiglu_row(*s, x + r * s->x_stride, out + r * s->out_stride);
}

}  // namespace

#define EXPORT(NAME, T)                                                   \
    extern "C" void swiglu_##NAME(const Swiglu* s, const T* x, T* out) { \
        swiglu<T>(s, x, out);                                             \
    }

EXPORT(float32, float)
EXPORT(bfloat16, uint16_t)
EXPORT(float16, _Float16)
