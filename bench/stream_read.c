/* The machine's memory-read limit: THREADS threads, each summing its own MB-megabyte array of uint64 (allocated
 * and first touched by that thread) as STREAMS sequential streams (default 8, below), all starting together at a
 * barrier; a repetition takes as long as its slowest thread; the best of REPS repetitions is kept. Prints one JSON
 * line.
 *
 *     gcc -O3 -march=native -pthread -o stream_read stream_read.c && ./stream_read 256 2 30
 *
 * bench/bench_llamacpp.py compiles and runs it (the GEMV of bench_decode.job_bandwidth under-measures the limit:
 * llama.cpp decoded above that roofline). The sum is over integers, so -O3 vectorizes it without -ffast-math. */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static size_t n_words;
static int reps;
static pthread_barrier_t barrier;
static double *seconds;        /* [thread][rep] */
static volatile uint64_t sink;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* STREAMS equal parts of the array summed in lockstep: that many sequential streams at once. One stream per thread
 * under-measured this project's Intel Xeon: the hardware prefetcher follows a stream within a 4 KB page, and a GEMV
 * reading 8 weight rows at a time read 1.3-1.5x one stream's rate (bench/results/gemv-streams-xeon.md). */
static int streams = 8;

static uint64_t sum(const uint64_t *a, size_t n) {
    uint64_t s = 0;
    if (streams == 8) {
        size_t m = n / 8;
        const uint64_t *p0 = a, *p1 = a + m, *p2 = a + 2 * m, *p3 = a + 3 * m, *p4 = a + 4 * m, *p5 = a + 5 * m,
                       *p6 = a + 6 * m, *p7 = a + 7 * m;
        uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0, s4 = 0, s5 = 0, s6 = 0, s7 = 0;
        for (size_t i = 0; i < m; i++) {
            s0 += p0[i]; s1 += p1[i]; s2 += p2[i]; s3 += p3[i];
            s4 += p4[i]; s5 += p5[i]; s6 += p6[i]; s7 += p7[i];
        }
        for (size_t i = 8 * m; i < n; i++) s += a[i];
        return s + s0 + s1 + s2 + s3 + s4 + s5 + s6 + s7;
    }
    for (size_t i = 0; i < n; i++) s += a[i];
    return s;
}

static void *worker(void *arg) {
    int id = (int)(intptr_t)arg;
    uint64_t *a = malloc(n_words * sizeof(uint64_t));
    if (!a) { perror("malloc"); exit(1); }
    for (size_t i = 0; i < n_words; i++) a[i] = i ^ (uint64_t)id;
    sink += sum(a, n_words);                      /* warm-up */
    for (int r = 0; r < reps; r++) {
        pthread_barrier_wait(&barrier);
        double t0 = now();
        sink += sum(a, n_words);
        seconds[id * reps + r] = now() - t0;
    }
    free(a);
    return NULL;
}

static int cmp(const void *x, const void *y) {
    double a = *(const double *)x, b = *(const double *)y;
    return (a > b) - (a < b);
}

int main(int argc, char **argv) {
    if (argc != 4 && argc != 5) { fprintf(stderr, "usage: %s MB_PER_THREAD THREADS REPS [STREAMS: 1 or 8]\n", argv[0]); return 2; }
    if (argc == 5) streams = atoi(argv[4]);
    if (streams != 1 && streams != 8) { fprintf(stderr, "STREAMS must be 1 or 8\n"); return 2; }
    size_t mb = strtoul(argv[1], NULL, 10);
    int threads = atoi(argv[2]);
    reps = atoi(argv[3]);
    if (mb < 1 || threads < 1 || reps < 1) { fprintf(stderr, "all arguments must be >= 1\n"); return 2; }
    n_words = mb * (1u << 20) / sizeof(uint64_t);
    seconds = calloc((size_t)threads * reps, sizeof(double));
    pthread_barrier_init(&barrier, NULL, threads);
    pthread_t *t = malloc(threads * sizeof(pthread_t));
    for (int i = 0; i < threads; i++) pthread_create(&t[i], NULL, worker, (void *)(intptr_t)i);
    for (int i = 0; i < threads; i++) pthread_join(t[i], NULL);
    double *slowest = calloc(reps, sizeof(double));
    for (int r = 0; r < reps; r++)
        for (int i = 0; i < threads; i++)
            if (seconds[i * reps + r] > slowest[r]) slowest[r] = seconds[i * reps + r];
    qsort(slowest, reps, sizeof(double), cmp);
    double bytes = (double)n_words * sizeof(uint64_t) * threads;
    printf("{\"threads\": %d, \"streams\": %d, \"mb_per_thread\": %zu, \"reps\": %d, \"best_s\": %.9f, \"median_s\": %.9f, "
           "\"bytes_per_s\": %.1f, \"median_bytes_per_s\": %.1f}\n", threads, streams, mb, reps, slowest[0],
           slowest[reps / 2], bytes / slowest[0], bytes / slowest[reps / 2]);
    return 0;
}
