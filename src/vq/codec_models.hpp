// Private to vq/codec.hpp's coder (codec_models.cpp, codec_encode.cpp, codec_decode.cpp): the
// parametric models both directions share. A coefficient's model is (amax, param, scale): a
// discretised Gaussian or Laplace of spread param over -amax..amax at 2^scale (vq_table), built
// once per process and kept (cached_model); a call gathers its distinct models in CallTables, and a
// side's header (SideModel) names one per coded coefficient. The encoder and the decoder are
// otherwise independent. The format and its story: vq/codec.hpp, docs/format.md.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "veloxquant/entropy/frequency_table.hpp"
#include "veloxquant/entropy/rans.hpp"
#include "veloxquant/vq/codec.hpp"
#include "../entropy/byte_io.hpp"
#include "../entropy/rans_kernels.hpp"
#include "codec_kernels.hpp"

namespace vq::vq_codec_detail {

using entropy_detail::ByteReader;
using entropy_detail::put_varint;

inline std::size_t sz(std::int64_t v) { return static_cast<std::size_t>(v); }

// The table of a shift's low parts: 2^shift equally likely symbols.
FrequencyTable low_table(int shift);

// Called when some hi part is outside +-kVqMaxCode: finds the first for the message and throws.
[[noreturn]] void throw_hi_out_of_range(const VqSideCodes& s, const std::int16_t* hi, std::size_t count, const char* name);

// The region kernels of a call (codec_kernels.hpp): null for the scalar reference.
struct RegionKernels {
  decltype(&vq_codec_detail::decode_region_avx2) decode = nullptr;
  decltype(&vq_codec_detail::encode_region_avx2) encode = nullptr;
  bool fast() const { return decode != nullptr; }
};

RegionKernels region_kernels(RansKernel k);

inline bool has_shifts(const VqSideCodes& s) {
  return std::any_of(s.shift.begin(), s.shift.end(), [](std::uint8_t v) { return v != 0; });
}

// Per coefficient the largest |v| over rows [0, R) of v [R, n] ; loops the compiler vectorises.
void column_amax(const std::int16_t* v, std::size_t n, std::size_t R, std::vector<int>& amax);

// One pass over a side's codes [R, n]: the hi parts (into hi, when the side has shifts; hi is null
// otherwise) and each coefficient's amax = max |hi|; throws when one is outside +-kVqMaxCode.
// simd: codec_kernels.hpp's AVX-512 pass, else the same in plain C++.
void side_hi(const VqSideCodes& s, std::size_t R, bool simd, std::int16_t* hi, std::vector<int>& amax, const char* name);

// The best parameter and table precision of every coefficient of a side from its hi parts [R, n]
// and amax: one row-major pass for the histograms (all coefficients' in one array, coefficient
// c's centred at hoff[c]; simd: codec_kernels.hpp's AVX-512 counting).
// scale: each coefficient's table precision (vq_coef_scale_bits, version 4).
void side_models(const std::int16_t* hi, std::size_t n, std::size_t R, bool simd, const std::vector<int>& amax, std::vector<std::uint8_t>& param,
                 std::vector<int>& scale);

// Reserved once and never freed, like the cache; the kernel backs its pages as entries are written.
std::uint32_t* model_arena();

struct Model {
  FrequencyTable table;
  std::vector<std::uint32_t> packed;  // the entries while the model is being built, or of a model a call owns
  std::int32_t arena_off = -1;        // a cached model's entries: model_arena() from here on
  const std::uint32_t* entries() const { return arena_off >= 0 ? model_arena() + arena_off : packed.data(); }
};

const Model* cached_model(int a, std::uint8_t param, int scale, std::unique_ptr<Model>& own);

// The distinct (amax, param, scale) models of one encode or decode call.
struct CallTables {
  std::vector<const FrequencyTable*> tables;
  std::vector<const Model*> models;
  std::vector<int> amax;
  std::vector<std::unique_ptr<Model>> own;
  int get(int a, std::uint8_t param, int scale) {
    const std::uint32_t key = static_cast<std::uint32_t>(scale) << 16 | static_cast<std::uint32_t>(a) << 8 | param;
    if (tables.size() * 2 >= keys_.size()) grow();
    std::size_t i = slot(key);
    while (keys_[i] != key && keys_[i] != kFree) i = (i + 1) & (keys_.size() - 1);
    if (keys_[i] == key) return vals_[i];
    keys_[i] = key;
    vals_[i] = static_cast<int>(tables.size());
    std::unique_ptr<Model> mine;
    const Model* md = cached_model(a, param, scale, mine);
    if (mine) own.push_back(std::move(mine));
    models.push_back(md);
    tables.push_back(&md->table);
    amax.push_back(a);
    return vals_[i];
  }

 private:
  // Key -> table index, open addressing (a call looks up one key per coefficient and side, ~2,000;
  // a node-based map made those lookups most of the decoder's SideModel::derive).
  static constexpr std::uint32_t kFree = ~0u;  // no key: scale < 2^15
  std::vector<std::uint32_t> keys_;
  std::vector<int> vals_;
  std::size_t slot(std::uint32_t key) const { return (key * 0x9E3779B1u) >> 7 & (keys_.size() - 1); }
  void grow() {
    std::vector<std::uint32_t> old_keys(std::max<std::size_t>(256, keys_.size() * 2), kFree);
    std::vector<int> old_vals(old_keys.size());
    old_keys.swap(keys_);
    old_vals.swap(vals_);
    for (std::size_t j = 0; j < old_keys.size(); ++j) {
      if (old_keys[j] == kFree) continue;
      std::size_t i = slot(old_keys[j]);
      while (keys_[i] != kFree) i = (i + 1) & (keys_.size() - 1);
      keys_[i] = old_keys[j];
      vals_[i] = old_vals[j];
    }
  }
};

// What the header says of a side: per coefficient amax and param.
struct SideModel {
  std::vector<int> amax;
  std::vector<std::uint8_t> param;
  // Per coefficient its table's precision: vq_coef_scale_bits (version 4), the side's
  // vq_side_scale_bits (version 3), 12 (versions 1 and 2).
  std::vector<int> scale;
  // Version 5: per coefficient its predictor across tokens (codec_predict.hpp); empty when every
  // k_c = 0 (versions 1-4, or no coefficient predicted).
  std::vector<std::int8_t> pred;
  // Version 5: per row -1 or the earlier row it copies (not coded); empty when none. coded_rows:
  // the rows the region holds (those not copied).
  std::vector<std::int32_t> copy_from;
  std::size_t coded_rows = 0;
  // Derived: the coded columns (amax > 0) in order, their call table, amax and scale; the split columns.
  std::vector<int> cols, table, col_amax, col_scale, low_cols;
  void derive(const VqSideCodes& s, CallTables& t) {
    for (int c = 0; c < s.n; ++c) {
      if (amax[sz(c)] > 0) {
        cols.push_back(c);
        table.push_back(t.get(amax[sz(c)], param[sz(c)], scale[sz(c)]));
        col_amax.push_back(amax[sz(c)]);
        col_scale.push_back(scale[sz(c)]);
      }
      if (!s.shift.empty() && s.shift[sz(c)] > 0) low_cols.push_back(c);
    }
  }
  std::size_t m() const { return cols.size(); }
};

// Per-column offsets for j = 0 .. m + 63 (codec_kernels.hpp), from each column's value.
inline std::vector<std::int32_t> wrapped(const std::vector<std::int32_t>& per_col) {
  std::vector<std::int32_t> w(per_col.size() + 64);
  for (std::size_t j = 0; j < w.size(); ++j) w[j] = per_col[j % per_col.size()];
  return w;
}

// RegionTables::uniform_scale of a region's columns' precisions (m >= 1).
inline int uniform_scale(const std::vector<int>& col_scale) {
  return std::all_of(col_scale.begin(), col_scale.end(), [&](int v) { return v == col_scale[0]; }) ? col_scale[0] : 0;
}

inline constexpr std::uint32_t kL = rans_detail::kL;
inline constexpr std::uint32_t kField = (1u << 12) - 1;  // the packed decoder entry's freq and bias fields

}  // namespace vq::vq_codec_detail
