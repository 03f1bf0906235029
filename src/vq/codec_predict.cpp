// Prediction across tokens for the vq codec's version 5 (codec_predict.hpp).
#include "codec_predict.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string_view>
#include <unordered_map>

#include <immintrin.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace vq::vq_codec_detail {

namespace {

// Products of two hi parts are <= 255^2 < 2^16, so 2^15 rows of them fit an int32 sum.
constexpr std::size_t kBlockRows = std::size_t{1} << 15;

// The residual of one token from the previous one's hi part (prev = 0 at token 0: pred 0).
inline int residual(int k, int prev, int cur) { return cur - ((k * prev + 4) >> 3); }

// One token's row for every coefficient c >= c0: out = res + pred(prev) (prev null: out = res);
// false when one leaves +-max_hi.
bool unpredict_row_scalar(std::int16_t* out, const std::int16_t* res, const std::int16_t* prev, const std::int16_t* k, std::size_t c0,
                          std::size_t n, int max_hi) {
  bool bad = false;
  for (std::size_t c = c0; c < n; ++c) {
    const int v = res[c] + (prev ? (k[c] * prev[c] + 4) >> 3 : 0);
    bad |= v > max_hi || v < -max_hi;
    out[c] = static_cast<std::int16_t>(v);
  }
  return !bad;
}

// The same in 16-bit lanes: |prev| <= max_hi <= 255 and |k| <= 8, so k * prev + 4 and the sum with a
// residual of <= 255 fit int16 exactly.
__attribute__((target("avx2"))) bool unpredict_row_avx2(std::int16_t* out, const std::int16_t* res, const std::int16_t* prev,
                                                         const std::int16_t* k, std::size_t n, int max_hi) {
  const __m256i four = _mm256_set1_epi16(4), hi = _mm256_set1_epi16(static_cast<std::int16_t>(max_hi)),
                lo = _mm256_set1_epi16(static_cast<std::int16_t>(-max_hi));
  __m256i bad = _mm256_setzero_si256();
  std::size_t c = 0;
  for (; c + 16 <= n; c += 16) {
    __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(res + c));
    if (prev) {
      const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(prev + c));
      const __m256i kk = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k + c));
      v = _mm256_add_epi16(v, _mm256_srai_epi16(_mm256_add_epi16(_mm256_mullo_epi16(kk, p), four), 3));
    }
    bad = _mm256_or_si256(bad, _mm256_or_si256(_mm256_cmpgt_epi16(v, hi), _mm256_cmpgt_epi16(lo, v)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c), v);
  }
  return _mm256_testz_si256(bad, bad) && unpredict_row_scalar(out, res, prev, k, c, n, max_hi);
}

// 32 lanes a vector; the tail under a mask.
__attribute__((target("avx512f,avx512bw,avx512vl,avx2"))) bool unpredict_row_avx512(std::int16_t* out, const std::int16_t* res,
                                                                                    const std::int16_t* prev, const std::int16_t* k,
                                                                                    std::size_t n, int max_hi) {
  const __m512i four = _mm512_set1_epi16(4), hi = _mm512_set1_epi16(static_cast<std::int16_t>(max_hi)),
                lo = _mm512_set1_epi16(static_cast<std::int16_t>(-max_hi));
  __mmask32 bad = 0;
  for (std::size_t c = 0; c < n; c += 32) {
    const __mmask32 m = n - c >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << (n - c)) - 1);
    __m512i v = _mm512_maskz_loadu_epi16(m, res + c);
    if (prev) {
      const __m512i p = _mm512_maskz_loadu_epi16(m, prev + c);
      const __m512i kk = _mm512_maskz_loadu_epi16(m, k + c);
      v = _mm512_add_epi16(v, _mm512_srai_epi16(_mm512_add_epi16(_mm512_mullo_epi16(kk, p), four), 3));
    }
    bad |= _mm512_mask_cmpgt_epi16_mask(m, v, hi) | _mm512_mask_cmplt_epi16_mask(m, v, lo);
    _mm512_mask_storeu_epi16(out + c, m, v);
  }
  return bad == 0;
}

// k = 8 a rounded, a = sxy / sxx, kept when the residual energy of k / 8, syy - 2 (k/8) sxy +
// (k/8)^2 sxx, is at most (1 - kVqPredMinGain) syy; else 0.
std::int16_t choose_k(std::int64_t sxx, std::int64_t sxy, std::int64_t syy) {
  if (sxx == 0 || syy == 0) return 0;
  const double xx = static_cast<double>(sxx), xy = static_cast<double>(sxy), yy = static_cast<double>(syy);
  const int kc = std::clamp(static_cast<int>(std::lround(8.0 * xy / xx)), kVqPredMin, kVqPredMax);
  const double a = kc / 8.0, energy = yy - 2.0 * a * xy + a * a * xx;
  return energy <= (1.0 - kVqPredMinGain) * yy ? static_cast<std::int16_t>(kc) : 0;
}

// Coefficient c coded as it is (k = 0), for a column whose residuals leave +-max_residual: its
// residuals are its hi parts, and amx its largest |hi|.
void code_as_is(std::size_t c, std::size_t n, std::size_t R, const std::int16_t* hi, std::int16_t* res, std::int16_t& k, std::uint16_t& amx) {
  k = 0;
  amx = 0;
  for (std::size_t row = 0; row < R; ++row) {
    res[row * n + c] = hi[row * n + c];
    amx = std::max(amx, static_cast<std::uint16_t>(std::abs(hi[row * n + c])));
  }
}

// vq_predict with AVX-512 BW, 32 coefficients a vector (same sums, same k, same residuals):
// - the sums two tokens at a time: with P = (y_s, y_s+1) and Q = (y_s+1, y_s+2) interleaved per
//   coefficient (vpunpck*wd), vpmaddwd gives y_s^2 + y_s+1^2 (P.P) and y_s y_s+1 + y_s+1 y_s+2 (P.Q)
//   in 32-bit lanes, in the unpacks' order (undone at the end); sxx = syy less each batch's last y^2;
// - the residuals in 16-bit lanes (k * prev + 4 fits: |k| <= 8, |prev| <= 255), with each column's
//   largest |residual|, which also tells the columns whose residuals leave +-max_residual.
__attribute__((target("avx512f,avx512bw,avx512vl,avx2"))) std::vector<std::int8_t> predict_avx512(const std::int16_t* hi, std::int16_t* res,
                                                                                                 std::size_t n, std::size_t batch,
                                                                                                 std::size_t tokens, int max_residual,
                                                                                                 std::vector<std::uint16_t>& amx) {
  const std::size_t R = batch * tokens, nb = (n + 31) / 32;
  // Per block of 32 columns: 16 lanes of the low unpack, 16 of the high; int32 within a block of
  // token pairs (each pair adds at most 2 * 255^2 < 2^17: 2^13 pairs fit), flushed to int64.
  std::vector<std::int32_t> byy(nb * 32, 0), bxy(nb * 32, 0);
  std::vector<std::int64_t> syy(n, 0), sxy(n, 0), sxx(n, 0);
  // Lane l of the low (high) unpack of a 512-bit vector holds column 8 (l / 4) + l % 4 (+ 4).
  auto col_of = [](std::size_t l) { return 8 * ((l % 16) / 4) + l % 4 + (l >= 16 ? 4 : 0); };
  auto flush = [&] {
    for (std::size_t b = 0; b < nb; ++b)
      for (std::size_t l = 0; l < 32; ++l) {
        const std::size_t c = 32 * b + col_of(l);
        if (c < n) syy[c] += byy[32 * b + l], sxy[c] += bxy[32 * b + l];
      }
    std::fill(byy.begin(), byy.end(), 0);
    std::fill(bxy.begin(), bxy.end(), 0);
  };
  const std::vector<std::int16_t> zero(n, 0);
  std::size_t pairs = 0;
  for (std::size_t b = 0; b < batch; ++b) {
    const std::int16_t* y = hi + b * tokens * n;
    for (std::size_t t = 0; t < tokens; t += 2) {
      const std::int16_t* y0 = y + t * n;
      const std::int16_t* y1 = t + 1 < tokens ? y0 + n : zero.data();
      const std::int16_t* y2 = t + 2 < tokens ? y0 + 2 * n : zero.data();
      for (std::size_t c = 0, blk = 0; c < n; c += 32, ++blk) {
        const __mmask32 m = n - c >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << (n - c)) - 1);
        const __m512i a = _mm512_maskz_loadu_epi16(m, y0 + c), bb = _mm512_maskz_loadu_epi16(m, y1 + c), cc = _mm512_maskz_loadu_epi16(m, y2 + c);
        const __m512i plo = _mm512_unpacklo_epi16(a, bb), phi = _mm512_unpackhi_epi16(a, bb);
        const __m512i qlo = _mm512_unpacklo_epi16(bb, cc), qhi = _mm512_unpackhi_epi16(bb, cc);
        std::int32_t* yy = byy.data() + 32 * blk;
        std::int32_t* xy = bxy.data() + 32 * blk;
        _mm512_storeu_si512(yy, _mm512_add_epi32(_mm512_loadu_si512(yy), _mm512_madd_epi16(plo, plo)));
        _mm512_storeu_si512(yy + 16, _mm512_add_epi32(_mm512_loadu_si512(yy + 16), _mm512_madd_epi16(phi, phi)));
        _mm512_storeu_si512(xy, _mm512_add_epi32(_mm512_loadu_si512(xy), _mm512_madd_epi16(plo, qlo)));
        _mm512_storeu_si512(xy + 16, _mm512_add_epi32(_mm512_loadu_si512(xy + 16), _mm512_madd_epi16(phi, qhi)));
      }
      if (++pairs == (std::size_t{1} << 13)) flush(), pairs = 0;
    }
    for (std::size_t c = 0; c < n; ++c) sxx[c] -= static_cast<std::int64_t>(y[(tokens - 1) * n + c]) * y[(tokens - 1) * n + c];
  }
  flush();
  std::vector<std::int16_t> k16(n, 0);
  for (std::size_t c = 0; c < n; ++c) k16[c] = choose_k(sxx[c] + syy[c], sxy[c], syy[c]);
  // The residuals and each column's largest |residual|.
  const __m512i four = _mm512_set1_epi16(4);
  for (std::size_t b = 0; b < batch; ++b)
    for (std::size_t t = 0; t < tokens; ++t) {
      const std::size_t row = (b * tokens + t) * n;
      for (std::size_t c = 0; c < n; c += 32) {
        const __mmask32 m = n - c >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << (n - c)) - 1);
        __m512i v = _mm512_maskz_loadu_epi16(m, hi + row + c);
        if (t > 0) {
          const __m512i p = _mm512_maskz_loadu_epi16(m, hi + row - n + c), kk = _mm512_maskz_loadu_epi16(m, k16.data() + c);
          v = _mm512_sub_epi16(v, _mm512_srai_epi16(_mm512_add_epi16(_mm512_mullo_epi16(kk, p), four), 3));
        }
        _mm512_mask_storeu_epi16(res + row + c, m, v);
        _mm512_mask_storeu_epi16(amx.data() + c, m, _mm512_max_epu16(_mm512_maskz_loadu_epi16(m, amx.data() + c), _mm512_abs_epi16(v)));
      }
    }
  // A column with a residual outside +-max_residual is coded as it is (k = 0).
  std::vector<std::int8_t> k(n, 0);
  for (std::size_t c = 0; c < n; ++c) {
    if (amx[c] > max_residual) code_as_is(c, n, R, hi, res, k16[c], amx[c]);
    k[c] = static_cast<std::int8_t>(k16[c]);
  }
  return k;
}

bool cpu_has_avx512() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
  return ok;
}

}  // namespace

// Two clones (ifunc): the passes below vectorise twice as wide with AVX2 as with the SSE2 baseline.
// With AVX-512 BW, predict_avx512 instead.
__attribute__((target_clones("avx2", "default"))) std::vector<std::int8_t> vq_predict(const std::int16_t* hi, std::int16_t* res, std::size_t n,
                                                                                      std::size_t batch, std::size_t tokens, int max_residual,
                                                                                      std::vector<int>* res_amax) {
  std::vector<std::int8_t> k(n, 0);
  const std::size_t R = batch * tokens;
  // Largest |residual| per coefficient (|hi| <= 255 and |k| <= 8: |residual| <= 511).
  std::vector<std::uint16_t> amx(n, 0);
  auto give_amax = [&] {
    if (res_amax) res_amax->assign(amx.begin(), amx.end());
  };
  if (R < 2) {
    std::copy(hi, hi + R * n, res);
    for (std::size_t i = 0; i < R * n; ++i) amx[i % n] = std::max<std::uint16_t>(amx[i % n], static_cast<std::uint16_t>(std::abs(hi[i])));
    give_amax();
    return k;
  }
  if (cpu_has_avx512() && max_residual <= 511) {
    k = predict_avx512(hi, res, n, batch, tokens, max_residual, amx);
    give_amax();
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
  for (std::size_t c = 0; c < n; ++c) k16[c] = choose_k(sxx[c], sxy[c], syy[c]);
  // The residuals; a coefficient with one outside +-max_residual falls back to k = 0 (its hi parts).
  std::vector<std::uint8_t> out(n, 0);
  for (std::size_t b = 0; b < batch; ++b)
    for (std::size_t t = 0; t < tokens; ++t) {
      const std::size_t row = (b * tokens + t) * n;
      const std::int16_t* cur = hi + row;
      std::int16_t* r = res + row;
      if (t == 0) {
        std::copy(cur, cur + n, r);
        for (std::size_t c = 0; c < n; ++c) amx[c] = std::max(amx[c], static_cast<std::uint16_t>(std::abs(cur[c])));
        continue;
      }
      const std::int16_t* prev = cur - n;
      for (std::size_t c = 0; c < n; ++c) {
        const int v = residual(k16[c], prev[c], cur[c]);
        out[c] |= static_cast<std::uint8_t>(v > max_residual || v < -max_residual);
        r[c] = static_cast<std::int16_t>(v);
        amx[c] = std::max(amx[c], static_cast<std::uint16_t>(std::abs(v)));
      }
    }
  for (std::size_t c = 0; c < n; ++c) {
    if (out[c]) code_as_is(c, n, R, hi, res, k16[c], amx[c]);
    k[c] = static_cast<std::int8_t>(k16[c]);
  }
  give_amax();
  return k;
}

std::vector<std::int32_t> vq_find_copies(const std::int16_t* hi, std::size_t n, std::size_t rows) {
  std::vector<std::int32_t> from(rows, -1);
  if (n < kVqMinCopyWidth) return from;
  // XXH3 of the row's bytes (std::hash of a string_view, a byte-at-a-time hash, was ~8 % of an
  // encode); equal hashes are compared in full by the map.
  struct RowHash {
    std::size_t operator()(std::string_view k) const { return static_cast<std::size_t>(XXH3_64bits(k.data(), k.size())); }
  };
  std::unordered_map<std::string_view, std::int32_t, RowHash> last;
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

bool vq_unpredict_row(std::int16_t* out, const std::int16_t* res, const std::int16_t* prev, const std::int16_t* k, std::size_t n, int max_hi,
                      int simd) {
  if (simd >= 2) return unpredict_row_avx512(out, res, prev, k, n, max_hi);
  if (simd == 1) return unpredict_row_avx2(out, res, prev, k, n, max_hi);
  return unpredict_row_scalar(out, res, prev, k, 0, n, max_hi);
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
      // Token 0 is predicted as 0: the residual is the hi part.
      if (!vq_unpredict_row(cur, cur, t == 0 ? nullptr : cur - n, k16.data(), n, max_hi, avx2 ? 1 : 0)) return false;
    }
  }
  return true;
}

}  // namespace vq::vq_codec_detail
