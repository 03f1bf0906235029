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
 * - A vq_store handle is a prefix store (docs/store.md): a context's caches in chunks of tokens,
 *   each chunk at several quality levels, under keys chained over the token ids, so prompts sharing
 *   a prefix share its chunks. Release it with vq_store_close (NULL: nothing).
 *
 * Details and examples: docs/c_api.md.
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

/* ---- The prefix store (docs/c_api.md, docs/store.md) ---------------------------------------- */

/* A store of prefix chunks (opaque). */
typedef struct vq_store vq_store;

/* Open a store by URL: "file:DIR" (DIR is created when missing; "?capacity=BYTES" evicts the least
 * recently used blobs above BYTES), "redis://[:password@]host:port[/db]" or
 * "redis-cluster://host:port[,host:port...]" (connections are opened at the first use); "" is
 * "file:./.vqkv-store". A malformed URL is VQ_ERR_INVALID_ARGUMENT, a directory that cannot be
 * created VQ_ERR_IO. */
vq_status vq_store_open(const char* url, vq_store** out);
/* Release a store handle (NULL: nothing to do). What was put stays stored. */
vq_status vq_store_close(vq_store* store);

/* Store the prefix chunks of a context whose K/V `caches` holds: every layer must hold exactly the
 * n_tokens tokens whose ids are `tokens` (batch 1). The first floor(n_tokens / chunk_tokens) chunks
 * are stored at every level of `levels` (method specs separated by ';', e.g.
 * "vq:bits=2;cachegen:bits=4"; NULL: "vq:bits=1;vq:bits=2;vq:bits=4"; "fp32", the exact level, is
 * always added), keyed by `model_id` (any non-empty string that names the model exactly: chunks
 * stored under one identity are found only under it). Chunks already stored are skipped. The K/V
 * stored is what the handle reads back (vq_cache_read), so put from an "fp32" handle for exact
 * chunks. *tokens_stored = the tokens now stored (whole chunks). A level the .vqkv format cannot
 * hold is VQ_ERR_INVALID_ARGUMENT naming it; a store failure VQ_ERR_IO. */
vq_status vq_store_put(vq_store* store, const char* model_id, int32_t chunk_tokens, const char* levels,
                       const int32_t* tokens, int64_t n_tokens, const vq_caches* caches, int64_t* tokens_stored);

/* Load the longest stored prefix of `tokens` into `caches` (empty: no layer holds a token yet; its
 * layers, KV heads and head dim those of the stored context), leaving at least the last token for
 * the caller to compute (its logits start the generation); model_id must be the put's. The chunk
 * size and the levels are found in the store: chunk_tokens 0 takes every size stored (the one
 * reusing the most tokens wins), levels NULL every level stored; a size or a level list given only
 * narrows that ("fp32" is always allowed). `level` NULL loads each chunk at the best quality stored
 * ("fp32" when stored), else at that level (one of `levels` when given). What was found, per chunk,
 * and why reuse stopped where it did: vq_store_report. The loaded chunks are appended as float32 K/V: later appends to
 * the handle must be VQ_DTYPE_F32. *tokens_reused = the tokens loaded (a multiple of chunk_tokens;
 * 0 when nothing is stored). Faults in the store (a missing, corrupt or foreign blob, a failed or
 * timed-out fetch) never give a wrong cache: loading stops before the chunk at fault, the status is
 * VQ_OK with fewer tokens reused, and vq_store_warnings says why. Bad arguments are errors. */
vq_status vq_store_get(vq_store* store, const char* model_id, int32_t chunk_tokens, const char* levels, const char* level,
                       const int32_t* tokens, int64_t n_tokens, vq_caches* caches, int64_t* tokens_reused);

/* The warnings of this handle's last vq_store_get, one line each ("" when it had none). Valid
 * until the handle's next call. */
vq_status vq_store_warnings(const vq_store* store, const char** out);
/* The report of this handle's last vq_store_get as JSON text ("" before any): {"tokens_reused",
 * "tokens_filled", "chunk_tokens" (the size found, 0: none), "load_ms", "prefill_ms_estimate",
 * "chunks": [{"index", "status": "hit", "levels" (stored for this model), "level" (loaded),
 * "reason", "bytes", "fetch_ms", "decode_ms"}], "miss": null or {"index", "status": "miss" or
 * "fault", "levels", "reason"} (where reuse ended and why: "not stored", "stored for another model
 * only (fingerprint ...)", a level list that leaves out what is stored, a fault), "not_used" (one
 * line when a stored prefix was not used, else ""), "warnings"}. Valid until the handle's next call. */
vq_status vq_store_report(const vq_store* store, const char** out);
/* How many blobs (chunk levels and chunk directories) the store holds, and their bytes. */
vq_status vq_store_stats(vq_store* store, uint64_t* blobs, uint64_t* bytes);
/* Remove every blob the store holds (under a Redis URL: every key under its prefix). */
vq_status vq_store_clear(vq_store* store);

#ifdef __cplusplus
}
#endif

#endif /* VELOXQUANT_VELOXQUANT_H */
