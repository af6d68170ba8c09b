// A grammar's token masks applied to logits on the CPU; built, loaded and documented by
// kernels/cpu_token_mask.py. Row j of the bitmask says which tokens row rows[j] of the logits may
// take (bit k of word w: token 32 w + k); every other token's logit becomes -inf, in place.
#include <algorithm>
#include <cstdint>
#include <limits>

namespace {

struct TokenMask {
    int64_t rows, vocab, words, logits_stride;
};

void mask_row(const TokenMask& s, const uint32_t* allowed, float* logits) {
    const float forbidden = -std::numeric_limits<float>::infinity();
    for (int64_t w = 0; w < s.words; ++w) {
        const uint32_t bits = allowed[w];
        if (bits == ~0u) continue;  // every token of the word allowed: most words of a free text
        const int64_t first = 32 * w, count = std::min<int64_t>(32, s.vocab - first);
        for (int64_t k = 0; k < count; ++k) {
            if (!((bits >> k) & 1u)) logits[first + k] = forbidden;
        }
    }
}

}  // namespace

extern "C" void token_mask_float32(const TokenMask* s, const int32_t* bitmask, const int64_t* rows, float* logits) {
#pragma omp parallel for schedule(static) if (s->rows * s->vocab > 1 << 21)
    for (int64_t j = 0; j < s->rows; ++j) {
        const auto* allowed = reinterpret_cast<const uint32_t*>(bitmask + j * s->words);
        mask_row(*s, allowed, logits + rows[j] * s->logits_stride);
    }
}
