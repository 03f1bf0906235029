/* veloxquant's C API: KV caches for engines written in C or any language with a C FFI.
 *
 * A thin layer over the C++ library (the primary API, the headers under veloxquant/cache/): opaque handles, no
 * C++ types, plain C99. Build against the installed library with
 *     cc demo.c $(pkg-config --cflags --libs veloxquant)
 * or, in CMake, find_package(veloxquant CONFIG) and link veloxquant::veloxquant.
 *
 * Conventions
 * - Every function returns a vq_status: VQ_OK (0) on success, a nonzero code otherwise. After a
 *   failure, vq_last_error() returns one line that explains it (a thread-local copy: each thread
 *   sees the message of its own last failed call; a successful call clears it to ""). Output
 *   parameters are written only on success.
 * - A vq_caches handle holds one KV cache per layer of a model (layers, KV heads, head dim), all
 *   built from one method spec (the CLI's `--methods` syntax: "fp16", "cachegen:bits=3", "vq",
 *   "q8_0", "kivi:bits=4", ...; README.md and docs/methods.md). Tensors cross the API as
 *   contiguous row-major buffers shaped [batch, heads, tokens, head_dim].
 * - A handle is not thread-safe: calls on one handle must not overlap. Different handles may be
 *   used from different threads at once.
 * - Memory the library allocates for the caller (vq_caches_encode's bytes) is released with
 *   vq_bytes_free; handles with vq_caches_free. Both accept NULL.
 *
 * The prefix store (put/get a prefix's caches by key) will join this API once the store issue
 * lands; see docs/c_api.md. Details and an example: docs/c_api.md.
 */
#ifndef VELOXQUANT_VELOXQUANT_H
#define VELOXQUANT_VELOXQUANT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum vq_status {
  VQ_OK = 0,
  VQ_ERR_INVALID_ARGUMENT = 1, /* NULL pointer, bad spec, wrong shape or dtype, buffer too small */
  VQ_ERR_FORMAT = 2,           /* malformed, truncated or corrupt .vqkv bytes */
  VQ_ERR_IO = 3,               /* the operating system refused: missing file, permissions, full disk */
  VQ_ERR_OUT_OF_MEMORY = 4,
  VQ_ERR_INTERNAL = 5          /* a bug: please report the message */
} vq_status;

/* Element types of K/V buffers. Numbers are part of the ABI: never renumbered. */
/* vq_dtype is a plain int32_t, not an enum type, so any value a caller passes is well defined and
   an unknown one is refused with VQ_ERR_INVALID_ARGUMENT. */
typedef int32_t vq_dtype;
enum { VQ_DTYPE_F32 = 0, VQ_DTYPE_F16 = 1 };

/* One KV cache per layer of a model (opaque). */
typedef struct vq_caches vq_caches;

/* The message of this thread's last failed call ("" after a success). Valid until the thread's
 * next veloxquant call; never NULL. */
const char* vq_last_error(void);
/* The library version, e.g. "0.1.0". */
vq_status vq_version(const char** out);

/* Create `n_layers` caches for a model with `kv_heads` KV heads of `head_dim` per layer, from a
 * method spec. n_layers 1..65536, kv_heads >= 1, head_dim 1..65536. */
vq_status vq_caches_create(const char* method_spec, int32_t n_layers, int32_t kv_heads, int32_t head_dim,
                           vq_caches** out);
/* Release a handle (NULL: nothing to do). */
vq_status vq_caches_free(vq_caches* caches);

/* The model shape of a handle. */
vq_status vq_caches_layers(const vq_caches* caches, int32_t* n_layers);
/* Tokens layer `layer` holds (the same for every layer fed the same tokens). */
vq_status vq_cache_tokens(const vq_caches* caches, int32_t layer, int64_t* tokens);
/* Bytes of memory layer `layer`'s cache holds now (resident size). */
vq_status vq_cache_nbytes(const vq_caches* caches, int32_t layer, size_t* nbytes);

/* Append `tokens` new tokens to layer `layer`: keys and values are contiguous [batch, heads,
 * tokens, head_dim] of `dtype`; heads and head_dim must be the handle's, and batch and dtype those
 * of the earlier appends. On error the cache is unchanged. */
vq_status vq_cache_append(vq_caches* caches, int32_t layer, vq_dtype dtype, const void* keys, const void* values,
                          int64_t batch, int64_t heads, int64_t tokens, int64_t head_dim);

/* Read layer `layer`'s whole cache back, as the cache holds it (lossy methods: their
 * reconstruction), converted to `dtype`: keys_out and values_out each receive
 * batch * heads * tokens * head_dim elements ([batch, heads, tokens, head_dim], tokens =
 * vq_cache_tokens). `capacity` is the number of elements each buffer can hold; too small is an
 * error. An empty cache writes nothing. */
vq_status vq_cache_read(const vq_caches* caches, int32_t layer, vq_dtype dtype, void* keys_out, void* values_out,
                        size_t capacity);

/* Attention over layer `layer`'s cache: softmax(scale * Q K^T) V for float32 queries
 * [batch, q_heads, q_tokens, head_dim], causal (the last q_tokens cached tokens are the queries'
 * own), grouped-query (q_heads a multiple of the KV heads). Writes [batch, q_heads, q_tokens,
 * head_dim] float32 to `out` (`capacity` elements available). The cache never changes. */
vq_status vq_cache_attend(const vq_caches* caches, int32_t layer, const float* queries, int64_t batch,
                          int64_t q_heads, int64_t q_tokens, int64_t head_dim, float scale, float* out,
                          size_t capacity);

/* Encode every layer to .vqkv bytes in memory (docs/format.md). *bytes is allocated by the
 * library: release it with vq_bytes_free. Methods the format cannot hold yet (only fp32 and
 * cachegen caches today) are VQ_ERR_INVALID_ARGUMENT, naming the class. */
vq_status vq_caches_encode(const vq_caches* caches, uint8_t** bytes, size_t* size);
vq_status vq_bytes_free(uint8_t* bytes);
/* Decode .vqkv bytes into a new handle: fetching from it gives bit for bit what the encoded caches
 * gave. Corrupt or truncated bytes are VQ_ERR_FORMAT. */
vq_status vq_caches_decode(const uint8_t* bytes, size_t size, vq_caches** out);

/* The same through a file, written atomically (a failed save leaves the previous file or none). */
vq_status vq_caches_save(const vq_caches* caches, const char* path);
vq_status vq_caches_load(const char* path, vq_caches** out);

#ifdef __cplusplus
}
#endif

#endif /* VELOXQUANT_VELOXQUANT_H */
