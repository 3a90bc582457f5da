/* The CPU's float32 multiply-add peak: independent chains of vector fused
 * multiply-adds that stay in registers (no memory traffic), on 1..N threads.
 *
 *   cc -O2 -march=native -fopenmp benchmarks/peak.c -o /tmp/peak && /tmp/peak 2
 *
 * prints one line per thread count, "threads T: G GFLOP/s", each the best of
 * five timed runs: from FIRST (default 1) to THREADS (default: all CPUs).
 * benchmarks/peak.py compiles and runs it, for `python benchmarks/micro.py
 * peak` and for bench.py's report.
 * No GEMM can beat this figure; it bounds what any implementation of the
 * model can reach on the machine.
 */
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#if defined(__AVX512F__)
#define WIDTH 16 /* one 512-bit register */
#elif defined(__AVX__)
#define WIDTH 8
#else
#define WIDTH 4
#endif
#define CHAINS 12 /* enough independent chains to cover the multiply-add's latency */

typedef float vec __attribute__((vector_size(WIDTH * sizeof(float))));

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

/* Runs `iterations` rounds of CHAINS multiply-adds and returns a value that
 * depends on all of them, so the compiler keeps them. */
static float chains(long iterations, float scale, float shift) {
    vec acc[CHAINS], m, a;
    for (int j = 0; j < WIDTH; j++) {
        m[j] = scale;
        a[j] = shift;
    }
    for (int c = 0; c < CHAINS; c++)
        for (int j = 0; j < WIDTH; j++) acc[c][j] = (float)(c + j);
    for (long i = 0; i < iterations; i++) {
#pragma GCC unroll 12
        for (int c = 0; c < CHAINS; c++) acc[c] = acc[c] * m + a;
    }
    float total = 0;
    for (int c = 0; c < CHAINS; c++)
        for (int j = 0; j < WIDTH; j++) total += acc[c][j];
    return total;
}

int main(int argc, char **argv) {
    int most = argc > 1 ? atoi(argv[1]) : omp_get_num_procs();
    long iterations = argc > 2 ? atol(argv[2]) : 20000000L;
    /* From the command line, so the compiler cannot fold the loop. */
    float scale = 0.999999f + (argc > 3 ? (float)atof(argv[3]) : 0.0f), shift = 1e-6f;
    int first = argc > 4 ? atoi(argv[4]) : 1;
    if (most < 1 || iterations < 1 || first < 1 || first > most) {
        fprintf(stderr, "usage: peak [THREADS >= 1] [ITERATIONS >= 1] [SCALE] [FIRST in 1..THREADS]\n");
        return 2;
    }
    printf("vector width %d floats, %d chains\n", WIDTH, CHAINS);
    for (int threads = first; threads <= most; threads++) {
        double best = 0;
        volatile float sink = 0;
        for (int run = 0; run < 5; run++) {
            double start = now();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
            sink += chains(iterations, scale, shift);
            double seconds = now() - start;
            double flops = 2.0 * WIDTH * CHAINS * (double)iterations * threads;
            if (flops / seconds > best) best = flops / seconds;
        }
        printf("threads %d: %.1f GFLOP/s\n", threads, best / 1e9);
    }
    return 0;
}
