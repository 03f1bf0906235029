// Prediction across tokens for the vq codec's version 5 (codec_predict.hpp).
#include "codec_predict.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string_view>
#include <unordered_map>

#include <immintrin.h>

namespace vq::vq_codec_detail {

namespace {

// Products of two hi parts are <= 255^2 < 2^16, so 2^15 rows of them fit an int32 sum.
constexpr std::size_t kBlockRows = std::size_t{1} << 15;

// The residual of one token from the previous one's hi part (prev = 0 at token 0: pred 0).
inline int residual(int k, int prev, int cur) { return cur - ((k * prev + 4) >> 3); }

// One token's rows for every coefficient: cur += pred(prev); false when one leaves +-max_hi.
bool unpredict_row_scalar(std::int16_t* cur, const std::int16_t* prev, const std::int16_t* k, std::size_t c0, std::size_t n, int max_hi) {
  bool bad = false;
  for (std::size_t c = c0; c < n; ++c) {
    const int v = cur[c] + ((k[c] * prev[c] + 4) >> 3);
    bad |= v > max_hi || v < -max_hi;
    cur[c] = static_cast<std::int16_t>(v);
  }
  return !bad;
}

// The same in 16-bit lanes: |prev| <= max_hi <= 255 and |k| <= 8, so k * prev + 4 and the sum with a
// residual of <= 255 fit int16 exactly.
__attribute__((target("avx2"))) bool unpredict_row_avx2(std::int16_t* cur, const std::int16_t* prev, const std::int16_t* k, std::size_t n,
                                                         int max_hi) {
  const __m256i four = _mm256_set1_epi16(4), hi = _mm256_set1_epi16(static_cast<std::int16_t>(max_hi)),
                lo = _mm256_set1_epi16(static_cast<std::int16_t>(-max_hi));
  __m256i bad = _mm256_setzero_si256();
  std::size_t c = 0;
  for (; c + 16 <= n; c += 16) {
    const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(prev + c));
    const __m256i kk = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k + c));
    const __m256i r = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cur + c));
    const __m256i v = _mm256_add_epi16(r, _mm256_srai_epi16(_mm256_add_epi16(_mm256_mullo_epi16(kk, p), four), 3));
    bad = _mm256_or_si256(bad, _mm256_or_si256(_mm256_cmpgt_epi16(v, hi), _mm256_cmpgt_epi16(lo, v)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(cur + c), v);
  }
  return _mm256_testz_si256(bad, bad) && unpredict_row_scalar(cur, prev, k, c, n, max_hi);
}

}  // namespace

// Two clones (ifunc): the passes below vectorise twice as wide with AVX2 as with the SSE2 baseline.
__attribute__((target_clones("avx2", "default"))) std::vector<std::int8_t> vq_predict(const std::int16_t* hi, std::int16_t* res, std::size_t n,
                                                                                      std::size_t batch, std::size_t tokens, int max_residual) {
  std::vector<std::int8_t> k(n, 0);
  const std::size_t R = batch * tokens;
  if (R < 2) {
    std::copy(hi, hi + R * n, res);
    return k;
  }
  // Least squares: per coefficient sums of prev^2 and prev * cur over tokens t >= 1 of each batch,
  // and of cur^2 over all tokens (the energy with k = 0), in int32 blocks flushed to int64.
  std::vector<std::int64_t> sxx(n, 0), sxy(n, 0), syy(n, 0);
  std::vector<std::int32_t> bxx(n, 0), bxy(n, 0), byy(n, 0);
  std::size_t in_block = 0;
  auto flush = [&] {
    for (std::size_t c = 0; c < n; ++c) sxx[c] += bxx[c], sxy[c] += bxy[c], syy[c] += byy[c];
    std::fill(bxx.begin(), bxx.end(), 0);
    std::fill(bxy.begin(), bxy.end(), 0);
    std::fill(byy.begin(), byy.end(), 0);
    in_block = 0;
  };
  for (std::size_t b = 0; b < batch; ++b)
    for (std::size_t t = 0; t < tokens; ++t) {
      const std::int16_t* cur = hi + (b * tokens + t) * n;
      if (t > 0) {
        const std::int16_t* prev = cur - n;
        for (std::size_t c = 0; c < n; ++c) bxx[c] += prev[c] * prev[c], bxy[c] += prev[c] * cur[c];
      }
      for (std::size_t c = 0; c < n; ++c) byy[c] += cur[c] * cur[c];
      if (++in_block == kBlockRows) flush();
    }
  flush();
  // k = 8 a rounded, a = sxy / sxx; the residual energy of k / 8 is syy - 2 (k/8) sxy + (k/8)^2 sxx.
  std::vector<std::int16_t> k16(n, 0);
  for (std::size_t c = 0; c < n; ++c) {
    if (sxx[c] == 0 || syy[c] == 0) continue;
    const double xx = static_cast<double>(sxx[c]), xy = static_cast<double>(sxy[c]), yy = static_cast<double>(syy[c]);
    const int kc = std::clamp(static_cast<int>(std::lround(8.0 * xy / xx)), kVqPredMin, kVqPredMax);
    const double a = kc / 8.0, energy = yy - 2.0 * a * xy + a * a * xx;
    if (energy <= (1.0 - kVqPredMinGain) * yy) k16[c] = static_cast<std::int16_t>(kc);
  }
  // The residuals; a coefficient with one outside +-max_residual falls back to k = 0 (its hi parts).
  std::vector<std::uint8_t> out(n, 0);
  for (std::size_t b = 0; b < batch; ++b)
    for (std::size_t t = 0; t < tokens; ++t) {
      const std::size_t row = (b * tokens + t) * n;
      const std::int16_t* cur = hi + row;
      std::int16_t* r = res + row;
      if (t == 0) {
        std::copy(cur, cur + n, r);
        continue;
      }
      const std::int16_t* prev = cur - n;
      for (std::size_t c = 0; c < n; ++c) {
        const int v = residual(k16[c], prev[c], cur[c]);
        out[c] |= static_cast<std::uint8_t>(v > max_residual || v < -max_residual);
        r[c] = static_cast<std::int16_t>(v);
      }
    }
  for (std::size_t c = 0; c < n; ++c) {
    if (out[c]) {
      k16[c] = 0;
      for (std::size_t row = 0; row < R; ++row) res[row * n + c] = hi[row * n + c];
    }
    k[c] = static_cast<std::int8_t>(k16[c]);
  }
  return k;
}

std::vector<std::int32_t> vq_find_copies(const std::int16_t* hi, std::size_t n, std::size_t rows) {
  std::vector<std::int32_t> from(rows, -1);
  if (n < kVqMinCopyWidth) return from;
  std::unordered_map<std::string_view, std::int32_t> last;
  last.reserve(rows);
  for (std::size_t r = 0; r < rows; ++r) {
    const std::string_view key(reinterpret_cast<const char*>(hi + r * n), 2 * n);
    auto [it, fresh] = last.try_emplace(key, static_cast<std::int32_t>(r));
    if (!fresh) {
      from[r] = it->second;
      it->second = static_cast<std::int32_t>(r);
    }
  }
  return from;
}

bool vq_unpredict(std::int16_t* codes, std::size_t n, std::size_t batch, std::size_t tokens, const std::int8_t* k, const std::int32_t* copy_from,
                  int max_hi, bool avx2) {
  const std::vector<std::int16_t> k16(k, k + n);
  for (std::size_t b = 0; b < batch; ++b) {
    for (std::size_t t = 0; t < tokens; ++t) {
      const std::size_t r = b * tokens + t;
      std::int16_t* cur = codes + r * n;
      if (copy_from != nullptr && copy_from[r] >= 0) {
        std::memcpy(cur, codes + static_cast<std::size_t>(copy_from[r]) * n, 2 * n);
        continue;
      }
      bool ok;
      if (t == 0) {  // pred 0: the residual is the hi part
        ok = true;
        for (std::size_t c = 0; c < n; ++c) ok &= cur[c] <= max_hi && cur[c] >= -max_hi;
      } else {
        ok = avx2 ? unpredict_row_avx2(cur, cur - n, k16.data(), n, max_hi) : unpredict_row_scalar(cur, cur - n, k16.data(), 0, n, max_hi);
      }
      if (!ok) return false;
    }
  }
  return true;
}

}  // namespace vq::vq_codec_detail
