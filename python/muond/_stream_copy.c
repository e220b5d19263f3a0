/* Streaming host copies for the Python client: memcpy whose stores bypass the caches.
 *
 * A shm step copies every gradient into the shared region and every parameter out of it; for the
 * large steps this is for, the data is far larger than the caches, so ordinary stores first read
 * each destination line in (a third stream of memory traffic) and evict what the next pass needs.
 * Non-temporal stores write the line without reading it. glibc's memcpy only streams above a
 * threshold derived from the caches (240 MiB on a 2-vCPU EPYC with 32 MiB of L3); torch's copy_
 * never does.
 *
 * Plain C with no Python API: the client loads it with ctypes (muond/transport/stream_copy.py),
 * which releases the GIL around each call, so several threads can copy at once. Stateless and
 * thread-safe. On a CPU without SSE2 streaming stores (not x86-64) it is memcpy.
 */

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define MUOND_X86 1
#endif

#define MUOND_EXPORT __attribute__((visibility("default")))

#ifdef MUOND_X86

/* Copies `bytes` from `src` to `dst`, whose alignment to `width` the caller has made. */
static void stream_sse2(char* dst, const char* src, size_t bytes) {
  size_t i = 0;
  for (; i + 64 <= bytes; i += 64) {
    const __m128i a = _mm_loadu_si128((const __m128i*)(src + i));
    const __m128i b = _mm_loadu_si128((const __m128i*)(src + i + 16));
    const __m128i c = _mm_loadu_si128((const __m128i*)(src + i + 32));
    const __m128i d = _mm_loadu_si128((const __m128i*)(src + i + 48));
    _mm_stream_si128((__m128i*)(dst + i), a);
    _mm_stream_si128((__m128i*)(dst + i + 16), b);
    _mm_stream_si128((__m128i*)(dst + i + 32), c);
    _mm_stream_si128((__m128i*)(dst + i + 48), d);
  }
  memcpy(dst + i, src + i, bytes - i);
}

__attribute__((target("avx"))) static void stream_avx(char* dst, const char* src, size_t bytes) {
  size_t i = 0;
  for (; i + 128 <= bytes; i += 128) {
    const __m256i a = _mm256_loadu_si256((const __m256i*)(src + i));
    const __m256i b = _mm256_loadu_si256((const __m256i*)(src + i + 32));
    const __m256i c = _mm256_loadu_si256((const __m256i*)(src + i + 64));
    const __m256i d = _mm256_loadu_si256((const __m256i*)(src + i + 96));
    _mm256_stream_si256((__m256i*)(dst + i), a);
    _mm256_stream_si256((__m256i*)(dst + i + 32), b);
    _mm256_stream_si256((__m256i*)(dst + i + 64), c);
    _mm256_stream_si256((__m256i*)(dst + i + 96), d);
  }
  memcpy(dst + i, src + i, bytes - i);
}

static int has_avx(void) {
  static int known = -1; /* a benign race: every thread computes the same value */
  if (known < 0) known = __builtin_cpu_supports("avx") ? 1 : 0;
  return known;
}

#endif /* MUOND_X86 */

/* Which stores muond_stream_copy uses on this CPU: "avx", "sse2" or "memcpy". */
MUOND_EXPORT const char* muond_stream_copy_kind(void) {
#ifdef MUOND_X86
  return has_avx() ? "avx" : "sse2";
#else
  return "memcpy";
#endif
}

/* memcpy(dst, src, bytes) with streaming stores; the regions must not overlap. Every store is
 * globally visible when it returns (a store fence), like memcpy's. `sse2_only` keeps to 16-byte
 * stores on a CPU that has AVX (what a CPU without it runs). */
MUOND_EXPORT void muond_stream_copy(void* dst, const void* src, size_t bytes, int sse2_only) {
#ifdef MUOND_X86
  const size_t width = has_avx() && !sse2_only ? 32 : 16;
  size_t head = (width - ((uintptr_t)dst & (width - 1))) & (width - 1);
  if (head > bytes) head = bytes;
  memcpy(dst, src, head);
  char* d = (char*)dst + head;
  const char* s = (const char*)src + head;
  if (width == 32) {
    stream_avx(d, s, bytes - head);
  } else {
    stream_sse2(d, s, bytes - head);
  }
  _mm_sfence();
#else
  (void)sse2_only;
  memcpy(dst, src, bytes);
#endif
}
