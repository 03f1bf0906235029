/* The C API (veloxquant/veloxquant.h) from C: every function, its results and every error path
 * (NULL handles and pointers, bad specs, wrong shapes and dtypes, small buffers, corrupt bytes,
 * unreadable files), and the prefix store through a file: store (put/get round trips, exact and
 * lossy levels, bad URLs, faulty blobs). Compiled as C11 and run by ctest (capi_test); argv[1] is a scratch directory.
 * Prints one line per failed check and exits 1 if any failed. */
#define _POSIX_C_SOURCE 200809L /* opendir, stat */
#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "veloxquant/veloxquant.h"

static int failures = 0;

#define CHECK(cond)                                                              \
  do {                                                                           \
    if (!(cond)) {                                                               \
      fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond);   \
      ++failures;                                                                \
    }                                                                            \
  } while (0)

/* A call that must fail with `status` and leave a message containing `needle`. */
#define EXPECT_ERR(call, status, needle)                                                              \
  do {                                                                                                \
    vq_status s_ = (call);                                                                            \
    if (s_ != (status) || strstr(vq_last_error(), (needle)) == NULL) {                                \
      fprintf(stderr, "%s:%d: %s gave status %d, message \"%s\"; wanted %d and \"%s\"\n", __FILE__,   \
              __LINE__, #call, (int)s_, vq_last_error(), (int)(status), (needle));                    \
      ++failures;                                                                                     \
    }                                                                                                 \
  } while (0)

#define EXPECT_OK(call)                                                                             \
  do {                                                                                              \
    vq_status s_ = (call);                                                                          \
    if (s_ != VQ_OK) {                                                                              \
      fprintf(stderr, "%s:%d: %s failed (%d): %s\n", __FILE__, __LINE__, #call, (int)s_, vq_last_error()); \
      ++failures;                                                                                   \
    } else if (vq_last_error()[0] != '\0') {                                                        \
      fprintf(stderr, "%s:%d: %s succeeded but left a message\n", __FILE__, __LINE__, #call);        \
      ++failures;                                                                                   \
    }                                                                                               \
  } while (0)

enum { B = 1, H = 2, D = 16, S = 40, L = 3 };
#define N ((size_t)B * H * S * D)

/* Smooth K/V (a drifting sine per channel), like real caches. */
static void fill(float* k, float* v, int64_t tokens, int seed) {
  for (int64_t h = 0; h < H; ++h)
    for (int64_t s = 0; s < tokens; ++s)
      for (int64_t d = 0; d < D; ++d) {
        size_t i = (size_t)((h * tokens + s) * D + d);
        k[i] = (float)sin(0.05 * (double)s + 0.7 * (double)d + seed) * (1.0f + (float)d / 8.0f);
        v[i] = (float)cos(0.03 * (double)s + 0.3 * (double)d + seed);
      }
}

/* IEEE binary16 bits of a float that float16 holds exactly. */
static uint16_t to_half(float x) {
  if (x == 0.0f) return 0;
  uint32_t bits;
  memcpy(&bits, &x, 4);
  uint16_t sign = (uint16_t)((bits >> 16) & 0x8000u);
  int32_t exp = (int32_t)((bits >> 23) & 0xff) - 127 + 15;
  uint16_t mant = (uint16_t)((bits >> 13) & 0x3ffu);
  return (uint16_t)(sign | (uint16_t)(exp << 10) | mant);
}

static double max_abs_diff(const float* a, const float* b, size_t n) {
  double m = 0;
  for (size_t i = 0; i < n; ++i) {
    double d = fabs((double)a[i] - (double)b[i]);
    if (d > m) m = d;
  }
  return m;
}

/* Plain causal attention of one query token (the last cached token) against float32 K/V. */
static void attend_last(const float* k, const float* v, const float* q, int64_t q_heads, float scale, float* out) {
  for (int64_t qh = 0; qh < q_heads; ++qh) {
    int64_t h = qh / (q_heads / H);
    double w[S], mx = -1e300, sum = 0;
    for (int64_t s = 0; s < S; ++s) {
      double dot = 0;
      for (int64_t d = 0; d < D; ++d) dot += (double)q[qh * D + d] * k[(h * S + s) * D + d];
      w[s] = dot * scale;
      if (w[s] > mx) mx = w[s];
    }
    for (int64_t s = 0; s < S; ++s) sum += (w[s] = exp(w[s] - mx));
    for (int64_t d = 0; d < D; ++d) {
      double acc = 0;
      for (int64_t s = 0; s < S; ++s) acc += w[s] * v[(h * S + s) * D + d];
      out[qh * D + d] = (float)(acc / sum);
    }
  }
}

/* ---- the prefix store (file: backend; Redis is covered by the C++ integration test) ---------- */

/* The vq:bits=2 level's error budget, as relative RMS error over K and V: that of the optimal 2-bit
 * scalar quantizer of a Gaussian (Lloyd-Max, MSE 0.1175 sigma^2 -> 0.343). vq spends 2 bits per
 * element with entropy coding and must do no worse (measured 0.19 on this test's data). */
#define VQ2_REL_RMS_BUDGET 0.343
enum { CT = 64, NT = 2 * CT + 3, SL = 2 }; /* tokens per chunk, context tokens (2 whole chunks), layers */
#define PN ((size_t)H * NT * D)

/* The first `n` tokens of [1, H, NT, D] rows, as a contiguous [1, H, n, D]. */
static void prefix_rows(const float* all, int64_t n, int64_t from, float* out) {
  for (int64_t h = 0; h < H; ++h) memcpy(out + h * n * D, all + (h * NT + from) * D, sizeof(float) * (size_t)(n * D));
}

/* The blob files of a file: store, with their sizes. */
enum { MAX_BLOBS = 64 };
typedef struct {
  int n;
  char name[MAX_BLOBS][256];
  long size[MAX_BLOBS];
} blob_list;

static void list_blobs(const char* dir, blob_list* out) {
  char path[4400];
  out->n = 0;
  snprintf(path, sizeof path, "%s/blobs", dir);
  DIR* d = opendir(path);
  CHECK(d != NULL);
  if (!d) return;
  for (struct dirent* e; (e = readdir(d)) != NULL && out->n < MAX_BLOBS;) {
    if (e->d_name[0] == '.') continue;
    struct stat st;
    snprintf(path, sizeof path, "%s/blobs/%s", dir, e->d_name);
    if (stat(path, &st) != 0 || !S_ISREG(st.st_mode)) continue;
    snprintf(out->name[out->n], sizeof out->name[0], "%s", e->d_name);
    out->size[out->n++] = (long)st.st_size;
  }
  closedir(d);
}

static int listed(const blob_list* l, const char* name) {
  for (int i = 0; i < l->n; ++i)
    if (strcmp(l->name[i], name) == 0) return 1;
  return 0;
}

/* A new handle of SL fp32 layers. */
static vq_caches* fresh_fp32(void) {
  vq_caches* c = NULL;
  EXPECT_OK(vq_caches_create("fp32", SL, H, D, &c));
  return c;
}

/* Every layer of `c` holds exactly the first `n` tokens of `pk`/`pv`, bit for bit. */
static int holds_prefix(const vq_caches* c, float pk[SL][PN], float pv[SL][PN], int64_t n) {
  static float want_k[PN], want_v[PN], got_k[PN], got_v[PN];
  int ok = 1;
  for (int32_t l = 0; l < SL; ++l) {
    int64_t t = -1;
    ok &= vq_cache_tokens(c, l, &t) == VQ_OK && t == n;
    if (!ok || n == 0) continue;
    prefix_rows(pk[l], n, 0, want_k);
    prefix_rows(pv[l], n, 0, want_v);
    ok &= vq_cache_read(c, l, VQ_DTYPE_F32, got_k, got_v, PN) == VQ_OK;
    ok &= memcmp(got_k, want_k, sizeof(float) * (size_t)(H * n * D)) == 0 &&
          memcmp(got_v, want_v, sizeof(float) * (size_t)(H * n * D)) == 0;
  }
  return ok;
}

/* vq_store_get into a new fp32 handle; returns the tokens reused (-1 on error) and the handle. */
static int64_t get_into(vq_store* st, const char* model, int32_t ct, const char* levels, const char* level, const int32_t* ids,
                        int64_t n, vq_caches** out) {
  int64_t reused = -1;
  *out = fresh_fp32();
  EXPECT_OK(vq_store_get(st, model, ct, levels, level, ids, n, *out, &reused));
  return reused;
}

static void test_store(const char* scratch) {
  static float pk[SL][PN], pv[SL][PN], ck[PN], cv[PN], rk[PN], rv[PN], gk[PN], gv[PN];
  int32_t ids[NT];
  for (int i = 0; i < NT; ++i) ids[i] = 1 + (i * 7919) % 500;
  for (int l = 0; l < SL; ++l) fill(pk[l], pv[l], NT, 10 + l);
  const char* model = "capi-test-model";
  const char* levels = "vq:bits=2";
  char dir[4200], url[4300], path[4400];
  snprintf(dir, sizeof dir, "%s/store", scratch);
  snprintf(url, sizeof url, "file:%s", dir);

  /* open: bad URLs and a directory that cannot be created */
  vq_store* st = NULL;
  EXPECT_ERR(vq_store_open(NULL, &st), VQ_ERR_INVALID_ARGUMENT, "url is NULL");
  EXPECT_ERR(vq_store_open(url, NULL), VQ_ERR_INVALID_ARGUMENT, "out is NULL");
  EXPECT_ERR(vq_store_open("ftp://example.org/x", &st), VQ_ERR_INVALID_ARGUMENT, "is not one of file:DIR");
  EXPECT_ERR(vq_store_open("file:", &st), VQ_ERR_INVALID_ARGUMENT, "needs a directory");
  EXPECT_ERR(vq_store_open("file:/tmp/x?capacity=lots", &st), VQ_ERR_INVALID_ARGUMENT, "capacity");
  EXPECT_ERR(vq_store_open("redis://localhost:notaport", &st), VQ_ERR_INVALID_ARGUMENT, "");
  snprintf(path, sizeof path, "%s/blocker", scratch); /* a regular file where a directory must go */
  FILE* f = fopen(path, "wb");
  CHECK(f != NULL);
  if (f) fclose(f);
  snprintf(path, sizeof path, "file:%s/blocker/store", scratch);
  EXPECT_ERR(vq_store_open(path, &st), VQ_ERR_IO, "");
  CHECK(st == NULL);
  EXPECT_OK(vq_store_close(NULL));

  EXPECT_OK(vq_store_open(url, &st));
  EXPECT_OK(vq_store_clear(st)); /* the scratch directory may hold a previous run's blobs */
  uint64_t blobs = 99, bytes = 99;
  EXPECT_OK(vq_store_stats(st, &blobs, &bytes));
  CHECK(blobs == 0 && bytes == 0);

  /* the source: exact (fp32) caches of the context, and of its first chunk alone */
  vq_caches *src = fresh_fp32(), *src1 = fresh_fp32(), *dst = NULL;
  for (int32_t l = 0; l < SL; ++l) {
    EXPECT_OK(vq_cache_append(src, l, VQ_DTYPE_F32, pk[l], pv[l], 1, H, NT, D));
    prefix_rows(pk[l], CT, 0, ck);
    prefix_rows(pv[l], CT, 0, cv);
    EXPECT_OK(vq_cache_append(src1, l, VQ_DTYPE_F32, ck, cv, 1, H, CT, D));
  }

  /* put: bad arguments change nothing */
  int64_t stored = -1, reused = -1;
  EXPECT_ERR(vq_store_put(NULL, model, CT, levels, ids, NT, src, &stored), VQ_ERR_INVALID_ARGUMENT, "store is NULL");
  EXPECT_ERR(vq_store_put(st, NULL, CT, levels, ids, NT, src, &stored), VQ_ERR_INVALID_ARGUMENT, "model_id is NULL");
  EXPECT_ERR(vq_store_put(st, "", CT, levels, ids, NT, src, &stored), VQ_ERR_INVALID_ARGUMENT, "model_id is empty");
  EXPECT_ERR(vq_store_put(st, model, 0, levels, ids, NT, src, &stored), VQ_ERR_INVALID_ARGUMENT, "chunk_tokens 0");
  EXPECT_ERR(vq_store_put(st, model, CT, "nosuch", ids, NT, src, &stored), VQ_ERR_INVALID_ARGUMENT, "nosuch");
  EXPECT_ERR(vq_store_put(st, model, CT, levels, NULL, NT, src, &stored), VQ_ERR_INVALID_ARGUMENT, "tokens is NULL");
  EXPECT_ERR(vq_store_put(st, model, CT, levels, ids, -1, src, &stored), VQ_ERR_INVALID_ARGUMENT, "negative");
  EXPECT_ERR(vq_store_put(st, model, CT, levels, ids, NT - 1, src, &stored), VQ_ERR_INVALID_ARGUMENT, "holds 131 tokens");
  EXPECT_ERR(vq_store_put(st, model, CT, levels, ids, NT, NULL, &stored), VQ_ERR_INVALID_ARGUMENT, "caches is NULL");
  EXPECT_ERR(vq_store_put(st, model, CT, levels, ids, NT, src, NULL), VQ_ERR_INVALID_ARGUMENT, "tokens_stored is NULL");
  EXPECT_ERR(vq_store_put(st, model, CT, "q8_0", ids, NT, src, &stored), VQ_ERR_INVALID_ARGUMENT, "level 'q8_0' cannot be stored");
  CHECK(stored == -1);
  EXPECT_OK(vq_store_stats(st, &blobs, &bytes));
  CHECK(blobs == 0);

  /* put the first chunk alone, then the whole context: the first chunk's blobs are shared */
  EXPECT_OK(vq_store_put(st, model, CT, levels, ids, CT, src1, &stored));
  CHECK(stored == CT);
  blob_list first, all;
  list_blobs(dir, &first);
  CHECK(first.n == 4); /* fp32, vq:bits=2, the directory and the store's chunk-sizes list */
  EXPECT_OK(vq_store_put(st, model, CT, levels, ids, NT, src, &stored));
  CHECK(stored == 2 * CT);
  EXPECT_OK(vq_store_stats(st, &blobs, &bytes));
  CHECK(blobs == 7 && bytes > 2 * SL * 2 * sizeof(float) * H * CT * D);
  EXPECT_OK(vq_store_put(st, model, CT, levels, ids, NT, src, &stored)); /* idempotent */
  EXPECT_OK(vq_store_stats(st, &blobs, &bytes));
  CHECK(blobs == 7);
  list_blobs(dir, &all);
  CHECK(all.n == 7);
  /* chunk 1's blobs, by size: fp32 (largest), vq:bits=2, directory (smallest) */
  int fp32_1 = -1, vq_1 = -1, dir_1 = -1;
  for (int i = 0; i < all.n; ++i) {
    if (listed(&first, all.name[i])) continue;
    if (fp32_1 < 0 || all.size[i] > all.size[fp32_1]) fp32_1 = i;
    if (dir_1 < 0 || all.size[i] < all.size[dir_1]) dir_1 = i;
  }
  for (int i = 0; i < all.n; ++i)
    if (!listed(&first, all.name[i]) && i != fp32_1 && i != dir_1) vq_1 = i;
  CHECK(fp32_1 >= 0 && vq_1 >= 0 && dir_1 >= 0);

  /* get: the exact level gives the stored prefix bit for bit, leaving the last token */
  const char* warnings = NULL;
  CHECK(get_into(st, model, CT, levels, NULL, ids, NT, &dst) == 2 * CT);
  CHECK(holds_prefix(dst, pk, pv, 2 * CT));
  EXPECT_OK(vq_store_warnings(st, &warnings));
  CHECK(warnings != NULL && warnings[0] == '\0');
  /* the handle keeps working: the caller appends the rest */
  for (int32_t l = 0; l < SL; ++l) {
    prefix_rows(pk[l], NT - 2 * CT, 2 * CT, rk);
    prefix_rows(pv[l], NT - 2 * CT, 2 * CT, rv);
    EXPECT_OK(vq_cache_append(dst, l, VQ_DTYPE_F32, rk, rv, 1, H, NT - 2 * CT, D));
  }
  CHECK(holds_prefix(dst, pk, pv, NT));
  /* errors: bad arguments, and a handle that is not empty */
  EXPECT_ERR(vq_store_get(st, model, CT, levels, NULL, ids, NT, dst, &reused), VQ_ERR_INVALID_ARGUMENT, "already holds");
  EXPECT_OK(vq_caches_free(dst));
  dst = fresh_fp32();
  EXPECT_ERR(vq_store_get(NULL, model, CT, levels, NULL, ids, NT, dst, &reused), VQ_ERR_INVALID_ARGUMENT, "store is NULL");
  EXPECT_ERR(vq_store_get(st, NULL, CT, levels, NULL, ids, NT, dst, &reused), VQ_ERR_INVALID_ARGUMENT, "model_id is NULL");
  EXPECT_ERR(vq_store_get(st, model, -3, levels, NULL, ids, NT, dst, &reused), VQ_ERR_INVALID_ARGUMENT, "chunk_tokens -3");
  EXPECT_ERR(vq_store_get(st, model, CT, "vq:bits=99", NULL, ids, NT, dst, &reused), VQ_ERR_INVALID_ARGUMENT, "bits");
  EXPECT_ERR(vq_store_get(st, model, CT, levels, "vq:bits=4", ids, NT, dst, &reused), VQ_ERR_INVALID_ARGUMENT, "not one of");
  EXPECT_ERR(vq_store_get(st, model, CT, levels, "nosuch", ids, NT, dst, &reused), VQ_ERR_INVALID_ARGUMENT, "nosuch");
  EXPECT_ERR(vq_store_get(st, model, CT, levels, NULL, NULL, NT, dst, &reused), VQ_ERR_INVALID_ARGUMENT, "tokens is NULL");
  EXPECT_ERR(vq_store_get(st, model, CT, levels, NULL, ids, -1, dst, &reused), VQ_ERR_INVALID_ARGUMENT, "negative");
  EXPECT_ERR(vq_store_get(st, model, CT, levels, NULL, ids, NT, NULL, &reused), VQ_ERR_INVALID_ARGUMENT, "caches is NULL");
  EXPECT_ERR(vq_store_get(st, model, CT, levels, NULL, ids, NT, dst, NULL), VQ_ERR_INVALID_ARGUMENT, "tokens_reused is NULL");
  CHECK(reused == -1 && holds_prefix(dst, pk, pv, 0));
  EXPECT_ERR(vq_store_warnings(NULL, &warnings), VQ_ERR_INVALID_ARGUMENT, "store is NULL");
  EXPECT_ERR(vq_store_warnings(st, NULL), VQ_ERR_INVALID_ARGUMENT, "out is NULL");
  EXPECT_ERR(vq_store_stats(NULL, &blobs, &bytes), VQ_ERR_INVALID_ARGUMENT, "store is NULL");
  EXPECT_ERR(vq_store_stats(st, NULL, &bytes), VQ_ERR_INVALID_ARGUMENT, "blobs is NULL");
  EXPECT_ERR(vq_store_stats(st, &blobs, NULL), VQ_ERR_INVALID_ARGUMENT, "bytes is NULL");
  EXPECT_ERR(vq_store_clear(NULL), VQ_ERR_INVALID_ARGUMENT, "store is NULL");
  EXPECT_OK(vq_caches_free(dst));

  /* what is found: whole chunks of a prefix under the same identity, scheme and tokens only */
  CHECK(get_into(st, model, CT, levels, NULL, ids, 2 * CT, &dst) == CT); /* the last token is left */
  CHECK(holds_prefix(dst, pk, pv, CT));
  EXPECT_OK(vq_caches_free(dst));
  CHECK(get_into(st, model, CT, levels, NULL, ids, CT, &dst) == 0);
  EXPECT_OK(vq_caches_free(dst));
  CHECK(get_into(st, "another-model", CT, levels, NULL, ids, NT, &dst) == 0);
  EXPECT_OK(vq_caches_free(dst));
  CHECK(get_into(st, model, CT / 2, levels, NULL, ids, NT, &dst) == 0);
  EXPECT_OK(vq_caches_free(dst));
  /* a level list only narrows what is found: vq:bits=4 is not stored, fp32 (always allowed) is */
  CHECK(get_into(st, model, CT, "vq:bits=4", NULL, ids, NT, &dst) == 2 * CT);
  EXPECT_OK(vq_caches_free(dst));
  /* neither chunk size nor levels named: both found in the store, and reported */
  const char* report = NULL;
  CHECK(get_into(st, model, 0, NULL, NULL, ids, NT, &dst) == 2 * CT);
  CHECK(holds_prefix(dst, pk, pv, 2 * CT));
  EXPECT_OK(vq_store_report(st, &report));
  CHECK(strstr(report, "\"chunk_tokens\":64") != NULL && strstr(report, "\"status\":\"hit\"") != NULL);
  CHECK(strstr(report, "\"levels\":[\"vq:bits=2,") != NULL && strstr(report, "\"fp32\"]") != NULL); /* canonical specs */
  EXPECT_OK(vq_caches_free(dst));
  /* another identity's prefix: a miss that names why */
  CHECK(get_into(st, "another-model", 0, NULL, NULL, ids, NT, &dst) == 0);
  EXPECT_OK(vq_store_report(st, &report));
  CHECK(strstr(report, "another model") != NULL);
  EXPECT_OK(vq_caches_free(dst));
  EXPECT_ERR(vq_store_report(NULL, &report), VQ_ERR_INVALID_ARGUMENT, "store is NULL");
  EXPECT_ERR(vq_store_report(st, NULL), VQ_ERR_INVALID_ARGUMENT, "out is NULL");
  ids[CT + 1] += 1; /* a prompt that shares only the first chunk */
  CHECK(get_into(st, model, CT, levels, NULL, ids, NT, &dst) == CT);
  CHECK(holds_prefix(dst, pk, pv, CT));
  EXPECT_OK(vq_caches_free(dst));
  ids[CT + 1] -= 1;

  /* a lossy level: each chunk is what a fresh vq:bits=2 cache fed that chunk reads back, bit for
   * bit, and within the level's error budget of the exact K/V */
  CHECK(get_into(st, model, CT, levels, "vq:bits=2", ids, NT, &dst) == 2 * CT);
  {
    double err2 = 0, ref2 = 0;
    for (int32_t l = 0; l < SL; ++l) {
      EXPECT_OK(vq_cache_read(dst, l, VQ_DTYPE_F32, gk, gv, PN));
      for (int64_t i = 0; i < 2; ++i) {
        vq_caches* one = NULL;
        EXPECT_OK(vq_caches_create("vq:bits=2", 1, H, D, &one));
        prefix_rows(pk[l], CT, i * CT, ck);
        prefix_rows(pv[l], CT, i * CT, cv);
        EXPECT_OK(vq_cache_append(one, 0, VQ_DTYPE_F32, ck, cv, 1, H, CT, D));
        EXPECT_OK(vq_cache_read(one, 0, VQ_DTYPE_F32, rk, rv, PN));
        for (int64_t h = 0; h < H; ++h) {
          const float* got_k = gk + (h * 2 * CT + i * CT) * D;
          const float* got_v = gv + (h * 2 * CT + i * CT) * D;
          CHECK(memcmp(got_k, rk + h * CT * D, sizeof(float) * CT * D) == 0);
          CHECK(memcmp(got_v, rv + h * CT * D, sizeof(float) * CT * D) == 0);
          for (int64_t j = 0; j < CT * D; ++j) {
            const double ek = got_k[j] - ck[h * CT * D + j], ev = got_v[j] - cv[h * CT * D + j];
            err2 += ek * ek + ev * ev;
            ref2 += (double)ck[h * CT * D + j] * ck[h * CT * D + j] + (double)cv[h * CT * D + j] * cv[h * CT * D + j];
          }
        }
        EXPECT_OK(vq_caches_free(one));
      }
    }
    /* 2-bit codes: the error's energy is a small part of the signal's, yet not zero (lossy) */
    const double rel = sqrt(err2 / ref2);
    printf("capi_test: vq:bits=2 level, relative RMS error %.4f\n", rel);
    CHECK(rel > 0.0 && rel < VQ2_REL_RMS_BUDGET);
  }
  EXPECT_OK(vq_caches_free(dst));

  /* faults never give a wrong cache: loading stops before the chunk at fault, with a warning */
  snprintf(path, sizeof path, "%s/blobs/%s", dir, all.name[fp32_1]);
  f = fopen(path, "r+b"); /* one flipped byte in chunk 1's exact blob: a checksum fails */
  CHECK(f != NULL);
  if (f) {
    fseek(f, all.size[fp32_1] / 2, SEEK_SET);
    int byte = fgetc(f);
    fseek(f, all.size[fp32_1] / 2, SEEK_SET);
    fputc(byte ^ 0x10, f);
    fclose(f);
  }
  CHECK(get_into(st, model, CT, levels, NULL, ids, NT, &dst) == CT);
  CHECK(holds_prefix(dst, pk, pv, CT));
  EXPECT_OK(vq_store_warnings(st, &warnings));
  CHECK(strstr(warnings, "chunk 1: level fp32 blob rejected") != NULL && strstr(warnings, "left to the caller") != NULL);
  EXPECT_OK(vq_caches_free(dst));
  CHECK(get_into(st, model, CT, levels, "vq:bits=2", ids, NT, &dst) == 2 * CT); /* the other level is intact */
  EXPECT_OK(vq_caches_free(dst));
  snprintf(path, sizeof path, "%s/blobs/%s", dir, all.name[vq_1]);
  CHECK(remove(path) == 0); /* a missing blob */
  CHECK(get_into(st, model, CT, levels, "vq:bits=2", ids, NT, &dst) == CT);
  EXPECT_OK(vq_store_warnings(st, &warnings));
  CHECK(strstr(warnings, "chunk 1:") != NULL && strstr(warnings, "missing") != NULL);
  EXPECT_OK(vq_caches_free(dst));
  snprintf(path, sizeof path, "%s/blobs/%s", dir, all.name[dir_1]);
  f = fopen(path, "wb"); /* a directory blob that is not one */
  CHECK(f != NULL);
  if (f) {
    fputs("{\"garbage\": true}", f);
    fclose(f);
  }
  CHECK(get_into(st, model, CT, levels, NULL, ids, NT, &dst) == CT);
  EXPECT_OK(vq_store_warnings(st, &warnings));
  CHECK(strstr(warnings, "chunk 1: corrupt directory blob") != NULL);
  EXPECT_OK(vq_caches_free(dst));
  /* a handle of another shape: nothing loads */
  EXPECT_OK(vq_caches_create("fp32", SL, H, D / 2, &dst));
  EXPECT_OK(vq_store_get(st, model, CT, levels, NULL, ids, NT, dst, &reused));
  CHECK(reused == 0);
  EXPECT_OK(vq_store_warnings(st, &warnings));
  CHECK(strstr(warnings, "chunk 0:") != NULL);
  EXPECT_OK(vq_cache_tokens(dst, 0, &reused));
  CHECK(reused == 0);
  EXPECT_OK(vq_caches_free(dst));
  EXPECT_OK(vq_caches_create("fp32", SL + 1, H, D, &dst));
  EXPECT_OK(vq_store_get(st, model, CT, levels, NULL, ids, NT, dst, &reused));
  CHECK(reused == 0);
  EXPECT_OK(vq_caches_free(dst));

  /* a sealed store (issue 36): a secret and a namespace in the URL; the same handle kind reads what it
     sealed, a handle without the secret reuses nothing and says why */
  {
    char surl[4400], purl[4400];
    snprintf(surl, sizeof surl, "file:%s/sealed?secret=capi-secret&namespace=capi", scratch);
    snprintf(purl, sizeof purl, "file:%s/sealed?namespace=capi", scratch);
    vq_store *sealed = NULL, *plain = NULL;
    EXPECT_OK(vq_store_open(surl, &sealed));
    EXPECT_OK(vq_store_clear(sealed));
    EXPECT_OK(vq_store_put(sealed, model, CT, levels, ids, NT, src, &stored));
    CHECK(stored == 2 * CT);
    CHECK(get_into(sealed, model, CT, levels, NULL, ids, NT, &dst) == 2 * CT);
    CHECK(holds_prefix(dst, pk, pv, 2 * CT));
    EXPECT_OK(vq_caches_free(dst));
    EXPECT_OK(vq_store_open(purl, &plain));
    CHECK(get_into(plain, model, CT, levels, NULL, ids, NT, &dst) == 0);
    EXPECT_OK(vq_store_warnings(plain, &warnings));
    CHECK(strstr(warnings, "the store has a secret") != NULL && strstr(warnings, "capi-secret") == NULL);
    EXPECT_OK(vq_caches_free(dst));
    EXPECT_OK(vq_store_clear(sealed));
    EXPECT_OK(vq_store_close(plain));
    EXPECT_OK(vq_store_close(sealed));
  }

  /* clear */
  EXPECT_OK(vq_store_clear(st));
  EXPECT_OK(vq_store_stats(st, &blobs, &bytes));
  CHECK(blobs == 0 && bytes == 0);
  CHECK(get_into(st, model, CT, levels, NULL, ids, NT, &dst) == 0);
  EXPECT_OK(vq_caches_free(dst));
  EXPECT_OK(vq_caches_free(src));
  EXPECT_OK(vq_caches_free(src1));
  EXPECT_OK(vq_store_close(st));
}

int main(int argc, char** argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: capi_test SCRATCH_DIR\n");
    return 2;
  }
  static float k[N], v[N], k2[N], v2[N], back_k[N], back_v[N];
  static uint16_t hk[N], hv[N], back_h[N], back_hv[N];
  fill(k, v, S, 0);

  /* version, and the message is empty before any failure */
  const char* version = NULL;
  EXPECT_OK(vq_version(&version));
  CHECK(version != NULL && strcmp(version, "0.1.0") == 0);
  EXPECT_ERR(vq_version(NULL), VQ_ERR_INVALID_ARGUMENT, "out is NULL");

  /* create: bad arguments */
  vq_caches* c = NULL;
  EXPECT_ERR(vq_caches_create(NULL, L, H, D, &c), VQ_ERR_INVALID_ARGUMENT, "method_spec is NULL");
  EXPECT_ERR(vq_caches_create("fp32", L, H, D, NULL), VQ_ERR_INVALID_ARGUMENT, "out is NULL");
  EXPECT_ERR(vq_caches_create("nosuch", L, H, D, &c), VQ_ERR_INVALID_ARGUMENT, "nosuch");
  EXPECT_ERR(vq_caches_create("cachegen:bits=99", L, H, D, &c), VQ_ERR_INVALID_ARGUMENT, "bits");
  EXPECT_ERR(vq_caches_create("fp32", 0, H, D, &c), VQ_ERR_INVALID_ARGUMENT, "n_layers 0");
  EXPECT_ERR(vq_caches_create("fp32", L, 0, D, &c), VQ_ERR_INVALID_ARGUMENT, "kv_heads 0");
  EXPECT_ERR(vq_caches_create("fp32", L, H, 0, &c), VQ_ERR_INVALID_ARGUMENT, "head_dim 0");
  EXPECT_ERR(vq_caches_create("fp32", L, H, 1 << 20, &c), VQ_ERR_INVALID_ARGUMENT, "head_dim 1048576");
  CHECK(c == NULL); /* outputs are written only on success */

  /* fp32: exact round trip through append/read, f32 and f16 reads */
  EXPECT_OK(vq_caches_create("fp32", L, H, D, &c));
  CHECK(c != NULL);
  int32_t layers = 0;
  EXPECT_OK(vq_caches_layers(c, &layers));
  CHECK(layers == L);
  int64_t tokens = -1;
  EXPECT_OK(vq_cache_tokens(c, 0, &tokens));
  CHECK(tokens == 0);
  EXPECT_OK(vq_cache_read(c, 0, VQ_DTYPE_F32, back_k, back_v, 0)); /* empty: nothing to write */
  for (int32_t l = 0; l < L; ++l) {
    EXPECT_OK(vq_cache_append(c, l, VQ_DTYPE_F32, k, v, B, H, S / 2, D)); /* two appends of S/2 tokens */
  }
  /* the second half is appended from contiguous buffers of its own */
  fill(k2, v2, S, 0);
  {
    static float hk2[N / 2], hv2[N / 2];
    for (int64_t h = 0; h < H; ++h) {
      memcpy(hk2 + h * (S / 2) * D, k + (h * S + S / 2) * D, sizeof(float) * (S / 2) * D);
      memcpy(hv2 + h * (S / 2) * D, v + (h * S + S / 2) * D, sizeof(float) * (S / 2) * D);
    }
    /* the first appends took tokens 0..S/2 of a [B,H,S/2,D] view of k's first rows: rebuild the
     * expected cache from what was appended */
    for (int64_t h = 0; h < H; ++h)
      for (int64_t s = 0; s < S / 2; ++s) {
        memcpy(k2 + (h * S + s) * D, k + (h * (S / 2) + s) * D, sizeof(float) * D);
        memcpy(v2 + (h * S + s) * D, v + (h * (S / 2) + s) * D, sizeof(float) * D);
        memcpy(k2 + (h * S + S / 2 + s) * D, hk2 + (h * (S / 2) + s) * D, sizeof(float) * D);
        memcpy(v2 + (h * S + S / 2 + s) * D, hv2 + (h * (S / 2) + s) * D, sizeof(float) * D);
      }
    for (int32_t l = 0; l < L; ++l) EXPECT_OK(vq_cache_append(c, l, VQ_DTYPE_F32, hk2, hv2, B, H, S / 2, D));
  }
  EXPECT_OK(vq_cache_tokens(c, 2, &tokens));
  CHECK(tokens == S);
  EXPECT_OK(vq_cache_read(c, 1, VQ_DTYPE_F32, back_k, back_v, N));
  CHECK(memcmp(back_k, k2, sizeof(float) * N) == 0 && memcmp(back_v, v2, sizeof(float) * N) == 0);
  size_t nbytes = 0;
  EXPECT_OK(vq_cache_nbytes(c, 0, &nbytes));
  CHECK(nbytes >= 2 * sizeof(float) * N);

  /* append and read: every error leaves the cache unchanged */
  EXPECT_ERR(vq_cache_append(NULL, 0, VQ_DTYPE_F32, k, v, B, H, 1, D), VQ_ERR_INVALID_ARGUMENT, "caches is NULL");
  EXPECT_ERR(vq_cache_append(c, L, VQ_DTYPE_F32, k, v, B, H, 1, D), VQ_ERR_INVALID_ARGUMENT, "layer 3 is out of range");
  EXPECT_ERR(vq_cache_append(c, -1, VQ_DTYPE_F32, k, v, B, H, 1, D), VQ_ERR_INVALID_ARGUMENT, "out of range");
  EXPECT_ERR(vq_cache_append(c, 0, VQ_DTYPE_F32, NULL, v, B, H, 1, D), VQ_ERR_INVALID_ARGUMENT, "keys is NULL");
  EXPECT_ERR(vq_cache_append(c, 0, VQ_DTYPE_F32, k, NULL, B, H, 1, D), VQ_ERR_INVALID_ARGUMENT, "values is NULL");
  EXPECT_ERR(vq_cache_append(c, 0, (vq_dtype)7, k, v, B, H, 1, D), VQ_ERR_INVALID_ARGUMENT, "dtype 7");
  EXPECT_ERR(vq_cache_append(c, 0, VQ_DTYPE_F32, k, v, B, H + 1, 1, D), VQ_ERR_INVALID_ARGUMENT, "KV heads");
  EXPECT_ERR(vq_cache_append(c, 0, VQ_DTYPE_F32, k, v, B, H, 1, D - 1), VQ_ERR_INVALID_ARGUMENT, "head_dim 15");
  EXPECT_ERR(vq_cache_append(c, 0, VQ_DTYPE_F32, k, v, B, H, -1, D), VQ_ERR_INVALID_ARGUMENT, "negative");
  EXPECT_ERR(vq_cache_append(c, 0, VQ_DTYPE_F32, k, v, B, H, 0, D), VQ_ERR_INVALID_ARGUMENT, "at least 1");
  EXPECT_ERR(vq_cache_append(c, 0, VQ_DTYPE_F32, k, v, 2, H, 1, D), VQ_ERR_INVALID_ARGUMENT, "");  /* batch change */
  EXPECT_ERR(vq_cache_append(c, 0, VQ_DTYPE_F32, k, v, INT64_MAX, H, INT64_MAX, D), VQ_ERR_INVALID_ARGUMENT, "");
  EXPECT_ERR(vq_cache_append(c, 0, VQ_DTYPE_F16, hk, hv, B, H, 1, D), VQ_ERR_INVALID_ARGUMENT, ""); /* dtype change */
  EXPECT_OK(vq_cache_tokens(c, 0, &tokens));
  CHECK(tokens == S);
  EXPECT_ERR(vq_cache_tokens(c, 0, NULL), VQ_ERR_INVALID_ARGUMENT, "tokens is NULL");
  EXPECT_ERR(vq_cache_tokens(NULL, 0, &tokens), VQ_ERR_INVALID_ARGUMENT, "caches is NULL");
  EXPECT_ERR(vq_cache_nbytes(c, 9, &nbytes), VQ_ERR_INVALID_ARGUMENT, "out of range");
  EXPECT_ERR(vq_cache_nbytes(c, 0, NULL), VQ_ERR_INVALID_ARGUMENT, "nbytes is NULL");
  EXPECT_ERR(vq_caches_layers(NULL, &layers), VQ_ERR_INVALID_ARGUMENT, "caches is NULL");
  EXPECT_ERR(vq_caches_layers(c, NULL), VQ_ERR_INVALID_ARGUMENT, "n_layers is NULL");
  EXPECT_ERR(vq_cache_read(c, 0, VQ_DTYPE_F32, back_k, back_v, N - 1), VQ_ERR_INVALID_ARGUMENT, "capacity");
  EXPECT_ERR(vq_cache_read(c, 0, VQ_DTYPE_F32, NULL, back_v, N), VQ_ERR_INVALID_ARGUMENT, "keys_out is NULL");
  EXPECT_ERR(vq_cache_read(c, 0, VQ_DTYPE_F32, back_k, NULL, N), VQ_ERR_INVALID_ARGUMENT, "values_out is NULL");
  EXPECT_ERR(vq_cache_read(c, 0, (vq_dtype)-1, back_k, back_v, N), VQ_ERR_INVALID_ARGUMENT, "dtype -1");
  EXPECT_ERR(vq_cache_read(NULL, 0, VQ_DTYPE_F32, back_k, back_v, N), VQ_ERR_INVALID_ARGUMENT, "caches is NULL");

  /* attend: against a plain reference on the fp32 cache */
  {
    enum { QH = 4 };
    static float q[B * QH * D], out[B * QH * D], want[B * QH * D];
    for (int i = 0; i < B * QH * D; ++i) q[i] = (float)sin(0.37 * i);
    const float scale = 0.25f;
    EXPECT_OK(vq_cache_attend(c, 1, q, B, QH, 1, D, scale, out, B * QH * D));
    attend_last(k2, v2, q, QH, scale, want);
    CHECK(max_abs_diff(out, want, B * QH * D) < 1e-5);
    EXPECT_ERR(vq_cache_attend(NULL, 0, q, B, QH, 1, D, scale, out, B * QH * D), VQ_ERR_INVALID_ARGUMENT, "caches is NULL");
    EXPECT_ERR(vq_cache_attend(c, 0, NULL, B, QH, 1, D, scale, out, B * QH * D), VQ_ERR_INVALID_ARGUMENT, "queries is NULL");
    EXPECT_ERR(vq_cache_attend(c, 0, q, B, QH, 1, D, scale, NULL, B * QH * D), VQ_ERR_INVALID_ARGUMENT, "out is NULL");
    EXPECT_ERR(vq_cache_attend(c, 0, q, B, QH, 1, D, scale, out, B * QH * D - 1), VQ_ERR_INVALID_ARGUMENT, "capacity");
    EXPECT_ERR(vq_cache_attend(c, 0, q, B, 3, 1, D, scale, out, B * QH * D), VQ_ERR_INVALID_ARGUMENT, "");  /* 3 % 2 */
    EXPECT_ERR(vq_cache_attend(c, 0, q, B, QH, 1, D / 2, scale, out, B * QH * D), VQ_ERR_INVALID_ARGUMENT, "");
    EXPECT_ERR(vq_cache_attend(c, 0, q, B, QH, 0, D, scale, out, B * QH * D), VQ_ERR_INVALID_ARGUMENT, "at least 1");
    EXPECT_ERR(vq_cache_attend(c, 0, q, B, QH, 1, D, NAN, out, B * QH * D), VQ_ERR_INVALID_ARGUMENT, "");
  }

  /* encode / decode: bit-exact, and every corruption is a format error */
  uint8_t* bytes = NULL;
  size_t size = 0;
  EXPECT_OK(vq_caches_encode(c, &bytes, &size));
  CHECK(bytes != NULL && size > 2 * sizeof(float) * N);
  vq_caches* d = NULL;
  EXPECT_OK(vq_caches_decode(bytes, size, &d));
  EXPECT_OK(vq_caches_layers(d, &layers));
  CHECK(layers == L);
  memset(back_k, 0, sizeof back_k);
  EXPECT_OK(vq_cache_read(d, 2, VQ_DTYPE_F32, back_k, back_v, N));
  CHECK(memcmp(back_k, k2, sizeof(float) * N) == 0 && memcmp(back_v, v2, sizeof(float) * N) == 0);
  /* a decoded handle keeps working: one more token */
  EXPECT_OK(vq_cache_append(d, 0, VQ_DTYPE_F32, k, v, B, H, 1, D));
  EXPECT_OK(vq_cache_tokens(d, 0, &tokens));
  CHECK(tokens == S + 1);
  EXPECT_ERR(vq_cache_append(d, 0, VQ_DTYPE_F32, k, v, B, H + 1, 1, D), VQ_ERR_INVALID_ARGUMENT, "KV heads");
  EXPECT_OK(vq_caches_free(d));
  d = NULL;
  EXPECT_ERR(vq_caches_decode(bytes, size - 1, &d), VQ_ERR_FORMAT, "");
  EXPECT_ERR(vq_caches_decode(bytes, 7, &d), VQ_ERR_FORMAT, "");
  bytes[size / 2] ^= 0x40; /* one flipped bit: a checksum fails */
  EXPECT_ERR(vq_caches_decode(bytes, size, &d), VQ_ERR_FORMAT, "");
  bytes[size / 2] ^= 0x40;
  bytes[0] ^= 0xff; /* not a .vqkv at all */
  EXPECT_ERR(vq_caches_decode(bytes, size, &d), VQ_ERR_FORMAT, "");
  CHECK(d == NULL);
  EXPECT_ERR(vq_caches_decode(NULL, size, &d), VQ_ERR_INVALID_ARGUMENT, "bytes is NULL");
  EXPECT_ERR(vq_caches_decode(bytes, size, NULL), VQ_ERR_INVALID_ARGUMENT, "out is NULL");
  EXPECT_ERR(vq_caches_encode(NULL, &bytes, &size), VQ_ERR_INVALID_ARGUMENT, "caches is NULL");
  EXPECT_ERR(vq_caches_encode(c, NULL, &size), VQ_ERR_INVALID_ARGUMENT, "bytes is NULL");
  EXPECT_ERR(vq_caches_encode(c, &bytes, NULL), VQ_ERR_INVALID_ARGUMENT, "size is NULL");
  EXPECT_OK(vq_bytes_free(bytes));
  EXPECT_OK(vq_bytes_free(NULL));

  /* save / load through a file */
  char path[4096], bad[4096];
  snprintf(path, sizeof path, "%s/capi_test.vqkv", argv[1]);
  snprintf(bad, sizeof bad, "%s/no/such/dir/x.vqkv", argv[1]);
  EXPECT_OK(vq_caches_save(c, path));
  EXPECT_OK(vq_caches_load(path, &d));
  EXPECT_OK(vq_cache_read(d, 0, VQ_DTYPE_F32, back_k, back_v, N));
  CHECK(memcmp(back_k, k2, sizeof(float) * N) == 0 && memcmp(back_v, v2, sizeof(float) * N) == 0);
  EXPECT_OK(vq_caches_free(d));
  d = NULL;
  EXPECT_ERR(vq_caches_save(c, bad), VQ_ERR_IO, "");
  EXPECT_ERR(vq_caches_save(NULL, path), VQ_ERR_INVALID_ARGUMENT, "caches is NULL");
  EXPECT_ERR(vq_caches_save(c, NULL), VQ_ERR_INVALID_ARGUMENT, "path is NULL");
  EXPECT_ERR(vq_caches_load(bad, &d), VQ_ERR_IO, "");
  EXPECT_ERR(vq_caches_load(argv[1], &d), VQ_ERR_IO, "directory"); /* a directory is refused */
  EXPECT_ERR(vq_caches_load(NULL, &d), VQ_ERR_INVALID_ARGUMENT, "path is NULL");
  EXPECT_ERR(vq_caches_load(path, NULL), VQ_ERR_INVALID_ARGUMENT, "out is NULL");
  {
    FILE* f = fopen(path, "wb"); /* a truncated file */
    CHECK(f != NULL);
    if (f) {
      fwrite("VQKV", 1, 4, f);
      fclose(f);
    }
    EXPECT_ERR(vq_caches_load(path, &d), VQ_ERR_FORMAT, "");
    remove(path);
  }
  EXPECT_OK(vq_caches_free(c));
  EXPECT_OK(vq_caches_free(NULL));

  /* float16 input, a lossy method (cachegen): read back within its error budget, and attend */
  for (size_t i = 0; i < N; ++i) {
    hk[i] = to_half(k2[i]);
    hv[i] = to_half(v2[i]);
  }
  EXPECT_OK(vq_caches_create("cachegen:bits=4,schedule=off", 2, H, D, &c));
  EXPECT_OK(vq_cache_append(c, 0, VQ_DTYPE_F16, hk, hv, B, H, S, D));
  EXPECT_OK(vq_cache_read(c, 0, VQ_DTYPE_F16, back_h, back_hv, N));
  EXPECT_OK(vq_cache_read(c, 0, VQ_DTYPE_F32, back_k, back_v, N));
  /* 4-bit codes over a group of 32 tokens: at most half a step of the range (~2.25 * 2 / 15 / 2) off */
  CHECK(max_abs_diff(back_k, k2, N) < 0.16);
  CHECK(max_abs_diff(back_v, v2, N) < 0.08);
  CHECK(max_abs_diff(back_k, k2, N) > 0.0); /* lossy indeed */
  EXPECT_OK(vq_caches_encode(c, &bytes, &size));
  EXPECT_OK(vq_caches_decode(bytes, size, &d));
  EXPECT_OK(vq_cache_read(d, 0, VQ_DTYPE_F16, hk, hv, N));
  CHECK(memcmp(hk, back_h, sizeof(uint16_t) * N) == 0 && memcmp(hv, back_hv, sizeof(uint16_t) * N) == 0);
  EXPECT_OK(vq_bytes_free(bytes));
  EXPECT_OK(vq_caches_free(d));
  EXPECT_OK(vq_caches_free(c));

  /* a resident method: attend matches attention over what it reads back; the format cannot hold it */
  EXPECT_OK(vq_caches_create("q8_0", 1, H, D, &c));
  EXPECT_OK(vq_cache_append(c, 0, VQ_DTYPE_F32, k2, v2, B, H, S, D));
  EXPECT_OK(vq_cache_read(c, 0, VQ_DTYPE_F32, back_k, back_v, N));
  CHECK(max_abs_diff(back_k, k2, N) < 0.05);
  {
    static float q[B * H * D], out[B * H * D], want[B * H * D];
    for (int i = 0; i < B * H * D; ++i) q[i] = (float)cos(0.11 * i);
    EXPECT_OK(vq_cache_attend(c, 0, q, B, H, 1, D, 0.3f, out, B * H * D));
    attend_last(back_k, back_v, q, H, 0.3f, want);
    CHECK(max_abs_diff(out, want, B * H * D) < 1e-4);
  }
  EXPECT_ERR(vq_caches_encode(c, &bytes, &size), VQ_ERR_INVALID_ARGUMENT, "");
  EXPECT_OK(vq_caches_free(c));

  test_store(argv[1]);

  /* the message is per thread and cleared by a success */
  EXPECT_ERR(vq_caches_create("nosuch", 1, 1, 1, &c), VQ_ERR_INVALID_ARGUMENT, "nosuch");
  EXPECT_OK(vq_version(&version));
  CHECK(strcmp(vq_last_error(), "") == 0);

  if (failures) fprintf(stderr, "capi_test: %d checks failed\n", failures);
  else printf("capi_test: all checks passed\n");
  return failures ? 1 : 0;
}
