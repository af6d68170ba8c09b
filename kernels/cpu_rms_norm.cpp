// RMSNorm on the CPU, one call for every row; built, loaded and documented by
// kernels/cpu_rms_norm.py. Each row is what the torch path (inference_service/model/model.py's
// RMSNorm) computes: in fp32, x times 1 / sqrt(mean(x^2) + eps), rounded to the dtype, then times
// the weight, rounded again.
#pragma GCC optimize("fp-contract=off")
#include <cmath>
#include <cstdint>

#include "cpu_vec.h"

namespace {

struct Norm {
    int64_t rows, size, x_stride, out_stride;
    float eps;
};

template <typename T>
float mean_square(const T* x, int64_t n) {
    Vec sums[2] = {};
    int64_t d = 0;
    for (; d + 2 * kVec <= n; d += 2 * kVec) {
        const Vec a = load(x + d), b = load(x + d + kVec);
        sums[0] += a * a;
        sums[1] += b * b;
    }
    for (; d + kVec <= n; d += kVec) {
        const Vec a = load(x + d);
        sums[0] += a * a;
    }
    float sum = lane_sum(sums[0] + sums[1]);
    for (; d < n; ++d) sum += widen(x[d]) * widen(x[d]);
    return sum / static_cast<float>(n);
}

template <typename T>
void norm_row(const Norm& s, const T* x, const T* weight, T* out) {
    const float inverse = 1.0f / std::sqrt(mean_square(x, s.size) + s.eps);
    int64_t d = 0;
    for (; d + kVec <= s.size; d += kVec) store(out + d, load(weight + d) * rounded<T>(load(x + d) * inverse));
    for (; d < s.size; ++d) out[d] = narrow<T>(widen(weight[d]) * widen(narrow<T>(widen(x[d]) * inverse)));
}

template <typename T>
void rms_norm(const Norm* s, const T* x, const T* weight, T* out) {
#pragma omp parallel for schedule(static) if (s->rows * s->size > 1 << 16)
    for (int64_t r = 0; r < s->rows; ++r) norm_row(*s, x + r * s->x_stride, weight, out + r * s->out_stride);
}

}  // namespace

#define EXPORT(NAME, T)                                                                        \
    extern "C" void rms_norm_##NAME(const Norm* s, const T* x, const T* weight, T* out) { \
        rms_norm<T>(s, x, weight, out);                                                        \
    }

EXPORT(float32, float)
EXPORT(bfloat16, uint16_t)
EXPORT(float16, _Float16)
