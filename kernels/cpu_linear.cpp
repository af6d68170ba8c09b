// y = x W^T + b on the CPU for fp32, bf16, int8 and NF4 weights (int8 and NF4: fp32 or bf16 rows);
// built, loaded and documented by kernels/cpu_linear.py, over the panels of kernels/cpu_panels.h.
#include "cpu_panels.h"

namespace {

template <typename Kind, typename T = typename Kind::T, typename W = typename Kind::W>
void linear(const Linear* s, const T* x, const W* w, const T* bias, T* y) {
#pragma omp parallel if (s->rows * s->out * s->inputs > 1 << 18)
    panels_by_blocks<Kind>(*s, x, w, bias, y);
}

}  // namespace

extern "C" int64_t linear_panel_columns() { return kCols; }

extern "C" int64_t linear_block_rows() { return kBlockRows; }

extern "C" void linear_float32(const Linear* s, const float* x, const float* w, const float* bias, float* y) {
    linear<Fp32>(s, x, w, bias, y);
}

extern "C" void linear_int8(const Linear* s, const float* x, const int8_t* w, const float* bias, float* y) {
    linear<Int8>(s, x, w, bias, y);
}

extern "C" void linear_nf4(const Linear* s, const float* x, const uint8_t* w, const float* bias, float* y) {
    linear<Nf4>(s, x, w, bias, y);
}

#ifdef __AVX512BF16__
extern "C" void linear_bfloat16(const Linear* s, const uint16_t* x, const uint16_t* w, const uint16_t* bias,
                                uint16_t* y) {
    linear<Bf16>(s, x, w, bias, y);
}

extern "C" void linear_int8_bfloat16(const Linear* s, const uint16_t* x, const int8_t* w, const uint16_t* bias,
                                     uint16_t* y) {
    linear<Int8Bf16>(s, x, w, bias, y);
}

extern "C" void linear_nf4_bfloat16(const Linear* s, const uint16_t* x, const uint8_t* w, const uint16_t* bias,
                                    uint16_t* y) {
    linear<Nf4Bf16>(s, x, w, bias, y);
}
#endif
