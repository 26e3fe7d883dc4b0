/* Where a virtual machine's host has put two of its CPUs, as a benchmark's two threads meet them: how long a cache
 * line takes between them (tandem_round_trip_ns) and how fast each computes while both do (tandem_madd_rates). */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>

#define ABANDONED -2

static _Alignas(64) atomic_long turn;

/* Pins the calling thread to `cpu`; nonzero where it may not be. */
static int pin_to(int cpu)
{
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    return pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

static double ns_between(struct timespec start, struct timespec end)
{
    return (end.tv_sec - start.tv_sec) * 1e9 + (end.tv_nsec - start.tv_nsec);
}

typedef struct {
    int cpu, parity;
    long trips;
} player;

/* takes the turns of its parity: waits for the line to hold its turn, then hands the next one over */
static void *play(void *argument)
{
    const player *me = argument;
    if (pin_to(me->cpu)) {
        atomic_store(&turn, ABANDONED);
        return (void *)1;
    }
    for (long t = me->parity; t < 2 * me->trips; t += 2) {
        long now;
        while ((now = atomic_load_explicit(&turn, memory_order_acquire)) != t)
            if (now == ABANDONED)
                return (void *)1;
        atomic_store_explicit(&turn, t + 1, memory_order_release);
    }
    return NULL;
}

/* Nanoseconds for one cache line to go from a thread on one CPU to a thread on another and back, averaged over
 * `trips`: tens where the two CPUs share a last-level cache, several times that where they do not (another CCD
 * of an AMD EPYC, another socket). Returns -1 where a thread cannot be made or pinned to its CPU. */
double tandem_round_trip_ns(int first_cpu, int second_cpu, long trips)
{
    player players[2] = {{first_cpu, 0, trips}, {second_cpu, 1, trips}};
    pthread_t threads[2];
    void *failed[2] = {(void *)1, (void *)1};
    struct timespec start, end;
    atomic_store(&turn, -1);
    int made = 0;
    while (made < 2 && !pthread_create(&threads[made], NULL, play, &players[made]))
        made++;
    clock_gettime(CLOCK_MONOTONIC, &start);
    long expected = -1;
    atomic_compare_exchange_strong(&turn, &expected, made == 2 ? 0 : ABANDONED);
    for (int i = 0; i < made; i++)
        pthread_join(threads[i], &failed[i]);
    clock_gettime(CLOCK_MONOTONIC, &end);
    if (made < 2 || failed[0] || failed[1])
        return -1;
    return ns_between(start, end) / trips;
}

typedef double pair __attribute__((vector_size(16)));

typedef struct {
    int cpu;
    long steps;
    double rate;
} counter;

static void *count(void *argument)
{
    counter *me = argument;
    if (pin_to(me->cpu)) {
        me->rate = -1;
        return NULL;
    }
    volatile double seed = 1.0;
    const pair factor = {0.999999, 0.999999}, term = {1e-7, 1e-7};
    /* eight independent chains of two lanes, in registers: enough to keep a core's floating-point units busy */
    pair a = {seed, seed}, b = a + 1, c = a + 2, d = a + 3, e = a + 4, f = a + 5, g = a + 6, h = a + 7;
    struct timespec start, end;
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (long s = 0; s < me->steps; s++) {
        a = a * factor + term, b = b * factor + term, c = c * factor + term, d = d * factor + term;
        e = e * factor + term, f = f * factor + term, g = g * factor + term, h = h * factor + term;
    }
    clock_gettime(CLOCK_MONOTONIC, &end);
    pair total = a + b + c + d + e + f + g + h;
    seed = total[0] + total[1];
    me->rate = 16.0 * me->steps / ns_between(start, end);
    return NULL;
}

/* Billions of multiply-adds a second that each of two CPUs runs while the other runs the same, `steps` of 16
 * each, into rates[0] and rates[1]: equal on an idle host, apart where one CPU shares its core or its clock with
 * other work. Returns -1 where a thread cannot be made or pinned to its CPU. */
int tandem_madd_rates(int first_cpu, int second_cpu, long steps, double rates[2])
{
    counter counters[2] = {{first_cpu, steps, -1}, {second_cpu, steps, -1}};
    pthread_t threads[2];
    int made = 0;
    while (made < 2 && !pthread_create(&threads[made], NULL, count, &counters[made]))
        made++;
    for (int i = 0; i < made; i++)
        pthread_join(threads[i], NULL);
    rates[0] = counters[0].rate;
    rates[1] = counters[1].rate;
    return made == 2 && rates[0] > 0 && rates[1] > 0 ? 0 : -1;
}
