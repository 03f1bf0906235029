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
#include "veloxquant/methods/method_table.hpp"
#include "veloxquant/store/kv_store.hpp"
#include "veloxquant/store/prefix_chunks.hpp"
#include "veloxquant/store/prefix_loader.hpp"

static_assert(sizeof(int) == sizeof(int32_t), "token ids cross the C API as int32_t and the library's as int");

struct vq_caches {
  std::vector<std::shared_ptr<vq::KVCache>> layers;
  std::int64_t kv_heads = 0, head_dim = 0;  // 0: not fixed yet (a decoded handle whose caches are empty)
};

struct vq_store {
  std::unique_ptr<vq::KVStore> store;
  std::string warnings;  // of the last vq_store_get, one per line
  std::string report;    // of the last vq_store_get: load_report_json
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

// The prefix scheme of a put (`get` false) or get: the C API's model identity, chunk size and level
// list. A get's chunk size 0 and levels NULL take what the store holds (store/prefix_lookup.hpp).
vq::ChunkScheme scheme_of(const char* model_id, int32_t chunk_tokens, const char* levels, bool get = false) {
  need(model_id, "model_id");
  if (*model_id == '\0') fail("model_id is empty (it must name the model, e.g. a hash of its weights)");
  if (chunk_tokens < (get ? 0 : 1))
    fail("chunk_tokens " + std::to_string(chunk_tokens) + (get ? " must be at least 0 (0: every size stored)" : " must be at least 1"));
  vq::ChunkScheme scheme;
  scheme.model_fingerprint = vq::named_model_fingerprint(model_id);
  scheme.chunk_tokens = chunk_tokens;
  if (levels || !get) scheme.levels = vq::parse_levels(levels ? levels : vq::default_store_levels());
  return scheme;
}

std::span<const int> tokens_of(const int32_t* tokens, int64_t n_tokens) {
  need(tokens, "tokens");
  if (n_tokens < 0) fail("n_tokens " + std::to_string(n_tokens) + " is negative");
  return {reinterpret_cast<const int*>(tokens), static_cast<std::size_t>(n_tokens)};
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

vq_status vq_store_open(const char* url, vq_store** out) {
  return guarded([&] {
    need(url, "url");
    need(out, "out");
    auto handle = std::make_unique<vq_store>();
    handle->store = vq::open_store(url);
    *out = handle.release();
  });
}

vq_status vq_store_close(vq_store* store) {
  return guarded([&] { delete store; });
}

vq_status vq_store_put(vq_store* store, const char* model_id, int32_t chunk_tokens, const char* levels,
                       const int32_t* tokens, int64_t n_tokens, const vq_caches* caches, int64_t* tokens_stored) {
  return guarded([&] {
    need(store, "store");
    need(caches, "caches");
    need(tokens_stored, "tokens_stored");
    const vq::ChunkScheme scheme = scheme_of(model_id, chunk_tokens, levels);
    const std::span<const int> ids = tokens_of(tokens, n_tokens);
    for (std::size_t l = 0; l < caches->layers.size(); ++l)
      if (caches->layers[l]->offset() != n_tokens)
        fail("layer " + std::to_string(l) + " holds " + std::to_string(caches->layers[l]->offset()) +
             " tokens, not the n_tokens " + std::to_string(n_tokens) + " whose ids are given");
    const std::int64_t chunks = n_tokens / chunk_tokens;
    if (chunks > 0) {
      // Each level is coded as a fresh cache of its method over the handle's own layer shape.
      const auto model = vq::ModelDescription::uniform(static_cast<int>(caches->layers.size()), static_cast<int>(caches->head_dim));
      const vq::LevelCaches fresh = [&](const std::string& level) { return vq::make_caches(vq::MethodSpec::parse(level), model); };
      std::vector<vq::KVState> exact;
      for (const auto& c : caches->layers) {
        vq::KVState st = c->state();
        if (st.keys.dim(0) != 1) fail("a prefix is stored from batch 1 caches, the handle holds batch " + std::to_string(st.keys.dim(0)));
        exact.push_back({st.keys.to(vq::DType::F32), st.values.to(vq::DType::F32)});
      }
      vq::put_context(*store->store, fresh, scheme, ids.first(static_cast<std::size_t>(chunks * chunk_tokens)), exact);
    }
    *tokens_stored = chunks * chunk_tokens;
  });
}

vq_status vq_store_get(vq_store* store, const char* model_id, int32_t chunk_tokens, const char* levels, const char* level,
                       const int32_t* tokens, int64_t n_tokens, vq_caches* caches, int64_t* tokens_reused) {
  return guarded([&] {
    need(store, "store");
    need(caches, "caches");
    need(tokens_reused, "tokens_reused");
    vq::LoaderOptions options;
    options.scheme = scheme_of(model_id, chunk_tokens, levels, true);
    const std::span<const int> ids = tokens_of(tokens, n_tokens);
    if (level) options.level = vq::MethodSpec::parse(level).to_string();
    for (std::size_t l = 0; l < caches->layers.size(); ++l)
      if (caches->layers[l]->offset() != 0)
        fail("layer " + std::to_string(l) + " already holds " + std::to_string(caches->layers[l]->offset()) +
             " tokens: a prefix is loaded into empty caches");
    if (caches->kv_heads == 0) fail("the handle's KV heads are not known (a decoded handle without tokens): create one");
    store->warnings.clear();
    store->report.clear();
    std::string warnings;
    const vq::LoadReport rep = vq::load_prefix(*store->store, vq::ChunkShape{caches->kv_heads, caches->head_dim}, caches->layers, ids,
                                               options, [&](const std::string& w) { warnings += (warnings.empty() ? "" : "\n") + w; });
    store->warnings = std::move(warnings);
    store->report = vq::load_report_json(rep);
    *tokens_reused = rep.tokens_reused;
  });
}

vq_status vq_store_warnings(const vq_store* store, const char** out) {
  return guarded([&] {
    need(store, "store");
    need(out, "out");
    *out = store->warnings.c_str();
  });
}

vq_status vq_store_report(const vq_store* store, const char** out) {
  return guarded([&] {
    need(store, "store");
    need(out, "out");
    *out = store->report.c_str();
  });
}

vq_status vq_store_stats(vq_store* store, uint64_t* blobs, uint64_t* bytes) {
  return guarded([&] {
    need(store, "store");
    need(blobs, "blobs");
    need(bytes, "bytes");
    const vq::StoreStats st = store->store->stats();
    *blobs = st.blobs;
    *bytes = st.bytes;
  });
}

vq_status vq_store_clear(vq_store* store) {
  return guarded([&] {
    need(store, "store");
    for (const std::string& key : store->store->list()) store->store->remove(key);
  });
}

}  // extern "C"
