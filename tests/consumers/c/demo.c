/* A C program built against the INSTALLED veloxquant with pkg-config only:
 *     cc demo.c $(pkg-config --cflags --libs veloxquant)
 * It compresses a small synthetic K/V cache with CacheGen at 4 bits, round-trips it through .vqkv
 * bytes and prints the sizes. Exits 1 (with veloxquant's message) on any error. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include <veloxquant/veloxquant.h>

#define TRY(call)                                                   \
  do {                                                              \
    if ((call) != VQ_OK) {                                          \
      fprintf(stderr, "demo: %s: %s\n", #call, vq_last_error());    \
      return 1;                                                     \
    }                                                               \
  } while (0)

enum { H = 4, S = 256, D = 64 };
static float k[H * S * D], v[H * S * D], k2[H * S * D], v2[H * S * D];

int main(void) {
  for (int i = 0; i < H * S * D; ++i) {
    k[i] = (float)sin(0.01 * i);
    v[i] = (float)cos(0.02 * i);
  }
  vq_caches *c = NULL, *d = NULL;
  TRY(vq_caches_create("cachegen:bits=4", 2, H, D, &c));
  TRY(vq_cache_append(c, 0, VQ_DTYPE_F32, k, v, 1, H, S, D));
  uint8_t* bytes = NULL;
  size_t size = 0;
  TRY(vq_caches_encode(c, &bytes, &size));
  TRY(vq_caches_decode(bytes, size, &d));
  float* outs[2][2] = {{k, v}, {k2, v2}};
  TRY(vq_cache_read(c, 0, VQ_DTYPE_F32, outs[0][0], outs[0][1], H * S * D));
  TRY(vq_cache_read(d, 0, VQ_DTYPE_F32, outs[1][0], outs[1][1], H * S * D));
  int same = memcmp(k, k2, sizeof k) == 0 && memcmp(v, v2, sizeof v) == 0;
  printf("demo: %zu bytes for %d float32 elements (%.2f bits per element), decoded %s\n", size, 2 * H * S * D,
         8.0 * (double)size / (2.0 * H * S * D), same ? "bit-exact" : "DIFFERENT");
  vq_bytes_free(bytes);
  vq_caches_free(d);
  vq_caches_free(c);
  return same ? 0 : 1;
}
