// `veloxquant._core`, the extension inside the `veloxquant` Python package (python/veloxquant):
// the reference's Python API (VeloxQuant-MLX's veloxquant_mlx.cache) over the C++ caches, with
// numpy arrays in place of mlx arrays. The package re-exports everything public here under its
// flat names (veloxquant.CacheGenKVCache, ...) and adds, in Python, the reference's module paths
// (veloxquant.cache.base, veloxquant.quantizers.cachegen, ...) and mlx_lm's cache protocol; the
// underscore functions here are the C++ numerics and copies those modules are built on.
//
// Contracts a reader must know first:
// - Inputs: numpy arrays [B, H, S, D] of float16 or float32 in native byte order. Anything that is
//   not C-contiguous and aligned (a transposed view, a slice with steps, a broadcast) is copied once
//   before the cache sees it, so it is never misread. Other dtypes (float64, ints, bfloat16) and other
//   ranks raise ValueError: the reference takes f16/f32, and a silent float64 -> float32 cast would
//   hide a caller's mistake.
// - Outputs: update_and_fetch returns fresh C-contiguous copies by default (copy=True), like the
//   immutable mlx arrays the reference returns. copy=False returns read-only views of the cache's own
//   buffer (no copy, O(1)); they keep the buffer alive, but their contents are only guaranteed until
//   the next update_and_fetch/trim/state assignment on that cache (group_aligned rewrites residual
//   rows with their reconstruction when a group closes). `state` always copies.
// - Errors: vq::InvalidArgument -> ValueError, any other vq::Error -> RuntimeError, with the C++
//   message.
// - The GIL is held during calls: a cache is not thread-safe, and a decode step is microseconds.
#include <bit>
#include <limits>
#include <string_view>
#include <chrono>
#include <cstring>
#include <memory>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "veloxquant/cache/attention.hpp"
#include "veloxquant/cache/builder.hpp"
#include "veloxquant/cache/cachegen_cache.hpp"
#include "veloxquant/format/vqkv.hpp"
#include "veloxquant/model/checkpoint.hpp"
#include "veloxquant/methods/method_table.hpp"
#include "veloxquant/model/vq_layer_models.hpp"
#include "veloxquant/model/transformer.hpp"
#include "veloxquant/cache/config.hpp"
#include "veloxquant/cache/kv_cache.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/core/tensor.hpp"
#include "veloxquant/entropy/entropy_estimate.hpp"
#include "veloxquant/quant/group_quant.hpp"
#include "veloxquant/quant/layer_schedule.hpp"
#include "veloxquant/transform/token_delta.hpp"

namespace py = pybind11;
using namespace pybind11::literals;

namespace {

constexpr bool kLittleEndianHost = (std::endian::native == std::endian::little);

std::string shape_of(const py::array& a) {
  std::string s = "(";
  for (py::ssize_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + (a.ndim() == 1 ? ",)" : ")");
}

// The numpy array `obj` as a vq::Tensor viewing its memory (copied first when not C-contiguous and
// aligned). `keep` holds the array the tensor points into; it must outlive the tensor's use.
vq::Tensor to_tensor(const py::handle obj, const char* what, py::array& keep) {
  py::array a = py::array::ensure(obj);  // an ndarray as is, or an array-like converted
  if (!a) throw vq::InvalidArgument(std::string(what) + " must be a numpy array [B, H, S, D] of float16 or float32");
  if (a.ndim() != 4)
    throw vq::InvalidArgument(std::string(what) + " must be a 4-D array [B, H, S, D], got shape " + shape_of(a));
  const py::dtype dt = a.dtype();
  const char bo = dt.byteorder();
  const bool native = bo == '=' || bo == '|' || (bo == '<') == kLittleEndianHost;
  vq::DType dtype;
  if (dt.kind() == 'f' && dt.itemsize() == 4 && native) {
    dtype = vq::DType::F32;
  } else if (dt.kind() == 'f' && dt.itemsize() == 2 && native) {
    dtype = vq::DType::F16;
  } else {
    throw vq::InvalidArgument(std::string(what) + " must be a float16 or float32 array (native byte order), got " +
                              py::str(static_cast<py::object>(dt)).cast<std::string>() +
                              "; convert it with .astype(np.float32) or .astype(np.float16)");
  }
  // The element count before anything is copied: a broadcast (zero strides) may claim far more than
  // memory holds, and its copy would fail deep inside numpy.
  std::int64_t numel = 1;
  for (py::ssize_t i = 0; i < 4; ++i) {
    const auto d = static_cast<std::int64_t>(a.shape(i));
    if (d == 0) {
      numel = 0;
      break;
    }
    if (numel > vq::kMaxElements / d) numel = vq::kMaxElements + 1;
    else numel *= d;
  }
  if (numel > vq::kMaxElements)
    throw vq::InvalidArgument(std::string(what) + " of shape " + shape_of(a) + " holds more than 2^40 elements");
  constexpr int kNeed = py::detail::npy_api::NPY_ARRAY_C_CONTIGUOUS_ | py::detail::npy_api::NPY_ARRAY_ALIGNED_;
  if ((a.flags() & kNeed) != kNeed) {
    // ensure() clears numpy's error when the copy fails (no memory for it): say what was asked.
    py::array copy = py::array::ensure(a, kNeed);  // a C-contiguous aligned copy
    if (!copy)
      throw vq::InvalidArgument(std::string(what) + " of shape " + shape_of(a) + " is not contiguous and could not be copied (" +
                                std::to_string(numel * static_cast<std::int64_t>(dt.itemsize())) + " bytes; a broadcast? pass a real array)");
    a = copy;
  }
  const vq::Shape4 shape{a.shape(0), a.shape(1), a.shape(2), a.shape(3)};
  keep = a;
  // The caches only read their input during the call (they copy what they keep), so no owner.
  return vq::Tensor::wrap(const_cast<void*>(a.data()), shape, dtype);
}

// numpy's type numbers (NPY_FLOAT, NPY_HALF), part of its stable C API.
constexpr int kNpyFloat = 11;
constexpr int kNpyHalf = 23;

py::dtype np_dtype(vq::DType dtype) {
  switch (dtype) {
    case vq::DType::F32: return py::dtype(kNpyFloat);
    case vq::DType::F16: return py::dtype(kNpyHalf);
    case vq::DType::BF16: break;
  }
  throw vq::Error("bfloat16 tensors have no numpy dtype");
}

// A numpy array of `t`: with copy, a new C-contiguous array (one memcpy per (b, h) block: rows of
// a slice are adjacent in the cache's buffer); without, a read-only view over `t`'s memory that
// keeps its storage alive.
py::array to_numpy(const vq::Tensor& t, bool copy) {
  const py::dtype dt = np_dtype(t.dtype());
  const auto& sh = t.shape();
  std::vector<py::ssize_t> shape(sh.begin(), sh.end());
  const auto itemsize = static_cast<std::size_t>(vq::dtype_size(t.dtype()));
  if (copy || t.empty()) {
    py::array out(dt, shape);
    if (t.empty()) return out;
    auto* dst = static_cast<std::byte*>(out.mutable_data());
    const std::size_t row_bytes = static_cast<std::size_t>(sh[3]) * itemsize;
    const bool rows_adjacent = t.strides()[2] == sh[3];
    for (std::int64_t b = 0; b < sh[0]; ++b)
      for (std::int64_t h = 0; h < sh[1]; ++h) {
        if (rows_adjacent) {
          std::memcpy(dst, t.row(b, h, 0), row_bytes * static_cast<std::size_t>(sh[2]));
          dst += row_bytes * static_cast<std::size_t>(sh[2]);
        } else {
          for (std::int64_t s = 0; s < sh[2]; ++s, dst += row_bytes) std::memcpy(dst, t.row(b, h, s), row_bytes);
        }
      }
    return out;
  }
  auto* held = new vq::Tensor(t);
  py::capsule owner(held, [](void* p) { delete static_cast<vq::Tensor*>(p); });
  std::vector<py::ssize_t> strides;
  for (auto st : held->strides()) strides.push_back(static_cast<py::ssize_t>(st * static_cast<std::int64_t>(itemsize)));
  py::array out(dt, shape, strides, held->row(0, 0, 0), owner);
  py::detail::array_proxy(out.ptr())->flags &= ~py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
  return out;
}

py::tuple update_and_fetch(vq::KVCache& cache, const py::handle keys, const py::handle values, bool copy) {
  py::array keep_k, keep_v;
  const vq::Tensor k = to_tensor(keys, "keys", keep_k);
  const vq::Tensor v = to_tensor(values, "values", keep_v);
  auto [ok, ov] = cache.update_and_fetch(k, v);
  return py::make_tuple(to_numpy(ok, copy), to_numpy(ov, copy));
}

py::array attend(const vq::KVCache& cache, const py::handle queries, double scale) {
  py::array keep;
  const vq::Tensor q = to_tensor(queries, "queries", keep);
  // attend computes in float32: a scale that float32 cannot hold (1e300 -> inf) is refused as non-finite.
  return to_numpy(cache.attend(q, static_cast<float>(scale)), true);
}

py::tuple get_state(const vq::KVCache& cache) {
  const vq::KVState s = cache.state();
  return py::make_tuple(to_numpy(s.keys, true), to_numpy(s.values, true));
}

void set_state(vq::KVCache& cache, const py::object& state) {
  if (!py::isinstance<py::sequence>(state) || py::len(state) != 2)
    throw vq::InvalidArgument("state must be a (keys, values) pair of arrays");
  const auto seq = state.cast<py::sequence>();
  py::array keep_k, keep_v;
  vq::KVState s{to_tensor(seq[0], "state keys", keep_k), to_tensor(seq[1], "state values", keep_v)};
  cache.from_state(s);  // copies
}

vq::KVCacheConfig make_config(int bits, int group_size, bool use_delta, bool per_channel, int layer_groups,
                              std::optional<int> resolved_bits, const std::string& flush) {
  vq::KVCacheConfig c;
  c.cachegen_bits = bits;
  c.cachegen_group_size = group_size;
  c.cachegen_use_delta = use_delta;
  c.cachegen_per_channel = per_channel;
  c.cachegen_layer_groups = layer_groups;
  c.cachegen_resolved_bits = resolved_bits;
  c.cachegen_flush = vq::flush_mode_from_name(flush);
  c.validate();
  return c;
}

std::string config_repr(const vq::KVCacheConfig& c) {
  auto b = [](bool x) { return x ? "True" : "False"; };
  return "KVCacheConfig(cachegen_bits=" + std::to_string(c.cachegen_bits) +
         ", cachegen_group_size=" + std::to_string(c.cachegen_group_size) + ", cachegen_use_delta=" + b(c.cachegen_use_delta) +
         ", cachegen_per_channel=" + b(c.cachegen_per_channel) + ", cachegen_layer_groups=" + std::to_string(c.cachegen_layer_groups) +
         ", cachegen_resolved_bits=" + (c.cachegen_resolved_bits ? std::to_string(*c.cachegen_resolved_bits) : std::string("None")) +
         ", cachegen_flush='" + std::string(vq::flush_mode_name(c.cachegen_flush)) + "')";
}

// A model for the builder: a sequence of per-layer head dims (int, or None for a layer without
// attention), or an object whose `layer_head_dims` attribute is one.
vq::ModelDescription to_model(const py::object& model) {
  py::object dims = py::hasattr(model, "layer_head_dims") ? model.attr("layer_head_dims") : model;
  const char* what =
      "KVCacheBuilder.for_model: model must be a list of per-layer head dims (int, or None for a layer without attention) "
      "or an object with attribute layer_head_dims";
  if (!py::isinstance<py::iterable>(dims) || py::isinstance<py::str>(dims)) throw vq::InvalidArgument(what);
  vq::ModelDescription m;
  for (const py::handle d : dims) {
    if (d.is_none()) {
      m.layer_head_dims.emplace_back(std::nullopt);
    } else if (py::isinstance<py::int_>(d) && !py::isinstance<py::bool_>(d)) {
      m.layer_head_dims.emplace_back(d.cast<int>());
    } else if (py::hasattr(d, "__index__") && !py::isinstance<py::bool_>(d)) {  // numpy integers
      m.layer_head_dims.emplace_back(py::int_(py::reinterpret_borrow<py::object>(d)).cast<int>());
    } else {
      throw vq::InvalidArgument(std::string(what) + "; got an element " + py::repr(d).cast<std::string>());
    }
  }
  return m;
}

// ---- the reference's numerics (veloxquant.quantizers.cachegen / _quant_utils) on numpy arrays ----
// The Python wrappers check dtypes, ranks and values and reshape; these take exactly the dtype and
// layout named (C-contiguous), so nothing is ever converted silently here.

template <class T>
using CArray = py::array_t<T, py::array::c_style>;

int checked_int(std::int64_t v, const char* what) {
  if (v < 0 || v > std::numeric_limits<int>::max())
    throw vq::InvalidArgument(std::string(what) + " is out of range: " + std::to_string(v));
  return static_cast<int>(v);
}

void require_2d(const py::array& a, const char* what) {
  if (a.ndim() != 2) throw vq::InvalidArgument(std::string(what) + " must be a 2-D array [N, D], got shape " + shape_of(a));
}

// x float32 [N, D] -> (codes uint8 [N, D], scale float32 [G, D], minimum float32 [G, D]).
py::tuple quantize_codes_py(const CArray<float>& x, int bits, int group_size) {
  require_2d(x, "x");
  const int n = checked_int(x.shape(0), "the token count"), d = checked_int(x.shape(1), "the channel count");
  if (d < 1) throw vq::InvalidArgument("x must have at least one channel (D >= 1), got shape " + shape_of(x));
  const vq::GroupQuantized q =
      vq::quantize_to_codes(std::span<const float>(x.data(), static_cast<std::size_t>(n) * static_cast<std::size_t>(d)), n, d, bits, group_size);
  const py::ssize_t g = q.n_groups();
  CArray<std::uint8_t> codes({static_cast<py::ssize_t>(n), static_cast<py::ssize_t>(d)});
  CArray<float> scale({g, static_cast<py::ssize_t>(d)}), minv({g, static_cast<py::ssize_t>(d)});
  if (!q.codes.empty()) std::memcpy(codes.mutable_data(), q.codes.data(), q.codes.size());
  if (!q.scale.empty()) std::memcpy(scale.mutable_data(), q.scale.data(), q.scale.size() * sizeof(float));
  if (!q.minv.empty()) std::memcpy(minv.mutable_data(), q.minv.data(), q.minv.size() * sizeof(float));
  return py::make_tuple(codes, scale, minv);
}

// codes uint8 [N, D], scale and minimum float32 [ceil(N / group_size), D] -> float32 [N, D].
CArray<float> dequant_codes_py(const CArray<std::uint8_t>& codes, const CArray<float>& scale, const CArray<float>& minv, int group_size) {
  require_2d(codes, "codes");
  require_2d(scale, "scale");
  require_2d(minv, "zero");
  if (group_size < 1) throw vq::InvalidArgument("group_size must be >= 1, got " + std::to_string(group_size));
  vq::GroupQuantized q;
  q.n_tokens = checked_int(codes.shape(0), "the token count");
  q.dim = checked_int(codes.shape(1), "the channel count");
  q.bits = 8;  // dequantization does not depend on it
  q.group_size = group_size;
  const py::ssize_t g = q.n_groups();
  if (scale.shape(0) != g || scale.shape(1) != q.dim || minv.shape(0) != g || minv.shape(1) != q.dim)
    throw vq::InvalidArgument("scale and zero must be [" + std::to_string(g) + ", " + std::to_string(q.dim) + "] for " +
                              std::to_string(q.n_tokens) + " tokens in groups of " + std::to_string(group_size) + ", got " +
                              shape_of(scale) + " and " + shape_of(minv));
  q.codes.assign(codes.data(), codes.data() + codes.size());
  q.scale.assign(scale.data(), scale.data() + scale.size());
  q.minv.assign(minv.data(), minv.data() + minv.size());
  CArray<float> out({codes.shape(0), codes.shape(1)});
  vq::dequant_codes(q, std::span<float>(out.mutable_data(), static_cast<std::size_t>(out.size())));
  return out;
}

// codes uint8 [N, D] -> int16 [N, D]: row 0 kept, row i = codes[i] - codes[i - 1].
CArray<std::int16_t> token_delta_py(const CArray<std::uint8_t>& codes) {
  require_2d(codes, "codes");
  const int n = checked_int(codes.shape(0), "the token count"), d = checked_int(codes.shape(1), "the channel count");
  CArray<std::int16_t> out({codes.shape(0), codes.shape(1)});
  if (n == 0 || d == 0) return out;
  const auto delta = vq::token_delta(std::span<const std::uint8_t>(codes.data(), static_cast<std::size_t>(codes.size())), n, d);
  std::memcpy(out.mutable_data(), delta.data(), delta.size() * sizeof(std::int16_t));
  return out;
}

double symbol_entropy_bits_py(const CArray<std::int16_t>& symbols) {
  return vq::symbol_entropy_bits(std::span<const std::int16_t>(symbols.data(), static_cast<std::size_t>(symbols.size())));
}

// symbols int16 [N, D] (token deltas or codes) -> the estimate of entropy_estimate.hpp.
std::uint64_t entropy_coded_bytes_py(const CArray<std::int16_t>& symbols, int bits, std::int64_t n_groups, bool per_channel) {
  require_2d(symbols, "symbols");
  const int n = checked_int(symbols.shape(0), "the token count"), d = checked_int(symbols.shape(1), "the channel count");
  if (d < 1) throw vq::InvalidArgument("symbols must have at least one channel");
  return vq::entropy_coded_bytes(std::span<const std::int16_t>(symbols.data(), static_cast<std::size_t>(symbols.size())), n, d, bits,
                                 checked_int(n_groups, "n_groups"), per_channel);
}

// ---- configurations given as any object (the reference reads its config with getattr) ----

int int_field(const py::object& o, const char* name, int fallback) {
  const py::object v = py::getattr(o, name, py::int_(fallback));
  if (py::isinstance<py::bool_>(v) || !py::hasattr(v, "__index__"))
    throw vq::InvalidArgument(std::string("config.") + name + " must be an int, got " + py::repr(v).cast<std::string>());
  const auto x = py::int_(v).cast<long long>();
  if (x < std::numeric_limits<int>::min() || x > std::numeric_limits<int>::max())
    throw vq::InvalidArgument(std::string("config.") + name + " is out of range: " + std::to_string(x));
  return static_cast<int>(x);
}

// A KVCacheConfig from a KVCacheConfig, or from any object with the reference's cachegen_* fields
// (veloxquant.cache.base.KVCacheConfig, a dataclass of the reference's shape), missing ones taking
// the reference's defaults, as the reference's CacheGenKVCache reads them. Validated.
vq::KVCacheConfig config_from_object(const py::object& o) {
  if (py::isinstance<vq::KVCacheConfig>(o)) {
    vq::KVCacheConfig c = o.cast<vq::KVCacheConfig>();
    c.validate();
    return c;
  }
  vq::KVCacheConfig c;
  c.cachegen_bits = int_field(o, "cachegen_bits", 4);
  c.cachegen_group_size = int_field(o, "cachegen_group_size", 32);
  c.cachegen_use_delta = py::bool_(py::getattr(o, "cachegen_use_delta", py::bool_(true))).cast<bool>();
  c.cachegen_per_channel = py::bool_(py::getattr(o, "cachegen_per_channel", py::bool_(true))).cast<bool>();
  c.cachegen_layer_groups = int_field(o, "cachegen_layer_groups", 3);
  if (!py::getattr(o, "cachegen_resolved_bits", py::none()).is_none()) c.cachegen_resolved_bits = int_field(o, "cachegen_resolved_bits", 0);
  const py::object flush = py::getattr(o, "cachegen_flush", py::str("group_aligned"));
  if (!py::isinstance<py::str>(flush))
    throw vq::InvalidArgument("config.cachegen_flush must be 'group_aligned' or 'per_call', got " + py::repr(flush).cast<std::string>());
  c.cachegen_flush = vq::flush_mode_from_name(flush.cast<std::string>());
  c.validate();
  return c;
}

// ---- copies: exact, for copy.deepcopy, the state snapshot and pickle ----

std::shared_ptr<vq::KVCache> clone_cache(const vq::KVCache& c) {
  if (const auto* cg = dynamic_cast<const vq::CacheGenKVCache*>(&c)) {
    auto out = std::make_shared<vq::CacheGenKVCache>(cg->config());
    out->from_full_state(cg->full_state());  // deep copies of the codes, scales, minima and residual
    return out;
  }
  if (c.kind() != "KVCache")
    throw vq::InvalidArgument("a " + c.kind() + " cannot be copied here (only KVCache and CacheGenKVCache can); save it with save_prompt_cache");
  auto out = std::make_shared<vq::KVCache>();
  if (c.offset() > 0) out->from_state(c.state());  // from_state copies
  return out;
}

py::bytes serialize_caches(const std::vector<std::shared_ptr<vq::KVCache>>& caches) {
  const std::vector<std::uint8_t> bytes = vq::serialize_prompt_cache(caches);
  return py::bytes(reinterpret_cast<const char*>(bytes.data()), bytes.size());
}

py::list caches_to_python(std::vector<std::shared_ptr<vq::KVCache>>& caches) {
  py::list out;
  for (auto& c : caches) {
    if (auto cg = std::dynamic_pointer_cast<vq::CacheGenKVCache>(c))
      out.append(py::cast(cg));
    else
      out.append(py::cast(c));
  }
  return out;
}

py::list deserialize_caches(const py::bytes& data) {
  const std::string_view view = data;  // no copy
  vq::PromptCache pc =
      vq::deserialize_prompt_cache(std::span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(view.data()), view.size()));
  return caches_to_python(pc.caches);
}

struct KVCacheBuilderTag {};

// Seconds per call of n C++ update_and_fetch calls on `cache` with the same chunk, as the binding's
// baseline (bench_binding.py). The chunk is converted once, outside the timed loop.
double bench_cpp_update(vq::KVCache& cache, const py::handle keys, const py::handle values, int n) {
  if (n < 1) throw vq::InvalidArgument("n must be >= 1");
  py::array keep_k, keep_v;
  const vq::Tensor k = to_tensor(keys, "keys", keep_k);
  const vq::Tensor v = to_tensor(values, "values", keep_v);
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < n; ++i) {
    auto kv = cache.update_and_fetch(k, v);
    asm volatile("" : : "r"(&kv) : "memory");  // keep the call and its result
  }
  const auto t1 = std::chrono::steady_clock::now();
  return std::chrono::duration<double>(t1 - t0).count() / n;
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() =
      "veloxquant._core: the compiled core of the veloxquant package (CacheGen-style KV cache compression, the C++ "
      "library), with the API of VeloxQuant-MLX's veloxquant_mlx.cache over numpy arrays [B, H, S, D] of float16 or "
      "float32. Import the package: `import veloxquant`.";
  m.attr("__version__") = VQ_VERSION;  // the CMake project's version (python/CMakeLists.txt)

  // Most derived first: pybind11 tries translators in reverse order of registration.
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const vq::InvalidArgument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const vq::IoError& e) {
      PyErr_SetString(PyExc_OSError, e.what());
    } catch (const vq::Error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });

  py::class_<vq::KVCacheConfig>(m, "KVCacheConfig",
                                "The cachegen_* fields of the reference's KVCacheConfig, with its defaults, plus cachegen_flush "
                                "('group_aligned', the default, or 'per_call', the reference exactly). Validated on construction "
                                "and when a cache is built.")
      .def(py::init(&make_config), py::kw_only(), "cachegen_bits"_a = 4, "cachegen_group_size"_a = 32, "cachegen_use_delta"_a = true,
           "cachegen_per_channel"_a = true, "cachegen_layer_groups"_a = 3, "cachegen_resolved_bits"_a = py::none(),
           "cachegen_flush"_a = "group_aligned")
      .def_readwrite("cachegen_bits", &vq::KVCacheConfig::cachegen_bits)
      .def_readwrite("cachegen_group_size", &vq::KVCacheConfig::cachegen_group_size)
      .def_readwrite("cachegen_use_delta", &vq::KVCacheConfig::cachegen_use_delta)
      .def_readwrite("cachegen_per_channel", &vq::KVCacheConfig::cachegen_per_channel)
      .def_readwrite("cachegen_layer_groups", &vq::KVCacheConfig::cachegen_layer_groups)
      .def_readwrite("cachegen_resolved_bits", &vq::KVCacheConfig::cachegen_resolved_bits)
      .def_property(
          "cachegen_flush", [](const vq::KVCacheConfig& c) { return std::string(vq::flush_mode_name(c.cachegen_flush)); },
          [](vq::KVCacheConfig& c, const std::string& name) { c.cachegen_flush = vq::flush_mode_from_name(name); })
      .def("validate", &vq::KVCacheConfig::validate, "Raise ValueError naming the first bad field.")
      .def("effective_bits", &vq::KVCacheConfig::effective_bits, "cachegen_resolved_bits if set, else cachegen_bits.")
      .def("__eq__", [](const vq::KVCacheConfig& a, const vq::KVCacheConfig& b) { return a == b; }, py::is_operator())
      .def("__repr__", &config_repr);

  py::class_<vq::KVCache, std::shared_ptr<vq::KVCache>>(m, "KVCache", "The plain cache protocol of mlx_lm, for one attention layer.")
      .def(py::init<>())
      .def("update_and_fetch", &update_and_fetch, "keys"_a, "values"_a, py::kw_only(), "copy"_a = true,
           "Append keys/values [B, H, S, D] (float16 or float32) and return the whole cache (keys, values), "
           "[B, H, offset, D], in the input dtype. copy=True (default): fresh arrays. copy=False: read-only views of the "
           "cache's buffer, valid until the next update_and_fetch/trim/state assignment on this cache.")
      .def("attend", &attend, "queries"_a, "scale"_a,
           "softmax(scale * Q K^T) V over the cache for queries [B, Hq, Sq, D] (float32, or the cache's dtype): causal (the "
           "last Sq cached tokens are the queries' own: query i sees tokens 0 .. offset - Sq + i), grouped-query (Hq a "
           "multiple of the cache's KV heads). Returns a new float32 array [B, Hq, Sq, D_v]. Reads the cache a tile at a time; "
           "the cache is not changed. ValueError on bad queries or a non-finite scale.")
      .def_property_readonly("offset", &vq::KVCache::offset, "Tokens held.")
      .def_property("state", &get_state, &set_state, "(keys, values) up to offset, as copies. Assigning replaces the contents.")
      .def("is_trimmable", &vq::KVCache::is_trimmable)
      .def("trim", &vq::KVCache::trim, "n"_a, "Drop the last min(n, offset) tokens; returns how many were dropped.")
      .def_property_readonly("nbytes", &vq::KVCache::nbytes, "Bytes of memory the cache holds (allocated buffers).")
      .def("size", &vq::KVCache::offset, "mlx_lm's size(): the tokens held (offset).")
      .def("empty", [](const vq::KVCache& c) { return c.offset() == 0; }, "mlx_lm's empty(): True when no token is held.")
      .def_property_readonly("_kind", &vq::KVCache::kind, "The C++ class ('KVCache', 'CacheGenKVCache', 'VqKVCache', ...).")
      .def("_clone", &clone_cache, "An exact, independent copy (KVCache and CacheGenKVCache only).")
      .def("__repr__", [](const vq::KVCache& c) { return "<" + c.kind() + " offset=" + std::to_string(c.offset()) + ">"; });

  py::class_<vq::CacheGenKVCache, vq::KVCache, std::shared_ptr<vq::CacheGenKVCache>>(
      m, "CacheGenKVCache",
      "A KVCache that group-quantizes what it stores and accounts its bytes as CacheGen does (entropy of the token-delta "
      "code stream). Fetch returns dense arrays; like the reference, it has no `bits` attribute.")
      .def(py::init<vq::KVCacheConfig>(), "config"_a = vq::KVCacheConfig{})
      .def(py::init([](const py::object& config) { return std::make_shared<vq::CacheGenKVCache>(config_from_object(config)); }),
           "config"_a,
           "From any configuration object with the reference's cachegen_* fields (veloxquant.cache.base.KVCacheConfig), "
           "missing fields taking their defaults.")
      .def_property_readonly(
          "_bits", [](const vq::CacheGenKVCache& c) { return c.config().effective_bits(); },
          "The layer's bit width, as the reference names it: cachegen_resolved_bits if set, else cachegen_bits.")
      .def(
          "_assign", [](vq::CacheGenKVCache& c, const vq::CacheGenKVCache& other) { c.from_full_state(other.full_state()); },
          "other"_a, "Become an exact copy of `other` (configuration, codes, scales, residual, counters).")
      .def(
          "_reset_config",
          [](vq::CacheGenKVCache& c, const py::object& config) {
            if (c.offset() != 0) throw vq::InvalidArgument("the configuration of a cache that holds tokens cannot change");
            vq::CacheGenState st;
            st.config = config_from_object(config);
            c.from_full_state(std::move(st));
          },
          "config"_a, "Replace the configuration of an empty cache.")
      // Returned by value: binding the member function (a const reference) would hand Python a live
      // handle whose field edits reach the cache unvalidated, mid-stream.
      .def_property_readonly(
          "config", [](const vq::CacheGenKVCache& c) { return c.config(); },
          "A copy of the cache's configuration: editing it does not change the cache (build a new cache with it).")
      .def_property_readonly("compressed_key_bytes", &vq::CacheGenKVCache::compressed_key_bytes)
      .def_property_readonly("compressed_value_bytes", &vq::CacheGenKVCache::compressed_value_bytes)
      .def_property_readonly("fixed_width_key_bytes", &vq::CacheGenKVCache::fixed_width_key_bytes)
      .def_property_readonly("fixed_width_value_bytes", &vq::CacheGenKVCache::fixed_width_value_bytes)
      .def_property_readonly("fp16_key_bytes", &vq::CacheGenKVCache::fp16_key_bytes)
      .def_property_readonly("fp16_value_bytes", &vq::CacheGenKVCache::fp16_value_bytes)
      .def_property_readonly("encoded_key_bytes", &vq::CacheGenKVCache::encoded_key_bytes,
                             "Measured size of the rANS encoding of the closed key codes (header, the coder's model: the "
                             "context coder's up to 4 bits, per-channel tables above; float32 scales and minima; payload) "
                             "plus the residual stored exactly at the input dtype's size.")
      .def_property_readonly("encoded_value_bytes", &vq::CacheGenKVCache::encoded_value_bytes,
                             "As encoded_key_bytes, for the values.")
      .def_property_readonly("entropy_savings", &vq::CacheGenKVCache::entropy_savings,
                             "1 - compressed_key_bytes / fixed_width_key_bytes (0 when empty).")
      .def_property_readonly("assigned_avg_bits", &vq::CacheGenKVCache::assigned_avg_bits,
                             "16 * compressed_key_bytes / fp16_key_bytes (the configured bits when empty).")
      .def(
          "key_codes",
          [](const vq::CacheGenKVCache& c, std::int64_t slice) {
            const auto& s = c.key_stream();
            if (slice < 0 || slice >= s.slices()) throw vq::InvalidArgument("slice must be in [0, B*H)");
            py::array_t<std::uint8_t> out({static_cast<py::ssize_t>(s.quantized_tokens()), static_cast<py::ssize_t>(s.dim())});
            const auto codes = s.codes(slice);
            if (!codes.empty()) std::memcpy(out.mutable_data(), codes.data(), codes.size());
            return out;
          },
          "slice"_a, "A copy of the codes of key slice b*H + h: uint8 [quantized tokens, D].")
      .def(
          "value_codes",
          [](const vq::CacheGenKVCache& c, std::int64_t slice) {
            const auto& s = c.value_stream();
            if (slice < 0 || slice >= s.slices()) throw vq::InvalidArgument("slice must be in [0, B*H)");
            py::array_t<std::uint8_t> out({static_cast<py::ssize_t>(s.quantized_tokens()), static_cast<py::ssize_t>(s.dim())});
            const auto codes = s.codes(slice);
            if (!codes.empty()) std::memcpy(out.mutable_data(), codes.data(), codes.size());
            return out;
          },
          "slice"_a, "A copy of the codes of value slice b*H + h: uint8 [quantized tokens, D].");

  py::class_<KVCacheBuilderTag>(m, "KVCacheBuilder")
      .def_static(
          "for_model",
          [](const py::object& model, std::optional<vq::KVCacheConfig> config) {
            return vq::KVCacheBuilder::for_model(to_model(model), config.value_or(vq::KVCacheConfig{}));
          },
          "model"_a, "config"_a = py::none(),
          "One cache per layer: a CacheGenKVCache with the layer schedule's bits for each attention layer, a KVCache for "
          "layers without attention (None). model: list of head dims, or an object with layer_head_dims.");

  m.def(
      "save_prompt_cache",
      [](const std::string& file, const std::vector<std::shared_ptr<vq::KVCache>>& cache,
         std::optional<std::map<std::string, std::string>> metadata) {
        vq::save_prompt_cache(file, cache, metadata.value_or(vq::PromptMetadata{}));
      },
      "file"_a, "cache"_a, "metadata"_a = py::none(),
      "mlx_lm's save_prompt_cache: write the per-layer caches (KVCache / CacheGenKVCache / VqKVCache) and string metadata to a .vqkv "
      "file (docs/format.md), atomically. ValueError for a cache class the format cannot hold, OSError when writing fails.");
  m.def(
      "load_prompt_cache",
      [](const std::string& file, bool return_metadata, std::optional<std::string> model) -> py::object {
        vq::VqkvLoadOptions o;
        if (model) o.vq_models = vq::vq_layer_models(std::make_shared<const vq::Checkpoint>(vq::Checkpoint::load(*model)));
        vq::PromptCache pc = vq::load_prompt_cache(file, o);
        py::list caches = caches_to_python(pc.caches);
        if (return_metadata) return py::make_tuple(caches, py::cast(pc.metadata));
        return caches;
      },
      "file"_a, "return_metadata"_a = false, py::kw_only(), "model"_a = py::none(),
      "mlx_lm's load_prompt_cache: the caches saved in a .vqkv file, the same classes and configurations, fetching bit "
      "for bit what the saved caches fetched (and (caches, metadata) with return_metadata=True). model: the llama2.c "
      "checkpoint path that `vq` layers built from a model need (their transforms are rebuilt from its weights; a file "
      "naming another model's fingerprint is a RuntimeError). RuntimeError for a malformed file, OSError when it cannot be read.");
  m.def(
      "make_caches",
      [](const std::string& method, const std::string& model) {
        const vq::Transformer t(vq::Checkpoint::load(model));
        return vq::make_caches(method, t);
      },
      "method"_a, "model"_a,
      "One cache per layer of the llama2.c checkpoint at `model` for a method spec (e.g. 'vq:bits=2', 'cachegen'); "
      "`vq` caches derive their transforms from the model's weights and record its fingerprint. ValueError for a bad spec.");

  m.def(
      "methods",
      [] {
        py::list rows;
        for (const auto& r : vq::method_table()) {
          py::list keys;
          for (const auto& k : r.keys)
            keys.append(py::dict("name"_a = k.name, "default"_a = k.fallback, "range"_a = k.range, "help"_a = k.help));
          rows.append(py::dict("name"_a = r.name, "family"_a = vq::method_family_name(r.family), "usage"_a = vq::method_usage(r),
                               "summary"_a = r.summary, "saves_vqkv"_a = r.saves_vqkv, "keys"_a = keys,
                               "canonical_default"_a = vq::MethodSpec::parse(r.name).to_string()));
        }
        return rows;
      },
      "The method table (as `veloxquant methods --json` prints it): one dict per method with its name, family (ours, "
      "reference, peer, baseline), spec usage, summary, whether it saves to .vqkv, its keys (name, default, range, help) and "
      "the canonical text of its default spec. make_caches takes any of these specs.");

  m.def("layer_group_bits", &vq::layer_group_bits, "n_layers"_a, "base_bits"_a, "n_groups"_a = 3,
        "CacheGen's layer-wise bit schedule: deeper layers get fewer bits (never below 2).");

  // Private: what veloxquant.quantizers.cachegen / _quant_utils and the cache protocol are built on.
  m.def("_quantize_to_codes", &quantize_codes_py, "x"_a, "bits"_a, "group_size"_a,
        "float32 [N, D] -> (codes uint8 [N, D], scale float32 [G, D], minimum float32 [G, D]), G = ceil(N / group_size).");
  m.def("_dequant_codes", &dequant_codes_py, "codes"_a, "scale"_a, "zero"_a, "group_size"_a,
        "codes * scale + minimum per group: float32 [N, D].");
  m.def("_token_delta", &token_delta_py, "codes"_a, "uint8 [N, D] codes -> int16 [N, D] token deltas.");
  m.def("_symbol_entropy_bits", &symbol_entropy_bits_py, "symbols"_a, "Empirical Shannon entropy (bits per symbol) of int16 symbols.");
  m.def("_entropy_coded_bytes", &entropy_coded_bytes_py, "symbols"_a, "bits"_a, "n_groups"_a, "per_channel"_a,
        "The reference's entropy-coded byte estimate of one slice's int16 symbols [N, D].");
  m.def(
      "_fixed_width_bytes",
      [](std::int64_t n_tokens, int dim, int bits, std::int64_t n_groups) { return vq::fixed_width_bytes(n_tokens, dim, bits, n_groups); },
      "n_tokens"_a, "dim"_a, "bits"_a, "n_groups"_a, "ceil(N * D * bits / 8) + n_groups * D * 4.");
  m.def("_config_from_object", &config_from_object, "config"_a,
        "A validated KVCacheConfig from a KVCacheConfig or any object with the reference's cachegen_* fields.");
  m.def("_serialize_caches", &serialize_caches, "caches"_a, "The .vqkv bytes of the caches (save_prompt_cache, in memory).");
  m.def("_deserialize_caches", &deserialize_caches, "data"_a, "The caches of .vqkv bytes (load_prompt_cache, from memory).");

  m.def("_bench_cpp_update", &bench_cpp_update, "cache"_a, "keys"_a, "values"_a, "n"_a,
        "Seconds per call of n C++ update_and_fetch calls with one chunk (the binding benchmark's baseline).");
}
