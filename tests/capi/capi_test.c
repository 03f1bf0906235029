/* The C API (veloxquant/veloxquant.h) from C: every function, its results and every error path
 * (NULL handles and pointers, bad specs, wrong shapes and dtypes, small buffers, corrupt bytes,
 * unreadable files). Compiled as C11 and run by ctest (capi_test); argv[1] is a scratch directory.
 * Prints one line per failed check and exits 1 if any failed. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

  /* the message is per thread and cleared by a success */
  EXPECT_ERR(vq_caches_create("nosuch", 1, 1, 1, &c), VQ_ERR_INVALID_ARGUMENT, "nosuch");
  EXPECT_OK(vq_version(&version));
  CHECK(strcmp(vq_last_error(), "") == 0);

  if (failures) fprintf(stderr, "capi_test: %d checks failed\n", failures);
  else printf("capi_test: all checks passed\n");
  return failures ? 1 : 0;
}
