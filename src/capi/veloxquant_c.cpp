// The C API (include/veloxquant/veloxquant.h): each function checks its pointers and sizes, calls
// the C++ library, and turns every exception into a status code plus a thread-local message.
// Nothing here decides anything the C++ API does not: the layer is deliberately thin.
#include "veloxquant/veloxquant.h"

#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "veloxquant/cache/builder.hpp"
#include "veloxquant/cache/kv_cache.hpp"
#include "veloxquant/core/dtype.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/core/tensor.hpp"
#include "veloxquant/format/vqkv.hpp"
#include "veloxquant/model/method_spec.hpp"

struct vq_caches {
  std::vector<std::shared_ptr<vq::KVCache>> layers;
  std::int64_t kv_heads = 0, head_dim = 0;  // 0: not fixed yet (a decoded handle whose caches are empty)
};

namespace {

thread_local std::string g_last_error;

// A failed check of the C layer itself: the same status as the library's InvalidArgument.
struct CError {
  vq_status status;
  std::string message;
};

[[noreturn]] void fail(const std::string& message) { throw CError{VQ_ERR_INVALID_ARGUMENT, message}; }

void need(const void* p, const char* what) {
  if (p == nullptr) fail(std::string(what) + " is NULL");
}

// Run `body`, mapping whatever it throws to a status and the thread's message.
template <typename F>
vq_status guarded(F&& body) noexcept {
  try {
    body();
    g_last_error.clear();
    return VQ_OK;
  } catch (const CError& e) {
    g_last_error = e.message;
    return e.status;
  } catch (const vq::InvalidArgument& e) {
    g_last_error = e.what();
    return VQ_ERR_INVALID_ARGUMENT;
  } catch (const vq::FormatError& e) {
    g_last_error = e.what();
    return VQ_ERR_FORMAT;
  } catch (const vq::IoError& e) {
    g_last_error = e.what();
    return VQ_ERR_IO;
  } catch (const std::bad_alloc&) {
    g_last_error = "out of memory";
    return VQ_ERR_OUT_OF_MEMORY;
  } catch (const std::length_error& e) {
    g_last_error = std::string("a buffer larger than memory can address was asked for (") + e.what() + ")";
    return VQ_ERR_INVALID_ARGUMENT;
  } catch (const vq::Error& e) {
    g_last_error = e.what();
    return VQ_ERR_INVALID_ARGUMENT;
  } catch (const std::exception& e) {
    g_last_error = std::string("internal error: ") + e.what();
    return VQ_ERR_INTERNAL;
  } catch (...) {
    g_last_error = "internal error: unknown exception";
    return VQ_ERR_INTERNAL;
  }
}

vq::DType to_dtype(vq_dtype dtype) {
  switch (dtype) {
    case VQ_DTYPE_F32: return vq::DType::F32;
    case VQ_DTYPE_F16: return vq::DType::F16;
  }
  fail("dtype " + std::to_string(static_cast<int>(dtype)) + " is not VQ_DTYPE_F32 (0) or VQ_DTYPE_F16 (1)");
}

vq::KVCache& layer_of(const vq_caches* caches, std::int32_t layer) {
  need(caches, "caches");
  const auto n = static_cast<std::int64_t>(caches->layers.size());
  if (layer < 0 || layer >= n)
    fail("layer " + std::to_string(layer) + " is out of range (the handle has " + std::to_string(n) + " layers)");
  return *caches->layers[static_cast<std::size_t>(layer)];
}

// Elements of a [b, h, s, d] shape, refusing negative dimensions and overflow.
std::int64_t numel4(std::int64_t b, std::int64_t h, std::int64_t s, std::int64_t d) {
  if (b < 0 || h < 0 || s < 0 || d < 0)
    fail("shape [" + std::to_string(b) + ", " + std::to_string(h) + ", " + std::to_string(s) + ", " +
         std::to_string(d) + "] has a negative dimension");
  return vq::checked_numel({b, h, s, d});
}

vq_caches* adopt(std::vector<std::shared_ptr<vq::KVCache>> layers) {
  auto handle = std::make_unique<vq_caches>();
  handle->layers = std::move(layers);
  for (const auto& c : handle->layers)
    if (c->offset() > 0) {
      handle->kv_heads = c->kv_heads();
      handle->head_dim = c->key_dim();
      break;
    }
  return handle.release();
}

}  // namespace

extern "C" {

const char* vq_last_error(void) { return g_last_error.c_str(); }

vq_status vq_version(const char** out) {
  return guarded([&] {
    need(out, "out");
    *out = "0.1.0";
  });
}

vq_status vq_caches_create(const char* method_spec, int32_t n_layers, int32_t kv_heads, int32_t head_dim,
                           vq_caches** out) {
  return guarded([&] {
    need(method_spec, "method_spec");
    need(out, "out");
    if (n_layers < 1 || n_layers > 65536) fail("n_layers " + std::to_string(n_layers) + " is outside 1..65536");
    if (kv_heads < 1) fail("kv_heads " + std::to_string(kv_heads) + " must be at least 1");
    if (head_dim < 1 || head_dim > vq::kMaxHeadDim)
      fail("head_dim " + std::to_string(head_dim) + " is outside 1.." + std::to_string(vq::kMaxHeadDim));
    const vq::MethodSpec spec = vq::MethodSpec::parse(method_spec);
    auto layers = vq::make_caches(spec, vq::ModelDescription::uniform(n_layers, head_dim));
    auto handle = std::make_unique<vq_caches>();
    handle->layers = std::move(layers);
    handle->kv_heads = kv_heads;
    handle->head_dim = head_dim;
    *out = handle.release();
  });
}

vq_status vq_caches_free(vq_caches* caches) {
  return guarded([&] { delete caches; });
}

vq_status vq_caches_layers(const vq_caches* caches, int32_t* n_layers) {
  return guarded([&] {
    need(caches, "caches");
    need(n_layers, "n_layers");
    *n_layers = static_cast<int32_t>(caches->layers.size());
  });
}

vq_status vq_cache_tokens(const vq_caches* caches, int32_t layer, int64_t* tokens) {
  return guarded([&] {
    const vq::KVCache& c = layer_of(caches, layer);
    need(tokens, "tokens");
    *tokens = c.offset();
  });
}

vq_status vq_cache_nbytes(const vq_caches* caches, int32_t layer, size_t* nbytes) {
  return guarded([&] {
    const vq::KVCache& c = layer_of(caches, layer);
    need(nbytes, "nbytes");
    *nbytes = c.nbytes();
  });
}

vq_status vq_cache_append(vq_caches* caches, int32_t layer, vq_dtype dtype, const void* keys, const void* values,
                          int64_t batch, int64_t heads, int64_t tokens, int64_t head_dim) {
  return guarded([&] {
    vq::KVCache& c = layer_of(caches, layer);
    need(keys, "keys");
    need(values, "values");
    const vq::DType dt = to_dtype(dtype);
    numel4(batch, heads, tokens, head_dim);
    if (caches->kv_heads != 0 && heads != caches->kv_heads)
      fail("heads " + std::to_string(heads) + " differs from the handle's " + std::to_string(caches->kv_heads) +
           " KV heads");
    if (caches->head_dim != 0 && head_dim != caches->head_dim)
      fail("head_dim " + std::to_string(head_dim) + " differs from the handle's " + std::to_string(caches->head_dim));
    if (batch < 1 || heads < 1 || tokens < 1 || head_dim < 1) fail("batch, heads, tokens and head_dim must be at least 1");
    const vq::Shape4 shape{batch, heads, tokens, head_dim};
    // wrap() views the caller's memory; the cache copies (or codes) what it keeps.
    const vq::Tensor k = vq::Tensor::wrap(const_cast<void*>(keys), shape, dt);
    const vq::Tensor v = vq::Tensor::wrap(const_cast<void*>(values), shape, dt);
    c.update(k, v);
    if (caches->kv_heads == 0) {
      caches->kv_heads = heads;
      caches->head_dim = head_dim;
    }
  });
}

vq_status vq_cache_read(const vq_caches* caches, int32_t layer, vq_dtype dtype, void* keys_out, void* values_out,
                        size_t capacity) {
  return guarded([&] {
    const vq::KVCache& c = layer_of(caches, layer);
    need(keys_out, "keys_out");
    need(values_out, "values_out");
    const vq::DType dt = to_dtype(dtype);
    if (c.offset() == 0) return;
    const vq::KVState st = c.state();
    const std::int64_t nk = st.keys.numel(), nv = st.values.numel();
    if (static_cast<std::uint64_t>(nk) > capacity || static_cast<std::uint64_t>(nv) > capacity)
      fail("capacity " + std::to_string(capacity) + " elements is less than the cache's " +
           std::to_string(nk > nv ? nk : nv) + " (" + vq::shape_string(st.keys.shape()) + ")");
    const vq::Tensor k = st.keys.to(dt), v = st.values.to(dt);  // contiguous copies at the asked dtype
    std::memcpy(keys_out, k.row(0, 0, 0), k.nbytes());
    std::memcpy(values_out, v.row(0, 0, 0), v.nbytes());
  });
}

vq_status vq_cache_attend(const vq_caches* caches, int32_t layer, const float* queries, int64_t batch,
                          int64_t q_heads, int64_t q_tokens, int64_t head_dim, float scale, float* out,
                          size_t capacity) {
  return guarded([&] {
    const vq::KVCache& c = layer_of(caches, layer);
    need(queries, "queries");
    need(out, "out");
    numel4(batch, q_heads, q_tokens, head_dim);
    if (batch < 1 || q_heads < 1 || q_tokens < 1 || head_dim < 1)
      fail("batch, q_heads, q_tokens and head_dim must be at least 1");
    const vq::Tensor q =
        vq::Tensor::wrap(const_cast<float*>(queries), {batch, q_heads, q_tokens, head_dim}, vq::DType::F32);
    const vq::Tensor o = c.attend(q, scale);
    const std::int64_t no = o.numel();
    if (static_cast<std::uint64_t>(no) > capacity)
      fail("capacity " + std::to_string(capacity) + " elements is less than the output's " + std::to_string(no) + " (" +
           vq::shape_string(o.shape()) + ")");
    const vq::Tensor oc = o.contiguous();
    std::memcpy(out, oc.row(0, 0, 0), oc.nbytes());
  });
}

vq_status vq_caches_encode(const vq_caches* caches, uint8_t** bytes, size_t* size) {
  return guarded([&] {
    need(caches, "caches");
    need(bytes, "bytes");
    need(size, "size");
    const std::vector<std::uint8_t> data = vq::serialize_prompt_cache(caches->layers);
    auto* p = static_cast<std::uint8_t*>(std::malloc(data.empty() ? 1 : data.size()));
    if (p == nullptr) throw std::bad_alloc();
    std::memcpy(p, data.data(), data.size());
    *bytes = p;
    *size = data.size();
  });
}

vq_status vq_bytes_free(uint8_t* bytes) {
  return guarded([&] { std::free(bytes); });
}

vq_status vq_caches_decode(const uint8_t* bytes, size_t size, vq_caches** out) {
  return guarded([&] {
    need(bytes, "bytes");
    need(out, "out");
    vq::PromptCache pc = vq::deserialize_prompt_cache(std::span<const std::uint8_t>(bytes, size));
    if (pc.caches.empty()) throw vq::FormatError("the .vqkv bytes hold no layers");
    *out = adopt(std::move(pc.caches));
  });
}

vq_status vq_caches_save(const vq_caches* caches, const char* path) {
  return guarded([&] {
    need(caches, "caches");
    need(path, "path");
    vq::save_prompt_cache(path, caches->layers);
  });
}

vq_status vq_caches_load(const char* path, vq_caches** out) {
  return guarded([&] {
    need(path, "path");
    need(out, "out");
    vq::PromptCache pc = vq::load_prompt_cache(path);
    if (pc.caches.empty()) throw vq::FormatError(std::string(path) + ": the file holds no layers");
    *out = adopt(std::move(pc.caches));
  });
}

}  // extern "C"
