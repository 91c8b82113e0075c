/* Memory read bandwidth: how fast the engine's threads can stream a buffer far larger than the
 * last-level cache. Decode of a quantized model reads every weight once per token, so this is the
 * ceiling a decode GEMV is judged against (issue 30).
 *
 * The buffer is summed as 64-bit integers: an integer vector add has one cycle of latency, so a
 * few independent accumulators keep every core limited by memory, never by the add chain (a float
 * sum would also depend on -ffast-math to vectorize at all). */

#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

/* Each thread sums a contiguous range, the same range it wrote when the pages were first touched
 * (static schedule both times), so on a NUMA machine each thread reads memory local to it. */
static uint64_t sum_range(const uint64_t *p, int64_t n) {
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0, s4 = 0, s5 = 0, s6 = 0, s7 = 0;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        s0 += p[i]; s1 += p[i + 1]; s2 += p[i + 2]; s3 += p[i + 3];
        s4 += p[i + 4]; s5 += p[i + 5]; s6 += p[i + 6]; s7 += p[i + 7];
    }
    for (; i < n; i++) s0 += p[i];
    return s0 + s1 + s2 + s3 + s4 + s5 + s6 + s7;
}

static uint64_t read_all(const uint64_t *buf, int64_t n, int threads) {
    uint64_t total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t per = (n + nt - 1) / nt, lo = (int64_t)t * per, hi = lo + per < n ? lo + per : n;
        if (lo < hi) total += sum_range(buf + lo, hi - lo);
    }
    return total;
}

/* Allocate `bytes` (rounded down to 64-byte lines), touch it with `threads` threads, read it once
 * to warm the TLB, then time `reps` full reads. seconds[r] gets each read's wall time; seconds[0]
 * is -1 when the buffer cannot be allocated. *sink gets the last sum, so no read is optimized out. */
void bw_measure(int64_t bytes, int threads, int reps, double *seconds, uint64_t *sink) {
    int64_t n = bytes / 64 * 8;
    uint64_t *buf = NULL;
    if (n <= 0 || posix_memalign((void **)&buf, 64, (size_t)n * sizeof(uint64_t)) != 0) {
        seconds[0] = -1.0;
        return;
    }
#pragma omp parallel num_threads(threads)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t per = (n + nt - 1) / nt, lo = (int64_t)t * per, hi = lo + per < n ? lo + per : n;
        for (int64_t i = lo; i < hi; i++) buf[i] = (uint64_t)i;
    }
    uint64_t s = read_all(buf, n, threads);
    for (int r = 0; r < reps; r++) {
        double t0 = omp_get_wtime();
        s += read_all(buf, n, threads);
        seconds[r] = omp_get_wtime() - t0;
    }
    *sink = s;
    free(buf);
}
