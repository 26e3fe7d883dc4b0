/* CPU kernels for the steps of a float32 model, on AVX2 + FMA + F16C; work is shared out between
 * `threads` OpenMP threads of torch's own libgomp (already loaded when this library is).
 *
 * tandem_linear: y = x · wᵀ (+ bias) for a few float32 rows x and float16, int8 or 4-bit weights w. A decode step
 * multiplies every weight matrix by a handful of rows, so it is bound by reading the weights. Stored as float16
 * they are half the bytes of float32, as int8 a quarter plus their scales: each group of `group` consecutive
 * weights of a row is scaled to ±127, its scale kept as a float16, as llama.cpp's Q8_0 keeps it (a group of a whole
 * row is one scale per row); as 4-bit weights (on llama.cpp's Q4_1 grid) an eighth. float16 weights are widened to
 * float32 in registers, and every product and sum is float32: the weight rows are cut into tiles of TILE_N rows,
 * shared out between the threads; a tile stays in L1 while all the input rows, TILE_M at a time, pass over it.
 * Built with AVX-512 (-mavx512f), it works on 16 floats at a time instead of 8 (CHUNK), and the weights are packed
 * for that width. int8 and 4-bit weights multiply every row in integers (integer_linear), the rows rounded to int16
 * (for 4-bit weights, to int8 in steps of many rows, a prompt chunk's): widening and scaling every weight to
 * float32 would bound a step of several rows by arithmetic, not by reading the weights.
 * Built with AMX (-mamx-bf16), int8 weights take a layout of their own and multiply in float32, steps of many rows
 * in AMX tiles (amx_linear below).
 *
 * tandem_linear_bf16 (the AMX build): steps of many bfloat16 rows times bfloat16 weights in that layout, in AMX
 * tiles, the batched path of a model with bfloat16 batched weights; for a gate and up projection, it applies
 * silu(gate) ⊙ up as it stores the sums.
 *
 * tandem_decode_attention: one query token per sequence against its context in the paged KV cache,
 * read in place through the sequence's block table: one pass over the keys and values with an online
 * softmax, the query heads that share a key-value head together, and the positions that all the
 * sequences share (a common prompt prefix) read once for all of them.
 *
 * tandem_prefill_attention (the builds with AVX512-BF16): a prefill chunk's causal attention over its context,
 * flash style, in bfloat16 products with float32 sums: in AMX tiles in the AMX build, in AVX512-BF16's dot
 * products in the others (below amx_linear). tandem_prefill_attention_float32 (every build): the same in float32.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TILE_N 3
/* How far ahead of its reads tandem_linear prefetches the weights: left to the hardware prefetcher,
 * the weight stream stalls the arithmetic of a batch of rows instead of overlapping it. A pass of one
 * row does little arithmetic per byte and so reads the stream faster: it prefetches twice as far ahead
 * to hide the same memory latency. */
#define PREFETCH_BYTES 8192
#define PREFETCH_BYTES_ONE_ROW 16384

#ifdef __AVX512F__
#define TILE_M 8 /* 24 accumulators of the 32 vector registers */
#define CHUNK 16
typedef __m512 chunk_vector;
#define chunk_zero _mm512_setzero_ps
#define chunk_load _mm512_loadu_ps
#define chunk_load_f16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define chunk_fmadd _mm512_fmadd_ps
#define chunk_sum _mm512_reduce_add_ps
#define chunk_store _mm512_storeu_ps
#define chunk_mul _mm512_mul_ps
#define chunk_set1 _mm512_set1_ps
/* the sums of a vector's two halves */
#define chunk_fold(v) \
    _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)))
#else
#define TILE_M 4 /* 12 accumulators of the 16 vector registers */
#define CHUNK 8
typedef __m256 chunk_vector;
#define chunk_zero _mm256_setzero_ps
#define chunk_load _mm256_loadu_ps
#define chunk_load_f16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define chunk_fmadd _mm256_fmadd_ps
#define chunk_sum horizontal_sum
#define chunk_store _mm256_storeu_ps
#define chunk_mul _mm256_mul_ps
#define chunk_set1 _mm256_set1_ps
#define chunk_fold(v) (v)
#endif

static inline float horizontal_max(__m256 v)
{
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

static inline float horizontal_sum(__m256 v)
{
    __m128 sum = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
    sum = _mm_add_ss(sum, _mm_movehdup_ps(sum));
    return _mm_cvtss_f32(sum);
}

/* float16 weight rows tile by tile, each tile's TILE_N rows interleaved in chunks of CHUNK: [n / TILE_N]
 * [k / CHUNK][TILE_N][CHUNK], so the kernel reads the weight in one sequential stream (the hardware
 * prefetcher keeps up with one stream, not with TILE_N short ones). The last tile is padded with zero
 * rows. */
int tandem_linear_tile_rows(void)
{
    return TILE_N;
}

int tandem_linear_chunk(void)
{
    return CHUNK;
}

/* rows m < rows_m of x against one packed float16 tile; rows_m is a constant at every call site, so the accumulators
 * stay in registers. Writes the first `columns` of the tile's TILE_N outputs. */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t k_size, const uint16_t *w,
                                                       const float *bias, float *y, int64_t ldy, int rows_m,
                                                       int columns)
{
    chunk_vector acc[TILE_M][TILE_N];
    for (int m = 0; m < rows_m; m++)
        for (int n = 0; n < TILE_N; n++)
            acc[m][n] = chunk_zero();
    const int64_t ahead = rows_m == 1 ? PREFETCH_BYTES_ONE_ROW : PREFETCH_BYTES;
    for (int64_t k = 0; k < k_size; k += CHUNK) {
        const char *next = (const char *)(w + k * TILE_N);
        _mm_prefetch(next + ahead, _MM_HINT_T0);
        _mm_prefetch(next + ahead + 64, _MM_HINT_T0);
        chunk_vector wv[TILE_N];
        for (int n = 0; n < TILE_N; n++)
            wv[n] = chunk_load_f16(w + k * TILE_N + n * CHUNK);
        for (int m = 0; m < rows_m; m++) {
            chunk_vector xv = chunk_load(x + m * k_size + k);
            for (int n = 0; n < TILE_N; n++)
                acc[m][n] = chunk_fmadd(wv[n], xv, acc[m][n]);
        }
    }
    for (int m = 0; m < rows_m; m++)
        for (int n = 0; n < columns; n++) {
            float sum = chunk_sum(acc[m][n]);
            y[m * ldy + n] = bias ? sum + bias[n] : sum;
        }
}

/* Every row of x against tile t. */
static inline __attribute__((always_inline)) void tile_all_rows(const float *x, int64_t rows, int64_t k_size,
                                                                const uint16_t *w, int64_t n_size, const float *bias,
                                                                float *y, int64_t t)
{
    int64_t n = t * TILE_N;
    int columns = n_size - n < TILE_N ? (int)(n_size - n) : TILE_N;
    const uint16_t *wt = w + n * k_size;
    const float *bt = bias ? bias + n : 0;
    int64_t m = 0;
    for (; m + TILE_M <= rows; m += TILE_M)
        tile(x + m * k_size, k_size, wt, bt, y + m * n_size + n, n_size, TILE_M, columns);
    /* the remaining rows in one pass over the tile, their count a constant in each case */
#define REMAINING(count) \
    case count: tile(x + m * k_size, k_size, wt, bt, y + m * n_size + n, n_size, count, columns); break;
    switch (rows - m) {
        REMAINING(1) REMAINING(2) REMAINING(3)
#if TILE_M == 8
        REMAINING(4) REMAINING(5) REMAINING(6) REMAINING(7)
#endif
    }
#undef REMAINING
}

/* x[0, n) (n a multiple of 16) scaled to ±32767 and rounded to nearest, into q; returns the scale, and x's sum in
 * *sum where sum is not NULL. */
static inline float quantize_int16(const float *x, int64_t n, int16_t *q, float *sum)
{
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 top = _mm256_setzero_ps(), total = _mm256_setzero_ps();
    for (int64_t k = 0; k < n; k += 8) {
        __m256 v = _mm256_loadu_ps(x + k);
        top = _mm256_max_ps(top, _mm256_and_ps(v, magnitude));
        total = _mm256_add_ps(total, v);
    }
    float largest = horizontal_max(top);
    if (sum)
        *sum = horizontal_sum(total);
    __m256 inverse = _mm256_set1_ps(largest > 0.0f ? 32767.0f / largest : 0.0f);
    for (int64_t k = 0; k < n; k += 16) {
        __m256i low = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k), inverse));
        __m256i high = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k + 8), inverse));
        _mm256_storeu_si256((__m256i *)(q + k), _mm256_permute4x64_epi64(_mm256_packs_epi32(low, high), 0xD8));
    }
    return largest / 32767.0f;
}

/* Per calling thread, memory that keeps its largest size from call to call: a fresh allocation of megabytes
 * for every layer's attention or prompt chunk's rows costs its page faults every time. */
typedef struct {
    void *memory;
    size_t bytes;
} scratch_memory;

static pthread_key_t scratch_key;
static pthread_once_t scratch_key_once = PTHREAD_ONCE_INIT;

static void free_scratch(void *area)
{
    free(((scratch_memory *)area)->memory);
    free(area);
}

static void make_scratch_key(void)
{
    pthread_key_create(&scratch_key, free_scratch);
}

/* At least `bytes` of 64-byte aligned memory, or NULL. */
static void *scratch(size_t bytes)
{
    pthread_once(&scratch_key_once, make_scratch_key);
    scratch_memory *area = pthread_getspecific(scratch_key);
    if (!area) {
        area = calloc(1, sizeof *area);
        if (!area || pthread_setspecific(scratch_key, area)) {
            free(area);
            return NULL;
        }
    }
    if (area->bytes < bytes) {
        free(area->memory);
        area->bytes = (bytes + 63) / 64 * 64;
        area->memory = aligned_alloc(64, area->bytes);
        if (!area->memory)
            area->bytes = 0;
    }
    return area->memory;
}

/* Weights in integers, multiplied in integers: the rows of x are rounded to int16 in each group of INTEGER_ROW_GROUP
 * columns (their scale the group's largest magnitude over 32767), and a group's products summed in int32 by vpmaddwd
 * (vpdpwssd in the AVX-512 builds), which multiplies twice as many pairs a cycle as FMA multiplies floats, with no
 * weight to widen to float32 and scale first, so that a step of several rows is not bound by arithmetic where
 * float32 would be. The weights are in tiles of INTEGER_TILE_N weight rows (two vectors of output columns in AVX2,
 * one in the VNNI builds), laid out as a matrix multiply wants them, their scales (and minimums) [tiles][groups]
 * [INTEGER_TILE_N]:
 * - 4-bit weights (tandem_linear with `mins`): each 32 columns of a row hold 16 levels, weight = scale · q + min
 *   with q in 0..15 and a float16 scale and min, the grid of llama.cpp's Q4_1. 32 bytes per 4 columns of x,
 *   [tiles][k_size / 4][2][16 bytes], byte j of a vector holding output column j / 2's weights at columns
 *   4i + j % 2 (its low nibble) and 4i + 2 + j % 2 (its high nibble). Widened to int16 and split into nibbles, a
 *   vector pairs with a broadcast pair of x's int16 values: 8 output columns' sums of two products each. Steps of
 *   PROMPT_CHUNK_ROWS rows or more (prompt chunks) round x to int8 for vpmaddubsw (vpdpbusd), twice as many pairs
 *   again.
 * - int8 weights (tandem_linear with `scales` alone): a float16 scale per `group` columns (a multiple of
 *   INTEGER_ROW_GROUP). 32 bytes per 2 columns of x, [tiles][k_size / 2][INTEGER_TILE_N][2]: widened to int16, a vector
 *   of 16 (AVX2: 8) output columns' pairs meets a broadcast pair of x's int16 values. */
#define INTEGER_ROW_GROUP 32
#define INTEGER_TILE_N 16
/* rows of x against a tile at once: in AVX2, 8 int32 sums, 4 weight and 2 x vectors in registers; in the VNNI
 * builds, 16 int32 sums and 8 float32 ones among the 32 vector registers */
#ifdef __AVX512VNNI__
#define INTEGER_ROWS 8
#else
#define INTEGER_ROWS 4
#endif
#define INTEGER_ROW_BLOCK 64 /* rows whose int16 values stay in L2 while a thread's tiles pass over them */
/* Steps of at least this many rows are prompt chunks, with any decodes beside them (the decode crossover times
 * steps of up to 64). There uint4 weights meet x rounded to int8, not int16, for vpmaddubsw (int4_tile_int8_rows),
 * and integer_linear's threads take rows, not tiles. */
#define PROMPT_CHUNK_ROWS 128

int tandem_linear_integer_tile_rows(void)
{
    return INTEGER_TILE_N;
}

int tandem_linear_int4_int8_rows(void)
{
    return PROMPT_CHUNK_ROWS;
}

/* A tile's float32 sums for rows_m rows (plus the bias) into its first `columns` output columns of y. */
static inline __attribute__((always_inline)) void store_integer_tile(__m256 acc[][2], const float *bias, float *y,
                                                                     int64_t ldy, int rows_m, int columns)
{
    for (int m = 0; m < rows_m; m++) {
        float out[INTEGER_TILE_N];
        _mm256_storeu_ps(out, acc[m][0]);
        _mm256_storeu_ps(out + 8, acc[m][1]);
        for (int n = 0; n < columns; n++)
            y[m * ldy + n] = bias ? out[n] + bias[n] : out[n];
    }
}

/* A group's int32 sums of rows_m rows against a tile (sums[m][0] output columns 0-7, [1] 8-15) into their float32
 * sums: times the weights' scales (`scales`, the group's INTEGER_TILE_N) and each row's scale, plus, for uint4
 * weights (`mins` not NULL), the weights' minimums times each row's sum. */
static inline __attribute__((always_inline)) void accumulate_integer_group(
    __m256 acc[][2], __m256i sums[][2], const uint16_t *scales, const uint16_t *mins, int64_t g,
    const float *x_scales, const float *x_sums, int64_t groups, int rows_m)
{
    for (int v = 0; v < 2; v++) {
        __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + v * 8)));
        for (int m = 0; m < rows_m; m++) {
            __m256 row_scale = _mm256_mul_ps(scale, _mm256_set1_ps(x_scales[m * groups + g]));
            acc[m][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[m][v]), row_scale, acc[m][v]);
            if (mins)
                acc[m][v] = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mins + v * 8))),
                                            _mm256_set1_ps(x_sums[m * groups + g]), acc[m][v]);
        }
    }
}

/* rows_m rows of x (int16, k_size apart; their groups' scales and sums `groups` apart) against one tile of
 * weights, into y (ldy apart); rows_m is a constant at every call site. */
#ifdef __AVX512VNNI__
/* The VNNI builds hold a tile's 16 output columns in one 512-bit vector. */

/* A group's int32 sums of rows_m rows against a tile into their float32 sums, as accumulate_integer_group does. */
static inline __attribute__((always_inline)) void accumulate_integer_group16(
    __m512 acc[], const __m512i totals[], const uint16_t *scales, const uint16_t *mins, int64_t g,
    const float *x_scales, const float *x_sums, int64_t groups, int rows_m)
{
    __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)scales));
    for (int m = 0; m < rows_m; m++) {
        __m512 row_scale = _mm512_mul_ps(scale, _mm512_set1_ps(x_scales[m * groups + g]));
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(totals[m]), row_scale, acc[m]);
        if (mins)
            acc[m] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)mins)),
                                     _mm512_set1_ps(x_sums[m * groups + g]), acc[m]);
    }
}

static inline __attribute__((always_inline)) void store_integer_tile16(const __m512 acc[], const float *bias, float *y,
                                                                       int64_t ldy, int rows_m, int columns)
{
    for (int m = 0; m < rows_m; m++) {
        float out[INTEGER_TILE_N];
        _mm512_storeu_ps(out, acc[m]);
        for (int n = 0; n < columns; n++)
            y[m * ldy + n] = bias ? out[n] + bias[n] : out[n];
    }
}

/* Each 32 bytes of a tile's weights are widened to int16 vectors that pair with pairs of a row's int16 values: for
 * uint4 weights (`uint4`, a constant at every call site) two, the low nibbles and then the high ones (4 columns of
 * x), for int8 weights one (2 columns).
 * vpdpwssd multiplies and adds in one instruction what vpmaddwd and vpaddd take two for, but its sum waits on the
 * vpdpwssd before it. So each row's products go to four sums in passes of up to 4 rows, to two in passes of more, by
 * the place of the pair of columns: a step of one row is bound by vpdpwssd's throughput, not by its latency. */
static inline __attribute__((always_inline)) void integer_tile(
    const int16_t *xq, const float *x_scales, const float *x_sums, int64_t k_size, const uint8_t *w, int uint4,
    const uint16_t *scales, int64_t group, const uint16_t *mins, const float *bias, float *y, int64_t ldy, int rows_m,
    int columns)
{
    const __m512i nibble = _mm512_set1_epi16(0x0F);
    const int64_t groups = k_size / INTEGER_ROW_GROUP;
    const int vectors = uint4 ? 2 : 1, chains = rows_m > 4 ? 2 : 4;
    __m512 acc[INTEGER_ROWS];
    for (int m = 0; m < rows_m; m++)
        acc[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512i sums[INTEGER_ROWS][4]; /* [row][pair % chains] */
        for (int m = 0; m < rows_m; m++)
            sums[m][0] = sums[m][1] = sums[m][2] = sums[m][3] = _mm512_setzero_si512();
#pragma GCC unroll 16 /* so that every sum is a register */
        for (int step = 0; step < INTEGER_ROW_GROUP / (2 * vectors); step++, w += 32) {
            if (step % 2 == 0)
                _mm_prefetch((const char *)w + PREFETCH_BYTES_ONE_ROW, _MM_HINT_T0);
            __m256i bytes = _mm256_loadu_si256((const __m256i *)w);
            __m512i weights[2];
            if (uint4) {
                __m512i both = _mm512_cvtepu8_epi16(bytes);
                weights[0] = _mm512_and_si512(both, nibble);
                weights[1] = _mm512_srli_epi16(both, 4);
            } else {
                weights[0] = _mm512_cvtepi8_epi16(bytes);
            }
            for (int m = 0; m < rows_m; m++)
                for (int v = 0; v < vectors; v++) {
                    int pair = step * vectors + v;
                    int32_t two;
                    memcpy(&two, xq + m * k_size + g * INTEGER_ROW_GROUP + 2 * pair, 4);
                    __m512i *sum = &sums[m][pair % chains];
                    *sum = _mm512_dpwssd_epi32(*sum, weights[v], _mm512_set1_epi32(two));
                }
        }
        __m512i totals[INTEGER_ROWS];
        for (int m = 0; m < rows_m; m++)
            totals[m] = _mm512_add_epi32(_mm512_add_epi32(sums[m][0], sums[m][1]),
                                         _mm512_add_epi32(sums[m][2], sums[m][3]));
        accumulate_integer_group16(acc, totals, scales + g * INTEGER_ROW_GROUP / group * INTEGER_TILE_N,
                                   uint4 ? mins + g * INTEGER_TILE_N : NULL, g, x_scales, x_sums, groups, rows_m);
    }
    store_integer_tile16(acc, bias, y, ldy, rows_m, columns);
}
#else
static inline __attribute__((always_inline)) void integer_tile(
    const int16_t *xq, const float *x_scales, const float *x_sums, int64_t k_size, const uint8_t *w, int uint4,
    const uint16_t *scales, int64_t group, const uint16_t *mins, const float *bias, float *y, int64_t ldy, int rows_m,
    int columns)
{
    const __m256i nibble = _mm256_set1_epi16(0x0F);
    const int64_t groups = k_size / INTEGER_ROW_GROUP;
    const int vectors = uint4 ? 2 : 1;
    __m256 acc[INTEGER_ROWS][2];
    for (int m = 0; m < rows_m; m++)
        acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m256i sums[INTEGER_ROWS][2];
        for (int m = 0; m < rows_m; m++)
            sums[m][0] = sums[m][1] = _mm256_setzero_si256();
        for (int step = 0; step < INTEGER_ROW_GROUP / (2 * vectors); step++, w += 32) {
            if (step % 2 == 0)
                _mm_prefetch((const char *)w + PREFETCH_BYTES_ONE_ROW, _MM_HINT_T0);
            __m256i weights[2][2]; /* [vector][output columns 0-7, 8-15] */
            for (int half = 0; half < 2; half++) {
                __m128i bytes = _mm_loadu_si128((const __m128i *)(w + 16 * half));
                if (uint4) {
                    __m256i both = _mm256_cvtepu8_epi16(bytes);
                    weights[0][half] = _mm256_and_si256(both, nibble);
                    weights[1][half] = _mm256_srli_epi16(both, 4);
                } else {
                    weights[0][half] = _mm256_cvtepi8_epi16(bytes);
                }
            }
            for (int m = 0; m < rows_m; m++)
                for (int v = 0; v < vectors; v++) {
                    int32_t two;
                    memcpy(&two, xq + m * k_size + g * INTEGER_ROW_GROUP + 2 * (step * vectors + v), 4);
                    __m256i x_pair = _mm256_set1_epi32(two);
                    for (int half = 0; half < 2; half++)
                        sums[m][half] = _mm256_add_epi32(sums[m][half], _mm256_madd_epi16(weights[v][half], x_pair));
                }
        }
        accumulate_integer_group(acc, sums, scales + g * INTEGER_ROW_GROUP / group * INTEGER_TILE_N,
                                 uint4 ? mins + g * INTEGER_TILE_N : NULL, g, x_scales, x_sums, groups, rows_m);
    }
    store_integer_tile(acc, bias, y, ldy, rows_m, columns);
}
#endif

/* A quad's 32 bytes of weights (16 output columns' 4 columns of x) split into their low and high nibbles, a byte
 * each. */
static inline void split_nibbles(const uint8_t *w, __m256i *low, __m256i *high)
{
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    __m256i packed = _mm256_loadu_si256((const __m256i *)w);
    *low = _mm256_and_si256(packed, nibble);
    *high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
}

/* Rows of x rounded to int8 take INT8_ROW_BYTES bytes a column, as the build's int4_tile_int8_rows reads them: each
 * value once where vpdpbusd multiplies four of them at a time, each pair of them written twice (x0 x1 x0 x1,
 * x2 x3 x2 x3, ...) where a pair is one 32-bit broadcast for vpmaddubsw. */
#ifdef __AVX512VNNI__
#define INT8_ROW_BYTES 1
#else
#define INT8_ROW_BYTES 2
#endif

/* x[0, INTEGER_ROW_GROUP) scaled to ±127 and rounded to nearest, into q (INT8_ROW_BYTES · INTEGER_ROW_GROUP bytes);
 * returns the scale, and the rounded values' sum in *sum: a weight is step · q + min, and with the sum of the very
 * values the steps meet, rounding errors of x cost the weights' deviation from their mean, not all of step · q
 * (0.51% of a row's outputs for unit normal x, against 0.70% with x's own sum). */
static inline float quantize_int8(const float *x, int8_t *q, float *sum)
{
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 top = _mm256_setzero_ps();
    for (int k = 0; k < INTEGER_ROW_GROUP; k += 8)
        top = _mm256_max_ps(top, _mm256_and_ps(_mm256_loadu_ps(x + k), magnitude));
    float largest = horizontal_max(top);
    __m256 inverse = _mm256_set1_ps(largest > 0.0f ? 127.0f / largest : 0.0f);
    __m256i words[2], rounded_total = _mm256_setzero_si256();
    for (int half = 0; half < 2; half++) {
        const float *xh = x + half * 16;
        __m256i low = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xh), inverse));
        __m256i high = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xh + 8), inverse));
        rounded_total = _mm256_add_epi32(rounded_total, _mm256_add_epi32(low, high));
        words[half] = _mm256_permute4x64_epi64(_mm256_packs_epi32(low, high), 0xD8);
    }
    *sum = horizontal_sum(_mm256_cvtepi32_ps(rounded_total)) * (largest / 127.0f);
    __m256i bytes = _mm256_permute4x64_epi64(_mm256_packs_epi16(words[0], words[1]), 0xD8);
#ifdef __AVX512VNNI__
    _mm256_storeu_si256((__m256i *)q, bytes);
#else
    __m256i pairs_low = _mm256_unpacklo_epi16(bytes, bytes), pairs_high = _mm256_unpackhi_epi16(bytes, bytes);
    _mm256_storeu_si256((__m256i *)q, _mm256_permute2x128_si256(pairs_low, pairs_high, 0x20));
    _mm256_storeu_si256((__m256i *)(q + 32), _mm256_permute2x128_si256(pairs_low, pairs_high, 0x31));
#endif
    return largest / 127.0f;
}

/* As integer_tile for uint4 weights, for rows of x rounded to int8 (quantize_int8, k_size bytes a row): vpdpbusd multiplies four of a
 * weight row's nibbles, widened to bytes, by four of x's bytes and adds the four products to the row's int32 sum.
 * A quad's nibbles are put in that order once for all the rows: the low nibbles of bytes 2c and 2c + 1 (x's
 * columns 4i and 4i + 1) and their high nibbles (4i + 2, 4i + 3) side by side, output column c's four bytes. */
#ifdef __AVX512VNNI__
static inline __attribute__((always_inline)) void int4_tile_int8_rows(
    const int8_t *xq, const float *x_scales, const float *x_sums, int64_t k_size, const uint8_t *w,
    const uint16_t *scales, const uint16_t *mins, const float *bias, float *y, int64_t ldy, int rows_m, int columns)
{
    /* unpacking the low and high nibbles in 128-bit lanes yields columns 0-3 and 8-11, then 4-7 and 12-15 */
    const __m512i in_column_order = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
    const int64_t groups = k_size / INTEGER_ROW_GROUP;
    __m512 acc[INTEGER_ROWS];
    for (int m = 0; m < rows_m; m++)
        acc[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512i sums[INTEGER_ROWS][2]; /* [row][quad % 2]: a row's next vpdpbusd need not wait on its last */
        for (int m = 0; m < rows_m; m++)
            sums[m][0] = sums[m][1] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int quad = 0; quad < INTEGER_ROW_GROUP / 4; quad++, w += 32) {
            if (quad % 2 == 0)
                _mm_prefetch((const char *)w + PREFETCH_BYTES_ONE_ROW, _MM_HINT_T0);
            __m256i low, high;
            split_nibbles(w, &low, &high);
            __m512i weights = _mm512_permutex2var_epi64(_mm512_castsi256_si512(_mm256_unpacklo_epi16(low, high)),
                                                        in_column_order,
                                                        _mm512_castsi256_si512(_mm256_unpackhi_epi16(low, high)));
            for (int m = 0; m < rows_m; m++) {
                int32_t four;
                memcpy(&four, xq + m * k_size + g * INTEGER_ROW_GROUP + quad * 4, 4);
                sums[m][quad % 2] = _mm512_dpbusd_epi32(sums[m][quad % 2], weights, _mm512_set1_epi32(four));
            }
        }
        __m512i totals[INTEGER_ROWS];
        for (int m = 0; m < rows_m; m++)
            totals[m] = _mm512_add_epi32(sums[m][0], sums[m][1]);
        accumulate_integer_group16(acc, totals, scales + g * INTEGER_TILE_N, mins + g * INTEGER_TILE_N, g,
                                   x_scales, x_sums, groups, rows_m);
    }
    store_integer_tile16(acc, bias, y, ldy, rows_m, columns);
}
#else
/* As integer_tile for uint4 weights, for rows of x rounded to int8 (quantize_int8, 2 · k_size bytes a row): vpmaddubsw multiplies
 * a vector's 32 nibbles, widened to bytes, by a broadcast pair of x's bytes and sums each weight row's two products
 * into int16, twice the pairs a vpmaddwd multiplies. A group's sums stay in int16 (8 of 2 · 15 · 127 a lane for
 * each of the low and the high nibbles) until they are added in int32 once a group. */
static inline __attribute__((always_inline)) void int4_tile_int8_rows(
    const int8_t *xq, const float *x_scales, const float *x_sums, int64_t k_size, const uint8_t *w,
    const uint16_t *scales, const uint16_t *mins, const float *bias, float *y, int64_t ldy, int rows_m, int columns)
{
    const __m256i ones = _mm256_set1_epi16(1);
    const int64_t groups = k_size / INTEGER_ROW_GROUP;
    __m256 acc[INTEGER_ROWS][2];
    for (int m = 0; m < rows_m; m++)
        acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m256i low_sums[INTEGER_ROWS], high_sums[INTEGER_ROWS];
        for (int m = 0; m < rows_m; m++)
            low_sums[m] = high_sums[m] = _mm256_setzero_si256();
        for (int quad = 0; quad < INTEGER_ROW_GROUP / 4; quad++, w += 32) {
            if (quad % 2 == 0)
                _mm_prefetch((const char *)w + PREFETCH_BYTES_ONE_ROW, _MM_HINT_T0);
            __m256i low, high;
            split_nibbles(w, &low, &high);
            for (int m = 0; m < rows_m; m++) {
                const int8_t *xm = xq + 2 * (m * k_size + g * INTEGER_ROW_GROUP + quad * 4);
                int32_t pair_low, pair_high;
                memcpy(&pair_low, xm, 4);
                memcpy(&pair_high, xm + 4, 4);
                low_sums[m] = _mm256_add_epi16(low_sums[m], _mm256_maddubs_epi16(low, _mm256_set1_epi32(pair_low)));
                high_sums[m] = _mm256_add_epi16(high_sums[m],
                                                _mm256_maddubs_epi16(high, _mm256_set1_epi32(pair_high)));
            }
        }
        __m256i sums[INTEGER_ROWS][2];
        for (int m = 0; m < rows_m; m++) {
            /* weight row r's low and high sums side by side, added in int32: rows 0-3 and 8-11, then 4-7, 12-15 */
            __m256i first = _mm256_madd_epi16(_mm256_unpacklo_epi16(low_sums[m], high_sums[m]), ones);
            __m256i second = _mm256_madd_epi16(_mm256_unpackhi_epi16(low_sums[m], high_sums[m]), ones);
            sums[m][0] = _mm256_permute2x128_si256(first, second, 0x20);
            sums[m][1] = _mm256_permute2x128_si256(first, second, 0x31);
        }
        accumulate_integer_group(acc, sums, scales + g * INTEGER_TILE_N, mins + g * INTEGER_TILE_N, g,
                                 x_scales, x_sums, groups, rows_m);
    }
    store_integer_tile(acc, bias, y, ldy, rows_m, columns);
}
#endif

/* Weights in integers (above): uint4 where mins is not NULL, else int8 with a scale per `group` columns. Returns -2
 * where it cannot allocate its working memory. */
static int integer_linear(const float *x, int64_t rows, int64_t k_size, const void *w, const uint16_t *scales,
                          const uint16_t *mins, int64_t group, int64_t n_size, const float *bias, float *y,
                          int threads)
{
    int64_t tiles = (n_size + INTEGER_TILE_N - 1) / INTEGER_TILE_N, groups = k_size / INTEGER_ROW_GROUP;
    int int8_rows = mins && rows >= PROMPT_CHUNK_ROWS;
    /* a row's int16 values take 2 · k_size bytes, its int8 values no more */
    char *area = scratch(rows * (k_size * sizeof(int16_t) + 2 * groups * sizeof(float)));
    if (!area)
        return -2;
    void *xq = area;
    float *x_scales = (float *)(area + rows * k_size * sizeof(int16_t)), *x_sums = x_scales + rows * groups;
    /* a row or a few are quickly rounded by this thread alone, sparing the tiles' threads a barrier */
#pragma omp parallel for schedule(static) num_threads(threads) if (rows > INTEGER_ROWS)
    for (int64_t m = 0; m < rows; m++)
        for (int64_t g = 0; g < groups; g++) {
            int64_t at = m * k_size + g * INTEGER_ROW_GROUP;
            x_scales[m * groups + g] =
                int8_rows ? quantize_int8(x + at, (int8_t *)xq + INT8_ROW_BYTES * at, x_sums + m * groups + g)
                          : quantize_int16(x + at, INTEGER_ROW_GROUP, (int16_t *)xq + at, x_sums + m * groups + g);
        }
    /* A few rows: each thread its own run of tiles, so that every weight is read once. A prompt chunk's rows: each
     * thread its own rows, as schedule(static) gives them to it in the ops before and after, so that a row in and
     * out stays in the cache of the CPU that makes and reads it (two CPUs may not share one). Either passes over
     * one block of rows after another. */
    int split_rows = rows >= PROMPT_CHUNK_ROWS;
#pragma omp parallel num_threads(threads)
    {
        int team = omp_get_num_threads(), thread = omp_get_thread_num();
        int64_t first = 0, last = tiles, row_first = 0, row_last = rows;
        if (split_rows) {
            int64_t share = rows / team, more = rows % team;
            row_first = thread * share + (thread < more ? thread : more);
            row_last = row_first + share + (thread < more);
        } else {
            first = tiles * thread / team;
            last = tiles * (thread + 1) / team;
        }
        for (int64_t block = row_first; block < row_last; block += INTEGER_ROW_BLOCK) {
            int64_t block_end = block + INTEGER_ROW_BLOCK < row_last ? block + INTEGER_ROW_BLOCK : row_last;
            for (int64_t t = first; t < last; t++) {
                int64_t n = t * INTEGER_TILE_N;
                int columns = n_size - n < INTEGER_TILE_N ? (int)(n_size - n) : INTEGER_TILE_N;
                const void *wt = (const char *)w + (mins ? n * k_size / 2 : n * k_size);
                const uint16_t *st = scales + n * (k_size / group), *mt = mins ? mins + n * groups : NULL;
                const float *bt = bias ? bias + n : 0;
                for (int64_t m = block; m < block_end; m += INTEGER_ROWS) {
                    int16_t *rows16 = (int16_t *)xq + m * k_size;
                    float *out = y + m * n_size + n;
#define INTEGER_ROWS_CASE(count)                                                                                   \
    case count:                                                                                                    \
        if (int8_rows)                                                                                             \
            int4_tile_int8_rows((int8_t *)xq + INT8_ROW_BYTES * m * k_size, x_scales + m * groups,                 \
                                x_sums + m * groups, k_size, wt, st, mt, bt, out, n_size, count, columns);         \
        else if (mins)                                                                                             \
            integer_tile(rows16, x_scales + m * groups, x_sums + m * groups, k_size, wt, 1, st, INTEGER_ROW_GROUP,  \
                         mt, bt, out, n_size, count, columns);                                                     \
        else                                                                                                       \
            integer_tile(rows16, x_scales + m * groups, NULL, k_size, wt, 0, st, group, NULL, bt, out, n_size,     \
                         count, columns);                                                                          \
        break;
                    switch (block_end - m < INTEGER_ROWS ? block_end - m : INTEGER_ROWS) {
                        INTEGER_ROWS_CASE(1) INTEGER_ROWS_CASE(2) INTEGER_ROWS_CASE(3) INTEGER_ROWS_CASE(4)
#if INTEGER_ROWS == 8
                        INTEGER_ROWS_CASE(5) INTEGER_ROWS_CASE(6) INTEGER_ROWS_CASE(7) INTEGER_ROWS_CASE(8)
#endif
                    }
#undef INTEGER_ROWS_CASE
                }
            }
        }
    }
    return 0;
}

#ifdef __AVX512F__
/* e^x for x <= 0, 16 at a time, to exp_nonpositive's precision */
static inline __m512 exp_nonpositive16(__m512 x)
{
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

static inline __m512 silu_and_mul16(__m512 g, __m512 u)
{
    /* silu(g) ⊙ u, the sigmoid as silu_and_mul8 (below) takes it */
    __m512 e = exp_nonpositive16(_mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(g),
                                                                      _mm512_set1_epi32((int)0x80000000))));
    __m512 one = _mm512_set1_ps(1.0f);
    __mmask16 negative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
    __m512 sigmoid = _mm512_div_ps(_mm512_mask_blend_ps(negative, one, e), _mm512_add_ps(one, e));
    return _mm512_mul_ps(_mm512_mul_ps(g, sigmoid), u);
}

static inline __m512 load_sixteen(const void *p, int64_t i, int bf16)
{
    if (!bf16)
        return _mm512_loadu_ps((const float *)p + i);
    __m512i bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
}

static inline void store_sixteen(void *p, int64_t i, __m512 v, int bf16)
{
    if (!bf16) {
        _mm512_storeu_ps((float *)p + i, v);
        return;
    }
    __m512i bits = _mm512_castps_si512(v);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    bits = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    _mm256_storeu_si256((__m256i *)((uint16_t *)p + i), _mm512_cvtepi32_epi16(bits));
}
#endif

#ifdef __AMX_BF16__
/* The AMX build's int8 weights: AMX tiles multiply bfloat16 and accumulate float32, 16 rows × 16 columns
 * × 32 products per instruction, so a step of many rows costs little more than one of a single row: the
 * work is widening the weights. Weight rows go in passes of AMX_BLOCKS blocks of 16; a pass is laid out
 * group of 32 columns (a tile's depth) by group, each group as its blocks one after the other, each block
 * [16 column pairs][16 weight rows][2] int8, the tiles' own order, so that a pass reads one stream. The
 * float16 scales, one per weight row and group, follow the same order: [groups][blocks][16]. A
 * group's int8 weights are widened to float32, scaled, and rounded to bfloat16 into a tile buffer once for
 * every 32 rows of x; the rows are rounded to bfloat16 once per call, and each tile of 16 of them meets
 * AMX_BLOCKS blocks. */
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_ROWS 16
#define AMX_BLOCKS 2
#define AMX_MIN_ROWS 4 /* fewer rows run through FMAs (few_rows_pass) */
#define AMX_PREFETCH_BYTES 32768
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

int tandem_linear_amx_block_rows(void)
{
    return AMX_ROWS * AMX_BLOCKS;
}

int tandem_linear_amx_min_rows(void)
{
    return AMX_MIN_ROWS;
}

/* Asks Linux for the tile state, once per process; 0 where granted. */
int tandem_amx_init(void)
{
    return (int)syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} tile_config;

/* Tiles 0 to count - 1, each 16 rows of 64 bytes. The linears take 8: tiles 0, 1 and 5, 6 the sums of two blocks
 * of rows; 2 and 7 those rows of x; 3, 4 widened weights. */
static void configure_tiles(int count)
{
    tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < count; t++) {
        config.rows[t] = AMX_ROWS;
        config.bytes_per_row[t] = 64;
    }
    _tile_loadconfig(&config);
}

/* A block's 16 scales, widened to float32 and each repeated for the two columns of a pair: rows 0-7 in low,
 * 8-15 in high, matching the lanes of a column pair's 32 weights. */
static inline void pair_scales(const uint16_t *scales, __m512 *low, __m512 *high)
{
    __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)scales));
    *low = _mm512_permutexvar_ps(_mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0), s);
    *high = _mm512_permutexvar_ps(_mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8), s);
}

static inline void widen_group(const int8_t *w, const uint16_t *scales, uint16_t *tile)
{
    __m512 low_scales, high_scales;
    pair_scales(scales, &low_scales, &high_scales);
    for (int pair = 0; pair < 16; pair++) {
        __m256i q = _mm256_loadu_si256((const __m256i *)(w + pair * 32));
        __m512 low = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))), low_scales);
        __m512 high = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))),
                                    high_scales);
        _mm512_store_si512((void *)(tile + pair * 32), (__m512i)_mm512_cvtne2ps_pbh(high, low));
    }
}

/* A step of fewer than AMX_MIN_ROWS rows is bound by reading the weights, and a tile would mostly multiply
 * padding: these rows take the same layout through float32 FMAs instead, each weight pair of a row against
 * the two columns of x it multiplies, every product and sum in float32, the scale applied per group. */
static inline __attribute__((always_inline)) void few_rows_pass(
    const float *x, int rows_m, int64_t k_size, const int8_t *w, const uint16_t *scales, float sums[][32])
{
    __m512 acc[AMX_MIN_ROWS - 1][AMX_BLOCKS][2];
    for (int m = 0; m < rows_m; m++)
        for (int b = 0; b < AMX_BLOCKS; b++)
            acc[m][b][0] = acc[m][b][1] = _mm512_setzero_ps();
    for (int64_t g = 0; g < k_size / 32; g++) {
        const int8_t *wg = w + g * AMX_BLOCKS * 512;
        for (int line = 0; line < AMX_BLOCKS * 512; line += 64)
            _mm_prefetch((const char *)wg + AMX_PREFETCH_BYTES + line, _MM_HINT_T0);
        for (int b = 0; b < AMX_BLOCKS; b++) {
            __m512 group_acc[AMX_MIN_ROWS - 1][2];
            for (int m = 0; m < rows_m; m++)
                group_acc[m][0] = group_acc[m][1] = _mm512_setzero_ps();
            for (int pair = 0; pair < 16; pair++) {
                __m256i q = _mm256_loadu_si256((const __m256i *)(wg + b * 512 + pair * 32));
                __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)));
                __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)));
                for (int m = 0; m < rows_m; m++) {
                    double columns;
                    memcpy(&columns, x + m * k_size + g * 32 + pair * 2, sizeof columns);
                    __m512 xv = _mm512_castpd_ps(_mm512_set1_pd(columns));
                    group_acc[m][0] = _mm512_fmadd_ps(low, xv, group_acc[m][0]);
                    group_acc[m][1] = _mm512_fmadd_ps(high, xv, group_acc[m][1]);
                }
            }
            __m512 low_scales, high_scales;
            pair_scales(scales + (g * AMX_BLOCKS + b) * 16, &low_scales, &high_scales);
            for (int m = 0; m < rows_m; m++) {
                acc[m][b][0] = _mm512_fmadd_ps(group_acc[m][0], low_scales, acc[m][b][0]);
                acc[m][b][1] = _mm512_fmadd_ps(group_acc[m][1], high_scales, acc[m][b][1]);
            }
        }
    }
    for (int m = 0; m < rows_m; m++)
        for (int b = 0; b < AMX_BLOCKS; b++)
            for (int h = 0; h < 2; h++) {
                /* lanes hold (weight row, column of the pair): add each pair's two, keep one of each */
                __m512 v = acc[m][b][h];
                __m512 pairs = _mm512_maskz_compress_ps(0x5555, _mm512_add_ps(v, _mm512_permute_ps(v, 0xB1)));
                _mm256_storeu_ps(sums[m] + b * 16 + h * 8, _mm512_castps512_ps256(pairs));
            }
}

/* Rows first..first+count-1 of y [rows, n_size], columns n..n+columns-1 (columns <= 32), from a pass's sums
 * [count][32] (a tile pair's, or few_rows_pass's), plus bias; float32, or bfloat16 rounded to nearest even where
 * y_bf16. Where gated, the pair's columns are 16 gates and their 16 ups, and y [rows, n_size / 2] takes
 * silu(gate) ⊙ up in bfloat16 at column n / 2. */
static inline void store_tile_pair(const float sums[][AMX_ROWS * AMX_BLOCKS], int64_t count, int columns,
                                   const float *bias, void *y, int64_t n_size, int64_t first, int64_t n, int y_bf16,
                                   int gated)
{
    __mmask16 low = columns >= 16 ? 0xffff : (__mmask16)((1u << columns) - 1);
    __mmask16 high = columns <= 16 ? 0 : (__mmask16)((1u << (columns - 16)) - 1);
    __m512 bias_low = bias ? _mm512_maskz_loadu_ps(low, bias + n) : _mm512_setzero_ps();
    __m512 bias_high = bias ? _mm512_maskz_loadu_ps(high, bias + n + 16) : _mm512_setzero_ps();
    for (int64_t r = 0; r < count; r++) {
        __m512 v_low = _mm512_add_ps(_mm512_load_ps(sums[r]), bias_low);
        __m512 v_high = _mm512_add_ps(_mm512_load_ps(sums[r] + 16), bias_high);
        if (gated) {
            _mm256_storeu_si256((__m256i *)((uint16_t *)y + (first + r) * (n_size / 2) + n / 2),
                                (__m256i)_mm512_cvtneps_pbh(silu_and_mul16(v_low, v_high)));
            continue;
        }
        int64_t at = (first + r) * n_size + n;
        if (y_bf16) {
            _mm256_mask_storeu_epi16((uint16_t *)y + at, low, (__m256i)_mm512_cvtneps_pbh(v_low));
            _mm256_mask_storeu_epi16((uint16_t *)y + at + 16, high, (__m256i)_mm512_cvtneps_pbh(v_high));
        } else {
            _mm512_mask_storeu_ps((float *)y + at, low, v_low);
            _mm512_mask_storeu_ps((float *)y + at + 16, high, v_high);
        }
    }
}

/* The sum tiles of a pass over rows m..m+31 (0, 1: the first 16 rows; 5, 6: the next, where `second`) into y's
 * rows below `end`, through store_tile_pair and `sums` [16][32]. */
static inline void store_sum_tiles(float sums[][AMX_ROWS * AMX_BLOCKS], int64_t m, int second, int64_t end,
                                   int columns, const float *bias, void *y, int64_t n_size, int64_t n, int y_bf16,
                                   int gated)
{
    for (int half = 0; half <= second; half++) {
        int64_t first = m + half * AMX_ROWS;
        if (half) {
            _tile_stored(5, sums, AMX_ROWS * AMX_BLOCKS * 4);
            _tile_stored(6, &sums[0][AMX_ROWS], AMX_ROWS * AMX_BLOCKS * 4);
        } else {
            _tile_stored(0, sums, AMX_ROWS * AMX_BLOCKS * 4);
            _tile_stored(1, &sums[0][AMX_ROWS], AMX_ROWS * AMX_BLOCKS * 4);
        }
        store_tile_pair(sums, end - first < AMX_ROWS ? end - first : AMX_ROWS, columns, bias, y, n_size, first, n,
                        y_bf16, gated);
    }
}

static void amx_linear(const float *x, int64_t rows, int64_t k_size, const int8_t *w, const uint16_t *scales,
                       int64_t n_size, const float *bias, float *y, int threads)
{
    int64_t groups = k_size / 32, padded_rows = (rows + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS;
    int64_t passes = (n_size + AMX_ROWS * AMX_BLOCKS - 1) / (AMX_ROWS * AMX_BLOCKS);
    if (rows == 0)
        return;
    if (rows < AMX_MIN_ROWS) {
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t p = 0; p < passes; p++) {
            int64_t n = p * AMX_ROWS * AMX_BLOCKS;
            int columns = n_size - n < AMX_ROWS * AMX_BLOCKS ? (int)(n_size - n) : AMX_ROWS * AMX_BLOCKS;
            __attribute__((aligned(64))) float sums[AMX_MIN_ROWS - 1][AMX_ROWS * AMX_BLOCKS];
            const int8_t *wp = w + n * k_size;
            const uint16_t *sp = scales + n * groups;
            switch (rows) {
            case 1: few_rows_pass(x, 1, k_size, wp, sp, sums); break;
            case 2: few_rows_pass(x, 2, k_size, wp, sp, sums); break;
            default: few_rows_pass(x, 3, k_size, wp, sp, sums); break;
            }
            store_tile_pair(sums, rows, columns, bias, y, n_size, 0, n, 0, 0);
        }
        return;
    }
    uint16_t *xb = aligned_alloc(64, padded_rows * k_size * 2);
    for (int64_t m = 0; m < padded_rows; m++)
        for (int64_t k = 0; k < k_size; k += 16) {
            __m512 v = m < rows ? _mm512_loadu_ps(x + m * k_size + k) : _mm512_setzero_ps();
            _mm256_storeu_si256((__m256i *)(xb + m * k_size + k), (__m256i)_mm512_cvtneps_pbh(v));
        }
#pragma omp parallel num_threads(threads)
    {
        __attribute__((aligned(64))) uint16_t widened[AMX_BLOCKS][16 * 32];
        __attribute__((aligned(64))) float sums[AMX_ROWS][AMX_ROWS * AMX_BLOCKS];
        configure_tiles(8);
#pragma omp for schedule(static)
        for (int64_t p = 0; p < passes; p++) {
            int64_t n = p * AMX_ROWS * AMX_BLOCKS;
            int columns = n_size - n < AMX_ROWS * AMX_BLOCKS ? (int)(n_size - n) : AMX_ROWS * AMX_BLOCKS;
            const int8_t *wp = w + n * k_size;
            const uint16_t *sp = scales + n * groups;
            /* two blocks of 16 rows at a time, so that each group is widened once for both */
            for (int64_t m = 0; m < padded_rows; m += 2 * AMX_ROWS) {
                int second = m + AMX_ROWS < padded_rows;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(5);
                _tile_zero(6);
                for (int64_t g = 0; g < groups; g++) {
                    const int8_t *wg = wp + g * AMX_BLOCKS * 512;
                    for (int line = 0; line < AMX_BLOCKS * 512; line += 64)
                        _mm_prefetch((const char *)wg + AMX_PREFETCH_BYTES + line, _MM_HINT_T0);
                    for (int b = 0; b < AMX_BLOCKS; b++)
                        widen_group(wg + b * 512, sp + (g * AMX_BLOCKS + b) * 16, widened[b]);
                    /* each weight tile's products one after the other, so that the next group's load into it
                     * waits on as few as may be */
                    _tile_loadd(2, xb + m * k_size + g * 32, k_size * 2);
                    _tile_loadd(3, widened[0], 64);
                    _tile_dpbf16ps(0, 2, 3);
                    if (second) {
                        _tile_loadd(7, xb + (m + AMX_ROWS) * k_size + g * 32, k_size * 2);
                        _tile_dpbf16ps(5, 7, 3);
                    }
                    _tile_loadd(4, widened[1], 64);
                    _tile_dpbf16ps(1, 2, 4);
                    if (second)
                        _tile_dpbf16ps(6, 7, 4);
                }
                store_sum_tiles(sums, m, second, rows, columns, bias, y, n_size, n, 0, 0);
            }
        }
    }
    free(xb);
}

/* Rows of x per pass of tandem_linear_bf16 over a thread's share of the weights: the rows and that share stay in
 * the thread's L2 cache through the pass. A multiple of 2 · AMX_ROWS. */
#define BF16_ROW_CHUNK 256

/* y = x · wᵀ (+ bias) for bfloat16 rows x [rows, k_size] (k_size a multiple of 32) and bfloat16 weights w in the
 * int8 layout above (blocks of 32 weight rows, each group of 32 columns as two tiles of [16 column pairs][16
 * rows][2]), in AMX tiles with float32 sums: each thread takes blocks of 32 weight rows and multiplies them by
 * 32 rows of x at a time (four sum tiles), BF16_ROW_CHUNK rows per pass. bias [n_size] float32 or NULL; y [rows,
 * n_size] float32, or bfloat16 where y_bf16; or, where gated (each block of w 16 gate rows and their 16 up rows, n_size
 * a multiple of 32), y [rows, n_size / 2] = silu(gate) ⊙ up, bfloat16. oneDNN's kernels for these shapes vary by up
 * to 2x with the number of rows (they block them by heuristics); these run at one rate for every count. Returns 0,
 * or -2, computing nothing, where its working memory could not be allocated. */
int tandem_linear_bf16(const uint16_t *x, int64_t rows, int64_t k_size, const uint16_t *w, int64_t n_size,
                       const float *bias, void *y, int y_bf16, int gated, int threads)
{
    int64_t full_rows = rows / AMX_ROWS * AMX_ROWS, depth = k_size / 32;
    int64_t passes = (n_size + AMX_ROWS * AMX_BLOCKS - 1) / (AMX_ROWS * AMX_BLOCKS);
    uint16_t *tail = NULL; /* the last rows, short of a tile, padded with zeros */
    if (full_rows < rows) {
        tail = aligned_alloc(64, AMX_ROWS * k_size * 2);
        if (!tail)
            return -2;
        memset(tail, 0, AMX_ROWS * k_size * 2);
        memcpy(tail, x + full_rows * k_size, (rows - full_rows) * k_size * 2);
    }
#pragma omp parallel num_threads(threads)
    {
        __attribute__((aligned(64))) float sums[AMX_ROWS][AMX_ROWS * AMX_BLOCKS];
        configure_tiles(8);
        for (int64_t chunk = 0; chunk < rows; chunk += BF16_ROW_CHUNK) {
            int64_t chunk_end = rows - chunk < BF16_ROW_CHUNK ? rows : chunk + BF16_ROW_CHUNK;
#pragma omp for schedule(static) nowait
            for (int64_t p = 0; p < passes; p++) {
                int64_t n = p * AMX_ROWS * AMX_BLOCKS;
                int columns = n_size - n < AMX_ROWS * AMX_BLOCKS ? (int)(n_size - n) : AMX_ROWS * AMX_BLOCKS;
                const uint16_t *wp = w + n * k_size;
                for (int64_t m = chunk; m < chunk_end; m += 2 * AMX_ROWS) {
                    int second = m + AMX_ROWS < chunk_end;
                    const uint16_t *first_rows = m < full_rows ? x + m * k_size : tail;
                    const uint16_t *second_rows = m + AMX_ROWS < full_rows ? x + (m + AMX_ROWS) * k_size : tail;
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(5);
                    _tile_zero(6);
                    for (int64_t g = 0; g < depth; g++) {
                        if (m == chunk && p + 1 < passes) /* the next block's weights, while these rows pass */
                            for (int line = 0; line < AMX_BLOCKS * 1024; line += 64)
                                _mm_prefetch((const char *)(wp + AMX_ROWS * AMX_BLOCKS * k_size + g * AMX_BLOCKS * 512)
                                             + line, _MM_HINT_T1);
                        _tile_loadd(2, first_rows + g * 32, k_size * 2);
                        _tile_loadd(3, wp + g * AMX_BLOCKS * 512, 64);
                        _tile_dpbf16ps(0, 2, 3);
                        if (second) {
                            _tile_loadd(7, second_rows + g * 32, k_size * 2);
                            _tile_dpbf16ps(5, 7, 3);
                        }
                        _tile_loadd(4, wp + g * AMX_BLOCKS * 512 + 512, 64);
                        _tile_dpbf16ps(1, 2, 4);
                        if (second)
                            _tile_dpbf16ps(6, 7, 4);
                    }
                    store_sum_tiles(sums, m, second, chunk_end, columns, bias, y, n_size, n, y_bf16, gated);
                }
            }
        }
    }
    free(tail);
    return 0;
}

#else
int tandem_linear_amx_block_rows(void)
{
    return 0;
}

int tandem_linear_amx_min_rows(void)
{
    return 0;
}
#endif

#ifdef __AVX512BF16__
/* Causal attention of a prefill chunk in bfloat16 products with float32 sums, flash style, in two passes for
 * each key-value head and block of ATTENTION_ROWS query rows. The first scores ATTENTION_KEYS keys at a time and
 * softmaxes them online in float32 into bfloat16 probabilities for the whole context. A row's running maximum
 * moves only when a block's scores pass it by more than RESCALE_AFTER (in log2 units), so the probabilities stay
 * below 2^RESCALE_AFTER and the output rarely needs rescaling. The second multiplies the probabilities by the
 * values, keeping the sums of up to 64 output columns across all the keys; they are rescaled only at a block
 * where a row's maximum moved. The AMX build multiplies in tiles; the others, in AVX512-BF16's dot products of
 * bfloat16 pairs (vdpbf16ps), 16 float32 sums a vector. */
#define ATTENTION_ROWS 16
#define ATTENTION_KEYS 64
#define ATTENTION_MAX_HEAD_DIM 256
#define RESCALE_AFTER 8.0f

int tandem_prefill_attention_in_bfloat16(void)
{
    return 1;
}

/* v's 16 lanes rounded to bfloat16 into p[0, 16) */
static inline void store_bfloat16x16(uint16_t *p, __m512 v)
{
    _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(v));
}

/* 2^x for x up to RESCALE_AFTER, to about 8e-5 relative (the probabilities are rounded to bfloat16), with x
 * below -126 taken as -126: 2^n · p(f), f = x - n in [-0.5, 0.5], p of degree 3 fitted to 2^f's relative
 * error. */
static inline __m512 exp2_bounded(__m512 x)
{
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.05517166f), f, _mm512_set1_ps(0.24261115f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69326097f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.99992806f));
    return _mm512_scalef_ps(p, n);
}

/* Lanes [0, 16) of a 16-key vector that starts `first` keys into the block, where `limit` keys are valid. */
static inline __mmask16 keys_below(int64_t limit, int64_t first)
{
    int64_t valid = limit - first;
    return valid >= 16 ? (__mmask16)0xFFFF : valid <= 0 ? (__mmask16)0 : (__mmask16)((1u << valid) - 1);
}

/* Online softmax of one block's scores (in units of log2 once multiplied by `scale`, ATTENTION_KEYS per row,
 * `limits[i]` of row i valid; all of them where `whole`) into bfloat16 probabilities p (row i at p + i ·
 * p_stride) and each row's 16 lanes of sums. Where a row's maximum moves, rescale[i] is what its output and
 * sums so far are multiplied by (1 elsewhere); returns whether any row's did. */
static inline __attribute__((always_inline)) int softmax_block(
    const float scores[][ATTENTION_KEYS], const int64_t *limits, int whole, float scale, float *maximum,
    float sums[][16], float *rescale, uint16_t *p, int64_t p_stride)
{
    int moved = 0;
    for (int i = 0; i < ATTENTION_ROWS; i++) {
        __m512 s[ATTENTION_KEYS / 16];
        __mmask16 valid[ATTENTION_KEYS / 16];
        __m512 block_max = _mm512_set1_ps(-INFINITY);
        for (int v = 0; v < ATTENTION_KEYS / 16; v++) {
            valid[v] = whole ? (__mmask16)0xFFFF : keys_below(limits[i], v * 16);
            s[v] = _mm512_maskz_loadu_ps(valid[v], scores[i] + v * 16);
            block_max = _mm512_mask_max_ps(block_max, valid[v], block_max, s[v]);
        }
        /* scale > 0: a scaled score passes maximum + RESCALE_AFTER where the score passes that, unscaled */
        rescale[i] = 1.0f;
        if (_mm512_cmp_ps_mask(block_max, _mm512_set1_ps((maximum[i] + RESCALE_AFTER) / scale), _CMP_GT_OQ)) {
            float candidate = _mm512_reduce_max_ps(block_max) * scale;
            rescale[i] = exp2f(maximum[i] - candidate);
            maximum[i] = candidate;
            moved = 1;
        }
        __m512 total = _mm512_setzero_ps(), shift = _mm512_set1_ps(maximum[i]), factor = _mm512_set1_ps(scale);
        for (int v = 0; v < ATTENTION_KEYS / 16; v++) {
            __m512 e = _mm512_maskz_mov_ps(valid[v], exp2_bounded(_mm512_fmsub_ps(s[v], factor, shift)));
            total = _mm512_add_ps(total, e);
            store_bfloat16x16(p + i * p_stride + v * 16, e);
        }
        _mm512_store_ps(sums[i], _mm512_fmadd_ps(_mm512_load_ps(sums[i]), _mm512_set1_ps(rescale[i]), total));
    }
    return moved;
}

/* rows[i] lane j to rows[j] lane i, for 16 vectors of 16 four-byte lanes: pairs interleaved, then quads, then
 * the 128-bit quarters twice. */
static inline void transpose_lanes(__m512i rows[16])
{
    __m512i pairs[16], quads[16];
    for (int i = 0; i < 16; i += 2) {
        pairs[i] = _mm512_unpacklo_epi32(rows[i], rows[i + 1]);
        pairs[i + 1] = _mm512_unpackhi_epi32(rows[i], rows[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        quads[i] = _mm512_unpacklo_epi64(pairs[i], pairs[i + 2]);
        quads[i + 1] = _mm512_unpackhi_epi64(pairs[i], pairs[i + 2]);
        quads[i + 2] = _mm512_unpacklo_epi64(pairs[i + 1], pairs[i + 3]);
        quads[i + 3] = _mm512_unpackhi_epi64(pairs[i + 1], pairs[i + 3]);
    }
    /* quads[4a + j], quarter q: rows 4a..4a+3 of lane 4q + j */
    for (int j = 0; j < 4; j++) {
        __m512i even_low = _mm512_shuffle_i32x4(quads[j], quads[4 + j], 0x88);
        __m512i odd_low = _mm512_shuffle_i32x4(quads[j], quads[4 + j], 0xdd);
        __m512i even_high = _mm512_shuffle_i32x4(quads[8 + j], quads[12 + j], 0x88);
        __m512i odd_high = _mm512_shuffle_i32x4(quads[8 + j], quads[12 + j], 0xdd);
        rows[j] = _mm512_shuffle_i32x4(even_low, even_high, 0x88);
        rows[8 + j] = _mm512_shuffle_i32x4(even_low, even_high, 0xdd);
        rows[4 + j] = _mm512_shuffle_i32x4(odd_low, odd_high, 0x88);
        rows[12 + j] = _mm512_shuffle_i32x4(odd_low, odd_high, 0xdd);
    }
}

/* The chunk's queries and its context's keys and values, rounded to bfloat16 in the tiles' orders:
 * q [kv_heads][padded rows][head_dim], row t · group + j the query of token t and head kv_head · group + j (the
 * query heads that share a key-value head stacked, so that a chunk of few tokens fills its tiles); k [kv_heads]
 * [padded context / 16][head_dim / 32][16 column pairs][16 keys][2]; v [kv_heads][padded context / 32]
 * [head_dim / 16][16 key pairs][16 columns][2]. Padding is zero. Query row t is q_rows + t · q_stride; context
 * position c is slot slots[c] of the caches. */
static void pack_for_attention(const float *q_rows, int64_t q_stride, const float *k_cache, const float *v_cache,
                               const int64_t *slots, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                               int64_t tokens, int64_t padded_rows, int64_t context, int64_t padded_context,
                               uint16_t *q, uint16_t *k, uint16_t *v, int threads)
{
    int64_t kv_size = num_kv_heads * head_dim, group = num_heads / num_kv_heads;
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                                23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static) nowait
        for (int64_t r = 0; r < padded_rows; r++)
            for (int64_t kv = 0; kv < num_kv_heads; kv++) {
                int64_t t = r / group, h = kv * group + r % group;
                uint16_t *row = q + (kv * padded_rows + r) * head_dim;
                for (int64_t d = 0; d < head_dim; d += 16) {
                    __m512 values = t < tokens ? _mm512_loadu_ps(q_rows + t * q_stride + h * head_dim + d)
                                               : _mm512_setzero_ps();
                    store_bfloat16x16(row + d, values);
                }
            }
        /* keys: per 16 keys and 32 columns, each key's 16 column pairs of 4 bytes, transposed */
#pragma omp for schedule(static) collapse(2) nowait
        for (int64_t c0 = 0; c0 < padded_context; c0 += 16)
            for (int64_t h = 0; h < num_kv_heads; h++) {
                uint16_t *base = k + (h * (padded_context / 16) + c0 / 16) * (head_dim / 32) * 512;
                for (int64_t d = 0; d < head_dim; d += 32) {
                    __m512i pairs[16];
                    for (int i = 0; i < 16; i++) {
                        const float *key = c0 + i < context ? k_cache + slots[c0 + i] * kv_size + h * head_dim + d
                                                            : NULL;
                        pairs[i] = key ? (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(key + 16), _mm512_loadu_ps(key))
                                       : _mm512_setzero_si512();
                    }
                    transpose_lanes(pairs);
                    for (int pair = 0; pair < 16; pair++)
                        _mm512_storeu_si512(base + d / 32 * 512 + pair * 32, pairs[pair]);
                }
            }
        /* values: per pair of keys and 16 columns, the 32 values interleaved key by key */
#pragma omp for schedule(static)
        for (int64_t c = 0; c < padded_context; c += 2)
            for (int64_t h = 0; h < num_kv_heads; h++) {
                const float *first = c < context ? v_cache + slots[c] * kv_size + h * head_dim : NULL;
                const float *second = c + 1 < context ? v_cache + slots[c + 1] * kv_size + h * head_dim : NULL;
                uint16_t *base = v + ((h * (padded_context / 32) + c / 32) * (head_dim / 16)) * 512 + (c % 32) / 2 * 32;
                for (int64_t d = 0; d < head_dim; d += 16) {
                    __m512 a = first ? _mm512_loadu_ps(first + d) : _mm512_setzero_ps();
                    __m512 b = second ? _mm512_loadu_ps(second + d) : _mm512_setzero_ps();
                    __m512i both = (__m512i)_mm512_cvtne2ps_pbh(b, a); /* a's 16 values, then b's */
                    _mm512_storeu_si512(base + d / 16 * 512, _mm512_permutexvar_epi16(interleave, both));
                }
            }
    }
}

#ifdef __AMX_BF16__
/* sums: a tile number, 2 + s, spelled out: the tile instructions take it as a literal */
#define SCORE_KEYS(s, sums) \
    do { _tile_loadd(1, kb + (s) * 16 * head_dim + d * 512, 64); _tile_dpbf16ps(sums, 0, 1); } while (0)
#define VALUE_COLUMNS(c, sums) do { _tile_loadd(1, vp + (c) * 512, 64); _tile_dpbf16ps(sums, 0, 1); } while (0)

/* scores = the block's query rows (qh, head_dim apart) · its ATTENTION_KEYS keys (kb, in pack_for_attention's
 * layout), in tiles 2-5; tile 0 takes the queries and tile 1 the keys. */
static inline __attribute__((always_inline)) void score_block(const uint16_t *qh, const uint16_t *kb, int64_t head_dim,
                                                              float scores[][ATTENTION_KEYS])
{
    _tile_zero(2);
    _tile_zero(3);
    _tile_zero(4);
    _tile_zero(5);
    for (int64_t d = 0; d < head_dim / 32; d++) {
        _tile_loadd(0, qh + d * 32, head_dim * 2);
        SCORE_KEYS(0, 2);
        SCORE_KEYS(1, 3);
        SCORE_KEYS(2, 4);
        SCORE_KEYS(3, 5);
    }
    _tile_stored(2, &scores[0][0], ATTENTION_KEYS * 4);
    _tile_stored(3, &scores[0][16], ATTENTION_KEYS * 4);
    _tile_stored(4, &scores[0][32], ATTENTION_KEYS * 4);
    _tile_stored(5, &scores[0][48], ATTENTION_KEYS * 4);
}

/* The output tiles 2-5 of `columns` (up to 4) column tiles, stored into o [16][ATTENTION_MAX_HEAD_DIM] and
 * loaded back from it. */
static inline __attribute__((always_inline)) void store_output_tiles(float o[][ATTENTION_MAX_HEAD_DIM], int columns)
{
    _tile_stored(2, &o[0][0], ATTENTION_MAX_HEAD_DIM * 4);
    if (columns > 1)
        _tile_stored(3, &o[0][16], ATTENTION_MAX_HEAD_DIM * 4);
    if (columns > 2)
        _tile_stored(4, &o[0][32], ATTENTION_MAX_HEAD_DIM * 4);
    if (columns > 3)
        _tile_stored(5, &o[0][48], ATTENTION_MAX_HEAD_DIM * 4);
}

static inline __attribute__((always_inline)) void load_output_tiles(float o[][ATTENTION_MAX_HEAD_DIM], int columns)
{
    _tile_loadd(2, &o[0][0], ATTENTION_MAX_HEAD_DIM * 4);
    if (columns > 1)
        _tile_loadd(3, &o[0][16], ATTENTION_MAX_HEAD_DIM * 4);
    if (columns > 2)
        _tile_loadd(4, &o[0][32], ATTENTION_MAX_HEAD_DIM * 4);
    if (columns > 3)
        _tile_loadd(5, &o[0][48], ATTENTION_MAX_HEAD_DIM * 4);
}

/* out_rows[i] (NULL past the chunk's rows) = row i's probabilities over `blocks` key blocks (p, p_stride apart)
 * · the values (vh, in pack_for_attention's layout), rescaled at each block that moved (rescale[block][i]) and
 * divided by the row's sum (inverse[i] its inverse): 64 columns at a time in tiles 2-5, stored and rescaled only
 * at a block where a row's maximum moved; tile 0 takes the probabilities and tile 1 the values. */
static void attend_values(const uint16_t *p, int64_t p_stride, const uint16_t *vh, int64_t head_dim, int64_t blocks,
                          const int32_t *moved, const float (*rescale)[ATTENTION_ROWS], const float *inverse,
                          uint16_t *const *out_rows)
{
    __attribute__((aligned(64))) float o[ATTENTION_ROWS][ATTENTION_MAX_HEAD_DIM];
    for (int64_t c0 = 0; c0 < head_dim / 16; c0 += 4) {
        int columns = head_dim / 16 - c0 < 4 ? (int)(head_dim / 16 - c0) : 4;
        _tile_zero(2);
        _tile_zero(3);
        _tile_zero(4);
        _tile_zero(5);
        for (int64_t block = 0; block < blocks; block++) {
            if (moved[block]) {
                store_output_tiles(o, columns);
                for (int i = 0; i < ATTENTION_ROWS; i++) {
                    __m512 factor = _mm512_set1_ps(rescale[block][i]);
                    for (int c = 0; c < columns; c++)
                        _mm512_store_ps(o[i] + c * 16, _mm512_mul_ps(_mm512_load_ps(o[i] + c * 16), factor));
                }
                load_output_tiles(o, columns);
            }
            for (int half = 0; half < ATTENTION_KEYS / 32; half++) {
                int64_t pair_block = block * (ATTENTION_KEYS / 32) + half;
                const uint16_t *vp = vh + (pair_block * (head_dim / 16) + c0) * 512;
                _tile_loadd(0, p + pair_block * 32, p_stride * 2);
                VALUE_COLUMNS(0, 2);
                if (columns > 1)
                    VALUE_COLUMNS(1, 3);
                if (columns > 2)
                    VALUE_COLUMNS(2, 4);
                if (columns > 3)
                    VALUE_COLUMNS(3, 5);
            }
        }
        store_output_tiles(o, columns);
        for (int i = 0; i < ATTENTION_ROWS && out_rows[i]; i++) {
            __m512 factor = _mm512_set1_ps(inverse[i]);
            for (int c = 0; c < columns; c++)
                store_bfloat16x16(out_rows[i] + (c0 + c) * 16, _mm512_mul_ps(_mm512_load_ps(o[i] + c * 16), factor));
        }
    }
}
#undef SCORE_KEYS
#undef VALUE_COLUMNS
#else
#define SCORE_ROWS 8   /* query rows and 16-key panels whose sums a pass of score_block keeps: 16 of the 32 */
#define SCORE_PANELS 2 /* vector registers */
#define VALUE_ROWS 4   /* rows whose sums of 64 columns a pass of attend_values keeps: 16 vector registers */

/* The bfloat16 pair at p in every lane. */
static inline __m512bh broadcast_pair(const uint16_t *p)
{
    int32_t pair;
    memcpy(&pair, p, sizeof pair);
    return (__m512bh)_mm512_set1_epi32(pair);
}

/* scores = the block's query rows (qh, head_dim apart) · its ATTENTION_KEYS keys (kb, in pack_for_attention's
 * layout: panels of 16 keys, each [head_dim / 2 column pairs][16 keys][2]). */
static inline __attribute__((always_inline)) void score_block(const uint16_t *qh, const uint16_t *kb, int64_t head_dim,
                                                              float scores[][ATTENTION_KEYS])
{
    for (int r0 = 0; r0 < ATTENTION_ROWS; r0 += SCORE_ROWS)
        for (int s0 = 0; s0 < ATTENTION_KEYS / 16; s0 += SCORE_PANELS) {
            __m512 sums[SCORE_ROWS][SCORE_PANELS];
            for (int r = 0; r < SCORE_ROWS; r++)
                for (int s = 0; s < SCORE_PANELS; s++)
                    sums[r][s] = _mm512_setzero_ps();
            for (int64_t pair = 0; pair < head_dim / 2; pair++) {
                __m512bh keys[SCORE_PANELS];
                for (int s = 0; s < SCORE_PANELS; s++)
                    keys[s] = (__m512bh)_mm512_loadu_si512(kb + (s0 + s) * 16 * head_dim + pair * 32);
                for (int r = 0; r < SCORE_ROWS; r++) {
                    __m512bh q = broadcast_pair(qh + (r0 + r) * head_dim + 2 * pair);
                    for (int s = 0; s < SCORE_PANELS; s++)
                        sums[r][s] = _mm512_dpbf16_ps(sums[r][s], q, keys[s]);
                }
            }
            for (int r = 0; r < SCORE_ROWS; r++)
                for (int s = 0; s < SCORE_PANELS; s++)
                    _mm512_store_ps(scores[r0 + r] + (s0 + s) * 16, sums[r][s]);
        }
}

/* attend_values for rows [r0, r0 + VALUE_ROWS) and `columns` (2 or 4) vectors of 16 output columns from c0. */
static inline __attribute__((always_inline)) void attend_value_columns(
    const uint16_t *p, int64_t p_stride, const uint16_t *vh, int64_t head_dim, int64_t blocks, const int32_t *moved,
    const float (*rescale)[ATTENTION_ROWS], const float *inverse, uint16_t *const *out_rows, int r0, int64_t c0,
    int columns)
{
    __m512 sums[VALUE_ROWS][4];
    for (int i = 0; i < VALUE_ROWS; i++)
        for (int c = 0; c < columns; c++)
            sums[i][c] = _mm512_setzero_ps();
    for (int64_t block = 0; block < blocks; block++) {
        if (moved[block])
            for (int i = 0; i < VALUE_ROWS; i++)
                for (int c = 0; c < columns; c++)
                    sums[i][c] = _mm512_mul_ps(sums[i][c], _mm512_set1_ps(rescale[block][r0 + i]));
        for (int64_t pair = block * ATTENTION_KEYS / 2; pair < (block + 1) * ATTENTION_KEYS / 2; pair++) {
            const uint16_t *vp = vh + (pair / 16 * (head_dim / 16) + c0) * 512 + pair % 16 * 32;
            __m512bh values[4];
            for (int c = 0; c < columns; c++)
                values[c] = (__m512bh)_mm512_loadu_si512(vp + c * 512);
            for (int i = 0; i < VALUE_ROWS; i++) {
                __m512bh probability = broadcast_pair(p + (r0 + i) * p_stride + 2 * pair);
                for (int c = 0; c < columns; c++)
                    sums[i][c] = _mm512_dpbf16_ps(sums[i][c], probability, values[c]);
            }
        }
    }
    for (int i = 0; i < VALUE_ROWS && out_rows[r0 + i]; i++)
        for (int c = 0; c < columns; c++)
            store_bfloat16x16(out_rows[r0 + i] + (c0 + c) * 16,
                              _mm512_mul_ps(sums[i][c], _mm512_set1_ps(inverse[r0 + i])));
}

/* out_rows[i] (NULL past the chunk's rows) = row i's probabilities over `blocks` key blocks (p, p_stride apart)
 * · the values (vh, in pack_for_attention's layout: [key pairs / 16][head_dim / 16][16 key pairs][16 columns][2]),
 * rescaled at each block that moved (rescale[block][i]) and divided by the row's sum (inverse[i] its inverse). */
static void attend_values(const uint16_t *p, int64_t p_stride, const uint16_t *vh, int64_t head_dim, int64_t blocks,
                          const int32_t *moved, const float (*rescale)[ATTENTION_ROWS], const float *inverse,
                          uint16_t *const *out_rows)
{
    for (int r0 = 0; r0 < ATTENTION_ROWS && out_rows[r0]; r0 += VALUE_ROWS)
        for (int64_t c0 = 0; c0 < head_dim / 16; c0 += 4)
            if (head_dim / 16 - c0 >= 4)
                attend_value_columns(p, p_stride, vh, head_dim, blocks, moved, rescale, inverse, out_rows, r0, c0, 4);
            else
                attend_value_columns(p, p_stride, vh, head_dim, blocks, moved, rescale, inverse, out_rows, r0, c0, 2);
}
#endif

/* Attention of a prefill chunk of `tokens` queries (rows of float32 q_rows, q_stride apart, each its heads'
 * head_dim columns in turn) over `context` positions (slots[c] of one layer's float32 caches [slots, kv_heads,
 * head_dim]), of which the chunk's own are the last: query row i attends positions up to context - tokens + i.
 * out [tokens][heads][head_dim] bfloat16. Returns -1, computing nothing, for a shape it does not take:
 * head_dim not a multiple of 32 or above 256, heads not a multiple of kv_heads, or context < tokens; -2
 * where its working memory could not be allocated. */
int tandem_prefill_attention(const float *q_rows, int64_t q_stride, const float *k_cache, const float *v_cache,
                             const int64_t *slots, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                             int64_t tokens, int64_t context, float scale, uint16_t *out, int threads)
{
    if (head_dim % 32 || head_dim > ATTENTION_MAX_HEAD_DIM || num_heads % num_kv_heads || context < tokens)
        return -1;
    int64_t group = num_heads / num_kv_heads, q_rows_per_kv = tokens * group;
    int64_t q_blocks = (q_rows_per_kv + ATTENTION_ROWS - 1) / ATTENTION_ROWS, padded_rows = q_blocks * ATTENTION_ROWS;
    int64_t padded_context = (context + ATTENTION_KEYS - 1) / ATTENTION_KEYS * ATTENTION_KEYS;
    int64_t key_blocks = padded_context / ATTENTION_KEYS;
    int64_t offset = context - tokens;
    float log2_scale = scale * 1.44269504f;
    /* shared: the packed queries, keys and values; each thread's: its probabilities [16][padded context],
     * and each key block's rescale factors [16] and whether any moved */
    size_t q_count = (size_t)(num_kv_heads * padded_rows * head_dim);
    size_t kv_count = (size_t)(num_kv_heads * padded_context * head_dim);
    size_t p_count = (size_t)(ATTENTION_ROWS * padded_context);
    size_t thread_bytes = p_count * 2 + (size_t)key_blocks * (ATTENTION_ROWS * 4 + 4);
    thread_bytes = (thread_bytes + 63) / 64 * 64;
    uint16_t *q = scratch((q_count + 2 * kv_count) * 2 + thread_bytes * threads);
    if (!q)
        return -2;
    uint16_t *k = q + q_count, *v = k + kv_count;
    char *thread_memory = (char *)(v + kv_count);
    pack_for_attention(q_rows, q_stride, k_cache, v_cache, slots, num_heads, num_kv_heads, head_dim, tokens,
                       padded_rows, context, padded_context, q, k, v, threads);
#pragma omp parallel num_threads(threads)
    {
        __attribute__((aligned(64))) float scores[ATTENTION_ROWS][ATTENTION_KEYS];
        __attribute__((aligned(64))) float sums[ATTENTION_ROWS][16];
        float maximum[ATTENTION_ROWS], inverse[ATTENTION_ROWS];
        int64_t limits[ATTENTION_ROWS];
        uint16_t *out_rows[ATTENTION_ROWS];
        char *mine = thread_memory + thread_bytes * omp_get_thread_num();
        uint16_t *p = (uint16_t *)mine;
        float (*rescale)[ATTENTION_ROWS] = (float (*)[ATTENTION_ROWS])(mine + p_count * 2);
        int32_t *moved = (int32_t *)(mine + p_count * 2 + (size_t)key_blocks * ATTENTION_ROWS * 4);
#ifdef __AMX_BF16__
        configure_tiles(6); /* 0: queries or probabilities; 1: keys or values; 2-5: sums */
#endif
        /* key-value head by key-value head, so that the threads read one head's keys and values at a time; in
         * each, the last blocks, which attend the most keys, first */
#pragma omp for schedule(dynamic) collapse(2)
        for (int64_t kv = 0; kv < num_kv_heads; kv++)
            for (int64_t b = q_blocks - 1; b >= 0; b--) {
                int64_t row0 = b * ATTENTION_ROWS, last_rows_token = (row0 + ATTENTION_ROWS - 1) / group;
                int64_t keys = offset + (last_rows_token < tokens ? last_rows_token : tokens - 1) + 1;
                int64_t blocks = (keys + ATTENTION_KEYS - 1) / ATTENTION_KEYS;
                const uint16_t *qh = q + (kv * padded_rows + row0) * head_dim;
                const uint16_t *kh = k + kv * padded_context * head_dim, *vh = v + kv * padded_context * head_dim;
                for (int i = 0; i < ATTENTION_ROWS; i++) {
                    maximum[i] = -INFINITY;
                    _mm512_store_ps(sums[i], _mm512_setzero_ps());
                }
                for (int64_t block = 0; block < blocks; block++) {
                    int64_t first = block * ATTENTION_KEYS;
                    score_block(qh, kh + first * head_dim, head_dim, scores);
                    for (int i = 0; i < ATTENTION_ROWS; i++) {
                        int64_t token = (row0 + i) / group;
                        limits[i] = offset + (token < tokens ? token : tokens - 1) + 1 - first;
                    }
                    /* the first block's rescaling multiplies nothing */
                    moved[block] = softmax_block(scores, limits, limits[0] >= ATTENTION_KEYS, log2_scale, maximum,
                                                 sums, rescale[block], p + first, padded_context) && block > 0;
                }
                for (int i = 0; i < ATTENTION_ROWS; i++) {
                    int64_t row = row0 + i, token = row / group, head = kv * group + row % group;
                    inverse[i] = 1.0f / _mm512_reduce_add_ps(_mm512_load_ps(sums[i]));
                    out_rows[i] = row < q_rows_per_kv ? out + (token * num_heads + head) * head_dim : NULL;
                }
                attend_values(p, padded_context, vh, head_dim, blocks, moved, rescale, inverse, out_rows);
            }
    }
    return 0;
}
#else
int tandem_prefill_attention_in_bfloat16(void)
{
    return 0;
}

int tandem_prefill_attention(const float *q_rows, int64_t q_stride, const float *k_cache, const float *v_cache,
                             const int64_t *slots, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                             int64_t tokens, int64_t context, float scale, uint16_t *out, int threads)
{
    return -1; /* the builds with AVX512-BF16's alone */
}
#endif

/* x [rows, k_size] float32, w packed as above from [n_size, k_size] weights: float16 bits where scales is NULL
 * (k_size a multiple of CHUNK); else int8 (k_size a multiple of INTEGER_ROW_GROUP) with a float16 scale per `group`
 * columns (a multiple of INTEGER_ROW_GROUP dividing k_size; 0 for a whole row), or uint4 with mins, in the layouts of
 * integer_linear (of amx_linear for int8 in the AMX build); bias [n_size] float32 or NULL, y [rows, n_size]
 * float32; all contiguous. Returns -2 where it cannot allocate its working memory. */
int tandem_linear(const float *x, int64_t rows, int64_t k_size, const void *w, const uint16_t *scales,
                  const uint16_t *mins, int64_t group, int64_t n_size, const float *bias, float *y, int threads)
{
    if (rows == 0)
        return 0;
#ifdef __AMX_BF16__
    if (scales && !mins) {
        amx_linear(x, rows, k_size, w, scales, n_size, bias, y, threads);
        return 0;
    }
#endif
    if (scales)
        return integer_linear(x, rows, k_size, w, scales, mins, mins ? INTEGER_ROW_GROUP : group ? group : k_size,
                              n_size, bias, y, threads);
    int64_t tiles = (n_size + TILE_N - 1) / TILE_N;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < tiles; t++)
        tile_all_rows(x, rows, k_size, w, n_size, bias, y, t);
    return 0;
}

/* e^x for x <= 0 (scores minus their running maximum): 2^n · p(r), r = x - n·ln 2, |r| <= ln 2 / 2,
 * p the degree-6 Taylor polynomial (relative error below 2e-7). */
static inline __m256 exp_nonpositive(__m256 x)
{
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(exponent));
}

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define KEYS 16 /* keys scored at once */

/* The eight sums of a[0..7], as one vector. */
static inline __m256 horizontal_sums(const __m256 a[8])
{
    __m256 low = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 high = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20), _mm256_permute2f128_ps(low, high, 0x31));
}

/* scores[h][t] = q[h] · keys[t] for `heads` query heads (a constant at each call site), q[h] head_dim
 * floats after q[h - 1]: every key row is loaded once for all of them. */
static inline __attribute__((always_inline)) void score_keys(
    const float *q, const float *const keys[KEYS], int64_t head_dim, int heads, float (*scores)[KEYS])
{
    for (int first = 0; first < KEYS; first += 8) {
        __m256 partial[3][8];
        for (int t = 0; t < 8; t++) {
            chunk_vector sum[3];
            for (int h = 0; h < heads; h++)
                sum[h] = chunk_zero();
            for (int64_t d = 0; d < head_dim; d += CHUNK) {
                chunk_vector key = chunk_load(keys[first + t] + d);
                for (int h = 0; h < heads; h++)
                    sum[h] = chunk_fmadd(chunk_load(q + h * head_dim + d), key, sum[h]);
            }
            for (int h = 0; h < heads; h++)
                partial[h][t] = chunk_fold(sum[h]);
        }
        for (int h = 0; h < heads; h++)
            _mm256_storeu_ps(scores[h] + first, horizontal_sums(partial[h]));
    }
}

/* acc[h][d, d + lanes · CHUNK) = acc[h][…] · corrections[h] + Σ_t scores[h][t] · values[t][…] for `heads`
 * query heads (`lanes` and `heads` constants at each call site, so the sums stay in registers): every
 * value row is loaded once for all the heads. */
static inline __attribute__((always_inline)) void accumulate_slice(
    float (*acc)[MAX_HEAD_DIM], float (*scores)[KEYS], const float *corrections,
    const float *const values[KEYS], int count, int64_t d, int lanes, int heads)
{
    chunk_vector a[3][4];
    for (int h = 0; h < heads; h++) {
        chunk_vector correction = chunk_set1(corrections[h]);
        for (int l = 0; l < lanes; l++)
            a[h][l] = chunk_mul(chunk_load(acc[h] + d + CHUNK * l), correction);
    }
    for (int t = 0; t < count; t++) {
        chunk_vector p[3];
        for (int h = 0; h < heads; h++)
            p[h] = chunk_set1(scores[h][t]);
        for (int l = 0; l < lanes; l++) {
            chunk_vector v = chunk_load(values[t] + d + CHUNK * l);
            for (int h = 0; h < heads; h++)
                a[h][l] = chunk_fmadd(p[h], v, a[h][l]);
        }
    }
    for (int h = 0; h < heads; h++)
        for (int l = 0; l < lanes; l++)
            chunk_store(acc[h] + d + CHUNK * l, a[h][l]);
}

/* The same over the whole head, four vectors at a time. */
static inline __attribute__((always_inline)) void accumulate_values(
    float (*acc)[MAX_HEAD_DIM], float (*scores)[KEYS], const float *corrections,
    const float *const values[KEYS], int count, int64_t head_dim, int heads)
{
    int64_t d = 0;
    for (; d + 4 * CHUNK <= head_dim; d += 4 * CHUNK)
        accumulate_slice(acc, scores, corrections, values, count, d, 4, heads);
    switch ((head_dim - d) / CHUNK) {
    case 1: accumulate_slice(acc, scores, corrections, values, count, d, 1, heads); break;
    case 2: accumulate_slice(acc, scores, corrections, values, count, d, 2, heads); break;
    case 3: accumulate_slice(acc, scores, corrections, values, count, d, 3, heads); break;
    }
}

/* Online-softmax attention state of query rows over the positions seen so far: their running maximum
 * score, the running sum of e^(score - maximum), and the values weighted by those terms. */
typedef struct {
    float *max, *sum;
    float (*acc)[MAX_HEAD_DIM];
} attention_state;

static void start_state(attention_state state, int rows, int64_t head_dim)
{
    for (int r = 0; r < rows; r++) {
        state.max[r] = -INFINITY;
        state.sum[r] = 0.0f;
        for (int64_t d = 0; d < head_dim; d++)
            state.acc[r][d] = 0.0f;
    }
}

/* Folds the state of the same rows over further positions (`more`) into `state`. */
static void merge_state(attention_state state, attention_state more, int rows, int64_t head_dim)
{
    for (int r = 0; r < rows; r++) {
        float maximum = more.max[r] > state.max[r] ? more.max[r] : state.max[r];
        float mine = state.max[r] == -INFINITY ? 0.0f : expf(state.max[r] - maximum);
        float theirs = more.max[r] == -INFINITY ? 0.0f : expf(more.max[r] - maximum);
        state.max[r] = maximum;
        state.sum[r] = state.sum[r] * mine + more.sum[r] * theirs;
        for (int64_t d = 0; d < head_dim; d++)
            state.acc[r][d] = state.acc[r][d] * mine + more.acc[r][d] * theirs;
    }
}

/* Where the next position of a range is in the paged cache: its block table entry and offset, and the
 * slot of the last position found. */
typedef struct {
    const int64_t *block_table;
    int64_t block, offset, slot;
} position_cursor;

/* The key and value rows of the next `count` positions (KEYS rows: a row past them repeats the last
 * one; its score is masked), each prefetched into L2: they are read a group later, so the loads of one
 * group overlap the arithmetic of the one before. A group is 128 cache lines of a 64-column head, more
 * misses than L1 keeps in flight: prefetched into L1, they stalled the loads, and one sequence's attention
 * ran 1.4x slower (bench/kernels_ab.py). */
static void gather_rows(position_cursor *cursor, int count, const float *k_cache, const float *v_cache,
                        int64_t block_size, int64_t kv_stride, int64_t kv_head, int64_t head_dim,
                        const float *keys[KEYS], const float *values[KEYS])
{
    for (int t = 0; t < KEYS; t++) {
        if (t < count) {
            cursor->slot = cursor->block_table[cursor->block] * block_size + cursor->offset;
            if (++cursor->offset == block_size) {
                cursor->offset = 0;
                cursor->block++;
            }
            for (int64_t d = 0; d < head_dim; d += 64 / sizeof(float)) {
                _mm_prefetch((const char *)(k_cache + cursor->slot * kv_stride + kv_head * head_dim + d), _MM_HINT_T1);
                _mm_prefetch((const char *)(v_cache + cursor->slot * kv_stride + kv_head * head_dim + d), _MM_HINT_T1);
            }
        }
        keys[t] = k_cache + cursor->slot * kv_stride + kv_head * head_dim;
        values[t] = v_cache + cursor->slot * kv_stride + kv_head * head_dim;
    }
}

/* Advances the state of `rows` query rows (queries: rows × head_dim floats, already scaled) over
 * positions [begin, end) of one key-value head, read through the block table, KEYS keys at a time: each
 * key and value row is loaded from memory once for all the query rows, three at a time from L1. */
static inline __attribute__((always_inline)) void attend_positions_of(
    const float *queries, int rows, attention_state state, const float *k_cache, const float *v_cache,
    const int64_t *block_table, int64_t begin, int64_t end, int64_t block_size, int64_t kv_stride, int64_t kv_head,
    int64_t head_dim)
{
    float scores[3][KEYS], corrections[3];
    const __m256 lane_index = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), past = _mm256_set1_ps(-INFINITY);
    position_cursor cursor = {block_table, begin / block_size, begin % block_size, 0};
    const float *rows_of[2][2][KEYS]; /* [group parity][keys, values] */
    if (begin < end)
        gather_rows(&cursor, end - begin < KEYS ? (int)(end - begin) : KEYS, k_cache, v_cache, block_size,
                    kv_stride, kv_head, head_dim, rows_of[0][0], rows_of[0][1]);
    for (int64_t start = begin, group = 0; start < end; start += KEYS, group++) {
        int count = end - start < KEYS ? (int)(end - start) : KEYS;
        int64_t next = start + KEYS;
        if (next < end)
            gather_rows(&cursor, end - next < KEYS ? (int)(end - next) : KEYS, k_cache, v_cache, block_size,
                        kv_stride, kv_head, head_dim, rows_of[(group + 1) % 2][0], rows_of[(group + 1) % 2][1]);
        const float *const *keys = rows_of[group % 2][0], *const *values = rows_of[group % 2][1];
        for (int first = 0; first < rows; first += 3) {
            int heads = rows - first < 3 ? rows - first : 3;
            const float *q = queries + first * head_dim;
            if (heads == 3)
                score_keys(q, keys, head_dim, 3, scores);
            else
                for (int h = 0; h < heads; h++)
                    score_keys(q + h * head_dim, keys, head_dim, 1, scores + h);
            for (int h = 0; h < heads; h++) {
                int r = first + h;
                __m256 chunk_maximum = _mm256_set1_ps(state.max[r]);
                for (int t = 0; t < KEYS; t += 8) {
                    __m256 inside = _mm256_cmp_ps(_mm256_add_ps(_mm256_set1_ps((float)t), lane_index),
                                                  _mm256_set1_ps((float)count), _CMP_LT_OQ);
                    __m256 score = _mm256_blendv_ps(past, _mm256_loadu_ps(scores[h] + t), inside);
                    _mm256_storeu_ps(scores[h] + t, score);
                    chunk_maximum = _mm256_max_ps(chunk_maximum, score);
                }
                float chunk_max = horizontal_max(chunk_maximum);
                float correction = state.max[r] == -INFINITY ? 0.0f : expf(state.max[r] - chunk_max);
                state.max[r] = chunk_max;
                __m256 total = _mm256_setzero_ps(), maximum = _mm256_set1_ps(chunk_max);
                for (int t = 0; t < KEYS; t += 8) {
                    __m256 p = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(scores[h] + t), maximum));
                    _mm256_storeu_ps(scores[h] + t, p);
                    total = _mm256_add_ps(total, p);
                }
                state.sum[r] = state.sum[r] * correction + horizontal_sum(total);
                corrections[h] = correction;
            }
            if (heads == 3)
                accumulate_values(state.acc + first, scores, corrections, values, count, head_dim, 3);
            else
                for (int h = 0; h < heads; h++)
                    accumulate_values(state.acc + first + h, scores + h, corrections + h, values, count, head_dim,
                                      1);
        }
    }
}

/* The same, compiled apart for the common head sizes, so that their loops over a head unroll into
 * registers. */
static void attend_positions(const float *queries, int rows, attention_state state, const float *k_cache,
                             const float *v_cache, const int64_t *block_table, int64_t begin, int64_t end,
                             int64_t block_size, int64_t kv_stride, int64_t kv_head, int64_t head_dim)
{
#define ATTEND(size) attend_positions_of(queries, rows, state, k_cache, v_cache, block_table, begin, end, \
                                         block_size, kv_stride, kv_head, size)
    switch (head_dim) {
    case 64: ATTEND(64); break;
    case 128: ATTEND(128); break;
    default: ATTEND(head_dim);
    }
#undef ATTEND
}

/* Positions every sequence reads from the same blocks: the leading block-table entries all the tables
 * hold, within every context. */
static int64_t shared_positions(const int64_t *const *block_tables, const int64_t *context_lens, int64_t num_seqs,
                                int64_t block_size)
{
    int64_t shortest = context_lens[0];
    for (int64_t s = 1; s < num_seqs; s++)
        shortest = context_lens[s] < shortest ? context_lens[s] : shortest;
    int64_t blocks = (shortest + block_size - 1) / block_size;
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t s = 1; s < num_seqs; s++)
            if (block_tables[s][b] != block_tables[0][b])
                return b * block_size;
    return shortest;
}

#define MIN_SHARED (4 * KEYS) /* fewer shared positions are read with each sequence's own */

/* q [num_seqs, num_heads, head_dim], each sequence's query q_stride floats after the last one's (the
 * heads of one sequence contiguous); out [num_seqs, num_heads, head_dim]; k_cache, v_cache [num_slots,
 * num_kv_heads, head_dim] (one layer); block_tables [num_seqs]: each sequence's block ids, at least
 * ceil(context_len / block_size) of them; context_lens [num_seqs], each at least 1.
 *
 * The positions all the sequences share (a common prefix's blocks, or a lone sequence's whole context)
 * are read once for all of them, cut into pieces so that every thread has work: each piece leaves the
 * attention state of every query row that reads its key-value head. Then each sequence's key-value
 * heads merge those states and go on over the sequence's own positions.
 *
 * Returns -1, computing nothing, for a shape it does not take: head_dim not a multiple of CHUNK or above
 * MAX_HEAD_DIM, more than MAX_GROUP query heads per key-value head; -2 where memory for the shared
 * positions' states runs out. */
int tandem_decode_attention(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                            const int64_t *const *block_tables, const int64_t *context_lens, int64_t num_seqs,
                            int64_t block_size, int64_t num_heads, int64_t num_kv_heads,
                            int64_t head_dim, float scale, float *out, int threads)
{
    int64_t group = num_heads / num_kv_heads, kv_stride = num_kv_heads * head_dim;
    if (head_dim % CHUNK || head_dim > MAX_HEAD_DIM || group > MAX_GROUP || group * num_kv_heads != num_heads)
        return -1;
    int64_t shared = shared_positions(block_tables, context_lens, num_seqs, block_size);
    if (shared < MIN_SHARED)
        shared = 0;
    int64_t pieces = shared ? (4 * threads + num_kv_heads - 1) / num_kv_heads : 0;
    if (pieces > shared / MIN_SHARED)
        pieces = shared / MIN_SHARED;
    int64_t piece_len = pieces ? (shared + pieces - 1) / pieces : 0;
    /* per piece and key-value head: the scaled queries, then the state, of all the query rows reading it */
    int64_t rows = num_seqs * group, piece_floats = rows * (head_dim + MAX_HEAD_DIM + 2);
    float *piece_memory = pieces ? malloc(sizeof(float) * pieces * num_kv_heads * piece_floats) : 0;
    if (pieces && !piece_memory)
        return -2;
#define PIECE_QUERIES(p, h) (piece_memory + ((p) * num_kv_heads + (h)) * piece_floats)
#define PIECE_STATE(p, h) ((attention_state){ \
        .max = PIECE_QUERIES(p, h) + rows * head_dim, .sum = PIECE_QUERIES(p, h) + rows * head_dim + rows, \
        .acc = (float (*)[MAX_HEAD_DIM])(PIECE_QUERIES(p, h) + rows * head_dim + 2 * rows)})
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < pieces * num_kv_heads; item++) {
            int64_t piece = item / num_kv_heads, kv_head = item % num_kv_heads;
            float *queries = PIECE_QUERIES(piece, kv_head);
            attention_state state = PIECE_STATE(piece, kv_head);
            for (int64_t s = 0; s < num_seqs; s++)
                for (int64_t i = 0; i < group * head_dim; i++)
                    queries[s * group * head_dim + i] = q[s * q_stride + kv_head * group * head_dim + i] * scale;
            start_state(state, (int)rows, head_dim);
            int64_t begin = piece * piece_len, end = begin + piece_len < shared ? begin + piece_len : shared;
            attend_positions(queries, (int)rows, state, k_cache, v_cache, block_tables[0], begin, end, block_size,
                             kv_stride, kv_head, head_dim);
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_seqs * num_kv_heads; item++) {
            int64_t seq = item / num_kv_heads, kv_head = item % num_kv_heads, head = kv_head * group * head_dim;
            float queries[MAX_GROUP * MAX_HEAD_DIM], max[MAX_GROUP], sum[MAX_GROUP], acc[MAX_GROUP][MAX_HEAD_DIM];
            attention_state state = {max, sum, acc};
            for (int64_t i = 0; i < group * head_dim; i++)
                queries[i] = q[seq * q_stride + head + i] * scale;
            start_state(state, (int)group, head_dim);
            for (int64_t piece = 0; piece < pieces; piece++) {
                attention_state mine = PIECE_STATE(piece, kv_head);
                mine.max += seq * group;
                mine.sum += seq * group;
                mine.acc += seq * group;
                merge_state(state, mine, (int)group, head_dim);
            }
            attend_positions(queries, (int)group, state, k_cache, v_cache, block_tables[seq], shared,
                             context_lens[seq], block_size, kv_stride, kv_head, head_dim);
            for (int g = 0; g < group; g++)
                for (int64_t d = 0; d < head_dim; d++)
                    out[seq * num_heads * head_dim + head + g * head_dim + d] = acc[g][d] / sum[g];
        }
    }
#undef PIECE_QUERIES
#undef PIECE_STATE
    free(piece_memory);
    return 0;
}

/* Prefill attention in float32 FMAs, for every build: query rows stacked PREFILL_ROWS at a time against blocks
 * of PREFILL_KEYS keys, each key block scored for all of them, then its values accumulated for all of them, with
 * an online softmax between. The keys are packed in panels of KEY_PANEL, one vector pair a column, so that a
 * score block is a small matrix multiply of broadcast query values by key vectors, as the values' block is of
 * broadcast probabilities by value vectors. */
#define PREFILL_ROWS 6 /* 12 sums, 2 key or value vectors and a broadcast: 15 of the 16 vector registers */
#define PREFILL_KEYS 64
#define KEY_PANEL 16

/* One layer's keys and values at the `context` positions slots[c], each key-value head's apart, zero from
 * `context` up to padded_context: keys [kv_heads][padded_context / KEY_PANEL][head_dim][KEY_PANEL], values
 * [kv_heads][padded_context][head_dim]. */
static void pack_keys_values(const float *k_cache, const float *v_cache, const int64_t *slots, int64_t num_kv_heads,
                             int64_t head_dim, int64_t context, int64_t padded_context, float *keys, float *values,
                             int threads)
{
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
    for (int64_t kv = 0; kv < num_kv_heads; kv++)
        for (int64_t first = 0; first < padded_context; first += KEY_PANEL) {
            float *panel = keys + (kv * padded_context + first) * head_dim;
            for (int t = 0; t < KEY_PANEL; t++) {
                int64_t c = first + t;
                float *value = values + (kv * padded_context + c) * head_dim;
                if (c >= context) {
                    for (int64_t d = 0; d < head_dim; d++)
                        panel[d * KEY_PANEL + t] = value[d] = 0.0f;
                    continue;
                }
                const float *key = k_cache + (slots[c] * num_kv_heads + kv) * head_dim;
                for (int64_t d = 0; d < head_dim; d++)
                    panel[d * KEY_PANEL + t] = key[d];
                memcpy(value, v_cache + (slots[c] * num_kv_heads + kv) * head_dim, sizeof(float) * head_dim);
            }
        }
}

/* scores[r][0, PREFILL_KEYS) = query[r] · the block's keys, from its KEY_PANEL-key panels. */
static inline void score_key_block(const float *const query[PREFILL_ROWS], const float *panels, int64_t head_dim,
                                   float scores[PREFILL_ROWS][PREFILL_KEYS])
{
    for (int p = 0; p < PREFILL_KEYS / KEY_PANEL; p++) {
        const float *panel = panels + p * KEY_PANEL * head_dim;
        __m256 sums[PREFILL_ROWS][2];
        for (int r = 0; r < PREFILL_ROWS; r++)
            sums[r][0] = sums[r][1] = _mm256_setzero_ps();
        for (int64_t d = 0; d < head_dim; d++) {
            __m256 low = _mm256_load_ps(panel + d * KEY_PANEL), high = _mm256_load_ps(panel + d * KEY_PANEL + 8);
            for (int r = 0; r < PREFILL_ROWS; r++) {
                __m256 q = _mm256_broadcast_ss(query[r] + d);
                sums[r][0] = _mm256_fmadd_ps(q, low, sums[r][0]);
                sums[r][1] = _mm256_fmadd_ps(q, high, sums[r][1]);
            }
        }
        for (int r = 0; r < PREFILL_ROWS; r++) {
            _mm256_store_ps(scores[r] + p * KEY_PANEL, sums[r][0]);
            _mm256_store_ps(scores[r] + p * KEY_PANEL + 8, sums[r][1]);
        }
    }
}

/* Turns row r's scores of a block into e^(scale · score - maximum) over its first `valid` keys (0 past them),
 * in place, and folds them into its running maximum and sum, rescaling its accumulated values where the
 * maximum moves. */
static inline void softmax_key_block(float *scores, int64_t valid, float scale, float *maximum, float *sum,
                                     float *acc, int64_t head_dim)
{
    if (valid <= 0) {
        memset(scores, 0, sizeof(float) * PREFILL_KEYS);
        return;
    }
    float block_max = -INFINITY;
    if (valid >= PREFILL_KEYS) {
        __m256 m = _mm256_load_ps(scores);
        for (int j = 8; j < PREFILL_KEYS; j += 8)
            m = _mm256_max_ps(m, _mm256_load_ps(scores + j));
        block_max = horizontal_max(m);
    } else
        for (int64_t j = 0; j < valid; j++)
            block_max = scores[j] > block_max ? scores[j] : block_max;
    block_max *= scale;
    if (block_max > *maximum) {
        float factor = expf(*maximum - block_max);
        *sum *= factor;
        for (int64_t d = 0; d < head_dim; d += 8)
            _mm256_store_ps(acc + d, _mm256_mul_ps(_mm256_load_ps(acc + d), _mm256_set1_ps(factor)));
        *maximum = block_max;
    }
    __m256 scale8 = _mm256_set1_ps(scale), maximum8 = _mm256_set1_ps(*maximum), total = _mm256_setzero_ps();
    __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), valid8 = _mm256_set1_epi32((int)valid);
    for (int j = 0; j < PREFILL_KEYS; j += 8) {
        __m256 e = exp_nonpositive(_mm256_fmsub_ps(_mm256_load_ps(scores + j), scale8, maximum8));
        if (j + 8 > valid)
            e = _mm256_and_ps(e, _mm256_castsi256_ps(
                _mm256_cmpgt_epi32(valid8, _mm256_add_epi32(_mm256_set1_epi32(j), lanes))));
        total = _mm256_add_ps(total, e);
        _mm256_store_ps(scores + j, e);
    }
    *sum += horizontal_sum(total);
}

/* acc[r] += Σ_j probabilities[r][j] · values[j] over a block's first `count` keys. */
static inline void accumulate_value_block(float probabilities[PREFILL_ROWS][PREFILL_KEYS], const float *values,
                                          int64_t count, int64_t head_dim, float acc[PREFILL_ROWS][MAX_HEAD_DIM])
{
    for (int64_t d = 0; d < head_dim; d += 16) {
        __m256 sums[PREFILL_ROWS][2];
        for (int r = 0; r < PREFILL_ROWS; r++) {
            sums[r][0] = _mm256_load_ps(acc[r] + d);
            sums[r][1] = _mm256_load_ps(acc[r] + d + 8);
        }
        for (int64_t j = 0; j < count; j++) {
            __m256 low = _mm256_load_ps(values + j * head_dim + d), high = _mm256_load_ps(values + j * head_dim + d + 8);
            for (int r = 0; r < PREFILL_ROWS; r++) {
                __m256 p = _mm256_broadcast_ss(probabilities[r] + j);
                sums[r][0] = _mm256_fmadd_ps(p, low, sums[r][0]);
                sums[r][1] = _mm256_fmadd_ps(p, high, sums[r][1]);
            }
        }
        for (int r = 0; r < PREFILL_ROWS; r++) {
            _mm256_store_ps(acc[r] + d, sums[r][0]);
            _mm256_store_ps(acc[r] + d + 8, sums[r][1]);
        }
    }
}

/* tandem_prefill_attention's attention in float32, into out [tokens][heads][head_dim] float32. Returns -1,
 * computing nothing, for a shape it does not take: head_dim not a multiple of 16 or above MAX_HEAD_DIM, heads
 * not a multiple of kv_heads, or context < tokens; -2 where its working memory could not be allocated. */
int tandem_prefill_attention_float32(const float *q_rows, int64_t q_stride, const float *k_cache,
                                     const float *v_cache, const int64_t *slots, int64_t num_heads,
                                     int64_t num_kv_heads, int64_t head_dim, int64_t tokens, int64_t context,
                                     float scale, float *out, int threads)
{
    if (head_dim % 16 || head_dim > MAX_HEAD_DIM || num_heads % num_kv_heads || context < tokens)
        return -1;
    int64_t group = num_heads / num_kv_heads, rows = tokens * group, offset = context - tokens;
    int64_t padded_context = (context + PREFILL_KEYS - 1) / PREFILL_KEYS * PREFILL_KEYS;
    int64_t row_blocks = (rows + PREFILL_ROWS - 1) / PREFILL_ROWS, kv_floats = num_kv_heads * padded_context * head_dim;
    float *keys = scratch(sizeof(float) * 2 * kv_floats);
    if (!keys)
        return -2;
    float *values = keys + kv_floats;
    pack_keys_values(k_cache, v_cache, slots, num_kv_heads, head_dim, context, padded_context, keys, values, threads);
#pragma omp parallel num_threads(threads)
    {
        __attribute__((aligned(32))) float scores[PREFILL_ROWS][PREFILL_KEYS];
        __attribute__((aligned(32))) float acc[PREFILL_ROWS][MAX_HEAD_DIM];
        float maximum[PREFILL_ROWS], sum[PREFILL_ROWS];
        const float *query[PREFILL_ROWS];
        int64_t limit[PREFILL_ROWS];
        /* key-value head by key-value head; in each, the last rows, which attend the most keys, first. A block's
         * rows past the last repeat it. */
#pragma omp for schedule(dynamic) collapse(2)
        for (int64_t kv = 0; kv < num_kv_heads; kv++)
            for (int64_t b = row_blocks - 1; b >= 0; b--) {
                for (int r = 0; r < PREFILL_ROWS; r++) {
                    int64_t row = b * PREFILL_ROWS + r < rows ? b * PREFILL_ROWS + r : rows - 1;
                    int64_t token = row / group, head = kv * group + row % group;
                    query[r] = q_rows + token * q_stride + head * head_dim;
                    limit[r] = offset + token + 1;
                    maximum[r] = -INFINITY;
                    sum[r] = 0.0f;
                    memset(acc[r], 0, sizeof(float) * head_dim);
                }
                const float *head_keys = keys + kv * padded_context * head_dim;
                const float *head_values = values + kv * padded_context * head_dim;
                for (int64_t first = 0; first < limit[PREFILL_ROWS - 1]; first += PREFILL_KEYS) {
                    score_key_block(query, head_keys + first * head_dim, head_dim, scores);
                    for (int r = 0; r < PREFILL_ROWS; r++)
                        softmax_key_block(scores[r], limit[r] - first, scale, maximum + r, sum + r, acc[r], head_dim);
                    int64_t count = limit[PREFILL_ROWS - 1] - first;
                    accumulate_value_block(scores, head_values + first * head_dim,
                                           count < PREFILL_KEYS ? count : PREFILL_KEYS, head_dim, acc);
                }
                for (int r = 0; r < PREFILL_ROWS && b * PREFILL_ROWS + r < rows; r++) {
                    int64_t row = b * PREFILL_ROWS + r, token = row / group, head = kv * group + row % group;
                    __m256 inverse = _mm256_set1_ps(1.0f / sum[r]);
                    for (int64_t d = 0; d < head_dim; d += 8)
                        _mm256_storeu_ps(out + (token * num_heads + head) * head_dim + d,
                                         _mm256_mul_ps(_mm256_load_ps(acc[r] + d), inverse));
                }
            }
    }
    return 0;
}

/* The smallest and the largest of the first ceil(lengths[r] / per) entries of rows[r], over num_rows rows, into
 * range[0] and range[1] (0 and -1 where there are none): the cache slots (per 1) or the blocks of a block table
 * (per block_size) a kernel would reach, checked before it does. */
void tandem_index_range(const int64_t *const *rows, const int64_t *lengths, int64_t num_rows, int64_t per,
                        int64_t *range)
{
    int64_t low = INT64_MAX, high = INT64_MIN;
    for (int64_t r = 0; r < num_rows; r++)
        for (int64_t i = 0; i < (lengths[r] + per - 1) / per; i++) {
            low = rows[r][i] < low ? rows[r][i] : low;
            high = rows[r][i] > high ? rows[r][i] : high;
        }
    range[0] = high < low ? 0 : low;
    range[1] = high < low ? -1 : high;
}

/* qkv [tokens, (heads + 2 kv_heads) · head_dim], a fused projection's rows: rotates the query and key
 * heads in place (the rotate-half form, cos and sin tables [positions, head_dim]) and writes each
 * token's keys and values to its cache slot (caches [slots, kv_heads, head_dim], one layer). */
void tandem_rope_and_cache(float *qkv, int64_t tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                           const int64_t *positions, const float *cos_table, const float *sin_table,
                           const int64_t *slot_mapping, float *k_cache, float *v_cache, int threads)
{
    int64_t half = head_dim / 2, kv_size = num_kv_heads * head_dim;
    int64_t stride = (num_heads + 2 * num_kv_heads) * head_dim;
#pragma omp parallel for schedule(static) num_threads(threads) if (tokens >= 16)
    for (int64_t t = 0; t < tokens; t++) {
        float *row = qkv + t * stride;
        const float *cos = cos_table + positions[t] * head_dim, *sin = sin_table + positions[t] * head_dim;
        for (int64_t h = 0; h < num_heads + num_kv_heads; h++) {
            float *head = row + h * head_dim;
            for (int64_t i = 0; i < half; i++) {
                float first = head[i], second = head[i + half];
                head[i] = first * cos[i] - second * sin[i];
                head[i + half] = second * cos[i + half] + first * sin[i + half];
            }
        }
        float *keys = row + num_heads * head_dim;
        for (int64_t i = 0; i < kv_size; i++) {
            k_cache[slot_mapping[t] * kv_size + i] = keys[i];
            v_cache[slot_mapping[t] * kv_size + i] = keys[kv_size + i];
        }
    }
}

static inline __m256 silu_and_mul8(__m256 g, __m256 u)
{
    /* sigmoid(g) from e = exp(-|g|) <= 1: 1 / (1 + e) for g >= 0, e / (1 + e) below */
    __m256 e = exp_nonpositive(_mm256_or_ps(_mm256_set1_ps(-0.0f), g));
    __m256 one = _mm256_set1_ps(1.0f);
    __m256 sigmoid = _mm256_div_ps(_mm256_blendv_ps(one, e, g), _mm256_add_ps(one, e));
    return _mm256_mul_ps(_mm256_mul_ps(g, sigmoid), u);
}

static inline __m256 widen_bf16x8(const uint16_t *p)
{
    __m256i bits = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));
}

/* Rounded to nearest, ties to even, as torch rounds float32 to bfloat16 (NaN aside). */
static inline __m128i round_to_bf16x8(__m256 v)
{
    __m256i bits = _mm256_castps_si256(v);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    bits = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
    return _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
}

/* Element i of p: float32, or bfloat16 widened where bf16 (a constant at every call site). */
static inline float load_one(const void *p, int64_t i, int bf16)
{
    if (!bf16)
        return ((const float *)p)[i];
    uint32_t bits = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline void store_one(void *p, int64_t i, float f, int bf16)
{
    if (!bf16) {
        ((float *)p)[i] = f;
        return;
    }
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    ((uint16_t *)p)[i] = (uint16_t)((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

static inline __m256 load_eight(const void *p, int64_t i, int bf16)
{
    return bf16 ? widen_bf16x8((const uint16_t *)p + i) : _mm256_loadu_ps((const float *)p + i);
}

static inline void store_eight(void *p, int64_t i, __m256 v, int bf16)
{
    if (bf16)
        _mm_storeu_si128((__m128i *)((uint16_t *)p + i), round_to_bf16x8(v));
    else
        _mm256_storeu_ps((float *)p + i, v);
}

/* out[r] = weight ⊙ x[r] / sqrt(mean(x[r]²) + eps) for x [rows, size], float32; out in float32, or bfloat16
 * where bf16 (a constant at every call site). With residual (not NULL): residual[r] += x[r] first, and the
 * sum is what is normalized. */
static inline __attribute__((always_inline)) void rms_norm_rows(const float *x, float *residual, const float *weight,
                                                                int64_t rows, int64_t size, float eps, void *out,
                                                                int threads, int bf16)
{
#pragma omp parallel for schedule(static) num_threads(threads) if (rows >= 16)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * size;
        float *sum = residual ? residual + r * size : NULL;
        __m256 squares[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        int64_t i = 0;
        for (; i + 8 <= size; i += 8) {
            __m256 v = _mm256_loadu_ps(row + i);
            if (sum) {
                v = _mm256_add_ps(v, _mm256_loadu_ps(sum + i));
                _mm256_storeu_ps(sum + i, v);
            }
            squares[(i >> 3) & 1] = _mm256_fmadd_ps(v, v, squares[(i >> 3) & 1]);
        }
        float total = horizontal_sum(_mm256_add_ps(squares[0], squares[1]));
        for (; i < size; i++) {
            float v = sum ? (sum[i] += row[i]) : row[i];
            total += v * v;
        }
        if (sum)
            row = sum;
        float inverse = 1.0f / sqrtf(total / size + eps);
        for (i = 0; i + 8 <= size; i += 8)
            store_eight(out, r * size + i, _mm256_mul_ps(_mm256_loadu_ps(weight + i),
                                                         _mm256_mul_ps(_mm256_loadu_ps(row + i), _mm256_set1_ps(inverse))),
                        bf16);
        for (; i < size; i++)
            store_one(out, r * size + i, weight[i] * (row[i] * inverse), bf16);
    }
}

void tandem_rms_norm(const float *x, float *residual, const float *weight, int64_t rows, int64_t size, float eps,
                     float *out, int threads)
{
    rms_norm_rows(x, residual, weight, rows, size, eps, out, threads, 0);
}

void tandem_rms_norm_bf16(const float *x, float *residual, const float *weight, int64_t rows, int64_t size,
                          float eps, uint16_t *out, int threads)
{
    rms_norm_rows(x, residual, weight, rows, size, eps, out, threads, 1);
}

/* out [rows, size] = silu(gate) ⊙ up, for gate_up [rows, 2 · size] (gate, then up, in each row), float32; or,
 * where bf16 (a constant at every call site), both bfloat16, computed in float32 and rounded back. */
static inline __attribute__((always_inline)) void silu_and_mul_rows(const void *gate_up, int64_t rows, int64_t size,
                                                                    void *out, int threads, int bf16)
{
#pragma omp parallel for schedule(static) num_threads(threads) if (rows >= 16)
    for (int64_t r = 0; r < rows; r++) {
        int64_t gate = r * 2 * size, up = gate + size, i = 0;
#ifdef __AVX512F__
        for (; i + 16 <= size; i += 16)
            store_sixteen(out, r * size + i, silu_and_mul16(load_sixteen(gate_up, gate + i, bf16),
                                                            load_sixteen(gate_up, up + i, bf16)), bf16);
#endif
        for (; i + 8 <= size; i += 8)
            store_eight(out, r * size + i,
                        silu_and_mul8(load_eight(gate_up, gate + i, bf16), load_eight(gate_up, up + i, bf16)), bf16);
        for (; i < size; i++) {
            float g = load_one(gate_up, gate + i, bf16);
            store_one(out, r * size + i, g / (1.0f + expf(-g)) * load_one(gate_up, up + i, bf16), bf16);
        }
    }
}

void tandem_silu_and_mul(const float *gate_up, int64_t rows, int64_t size, float *out, int threads)
{
    silu_and_mul_rows(gate_up, rows, size, out, threads, 0);
}

void tandem_silu_and_mul_bf16(const uint16_t *gate_up, int64_t rows, int64_t size, uint16_t *out, int threads)
{
    silu_and_mul_rows(gate_up, rows, size, out, threads, 1);
}

/* One decoder layer's weights for tandem_decode_layers: its norms', and its linears' packed weights,
 * scales (NULL for float16 weights), mins (4-bit weights only) and biases (NULL where none), as tandem_linear
 * takes them; every int8 linear's scales are per `group` columns of the layer shape. */
typedef struct {
    const float *input_norm, *post_attention_norm;
    const void *qkv, *o, *gate_up, *down;
    const uint16_t *qkv_scales, *o_scales, *gate_up_scales, *down_scales;
    const uint16_t *qkv_mins, *o_mins, *gate_up_mins, *down_mins;
    const float *qkv_bias, *o_bias, *gate_up_bias, *down_bias;
} tandem_layer;

typedef struct {
    int64_t hidden, num_heads, num_kv_heads, head_dim, intermediate, group;
    float eps, scale;
} tandem_layer_shape;

/* A prompt chunk of a small step: its rows [first_row, first_row + tokens) attend the `context` positions
 * in slots, their own last, through tandem_prefill_attention. */
typedef struct {
    int64_t first_row, tokens, context;
    const int64_t *slots;
} tandem_chunk;

/* A chunk's attention through tandem_prefill_attention, its bfloat16 output (in `staging`, tokens · heads ·
 * head_dim of them) widened to float32 rows of `out`. */
static int attend_chunk(const tandem_chunk *chunk, const float *qkv, int64_t qkv_size, const float *keys,
                        const float *values, const tandem_layer_shape *shape, uint16_t *staging, float *out,
                        int threads)
{
    int64_t q_size = shape->num_heads * shape->head_dim;
    int status = tandem_prefill_attention(qkv + chunk->first_row * qkv_size, qkv_size, keys, values, chunk->slots,
                                          shape->num_heads, shape->num_kv_heads, shape->head_dim, chunk->tokens,
                                          chunk->context, shape->scale, staging, threads);
    if (status)
        return status;
    float *rows = out + chunk->first_row * q_size;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < chunk->tokens * q_size; i++)
        rows[i] = load_one(staging, i, 1);
    return 0;
}

/* A small step's decoder layers, each exactly as the kernels above compute it one call at a time:
 * x [rows, hidden] comes in as the embeddings and leaves as the last layer's output; residual [rows,
 * hidden] comes in as zeros and leaves as the residual stream before it (the hidden state is their sum).
 * k_cache, v_cache: [num_layers, slots, kv_heads, head_dim], cache_layer_size floats per layer. The rows
 * before the first of `chunks` attend as decodes, through block_tables and context_lens (one each); the
 * chunks, one after another to the last row, as prefills (the builds with AVX512-BF16). scratch holds rows ·
 * (hidden + qkv + heads · head_dim + 3 · intermediate) floats. One call instead of nine per layer takes the dispatch
 * of each op out of the step. Returns the first status of a linear or the attention that is not 0. */
int tandem_decode_layers(const tandem_layer *layers, int64_t num_layers, const tandem_layer_shape *shape,
                         int64_t rows, float *x, float *residual, const int64_t *positions, const float *cos_table,
                         const float *sin_table, const int64_t *slot_mapping, float *k_cache, float *v_cache,
                         int64_t cache_layer_size, const int64_t *const *block_tables, const int64_t *context_lens,
                         int64_t block_size, const tandem_chunk *chunks, int64_t num_chunks, float *scratch,
                         int threads)
{
    int64_t decodes = num_chunks ? chunks[0].first_row : rows;
    int64_t hidden = shape->hidden, q_size = shape->num_heads * shape->head_dim;
    int64_t qkv_size = q_size + 2 * shape->num_kv_heads * shape->head_dim;
    float *normed = scratch, *qkv = normed + rows * hidden, *attention = qkv + rows * qkv_size;
    float *gate_up = attention + rows * q_size, *activation = gate_up + rows * 2 * shape->intermediate;
    for (int64_t l = 0; l < num_layers; l++) {
        const tandem_layer *layer = layers + l;
        float *keys = k_cache + l * cache_layer_size, *values = v_cache + l * cache_layer_size;
        tandem_rms_norm(x, residual, layer->input_norm, rows, hidden, shape->eps, normed, threads);
        int status = tandem_linear(normed, rows, hidden, layer->qkv, layer->qkv_scales, layer->qkv_mins, shape->group,
                                   qkv_size, layer->qkv_bias, qkv, threads);
        if (status)
            return status;
        tandem_rope_and_cache(qkv, rows, shape->num_heads, shape->num_kv_heads, shape->head_dim, positions,
                              cos_table, sin_table, slot_mapping, keys, values, threads);
        status = decodes ? tandem_decode_attention(qkv, qkv_size, keys, values, block_tables, context_lens, decodes,
                                                   block_size, shape->num_heads, shape->num_kv_heads, shape->head_dim,
                                                   shape->scale, attention, threads) : 0;
        /* the chunks' bfloat16 outputs are staged where gate_up goes later in the layer */
        for (int64_t c = 0; c < num_chunks && !status; c++)
            status = attend_chunk(chunks + c, qkv, qkv_size, keys, values, shape, (uint16_t *)gate_up, attention,
                                  threads);
        if (!status)
            status = tandem_linear(attention, rows, q_size, layer->o, layer->o_scales, layer->o_mins, shape->group,
                                   hidden, layer->o_bias, x, threads);
        if (status)
            return status;
        tandem_rms_norm(x, residual, layer->post_attention_norm, rows, hidden, shape->eps, normed, threads);
        status = tandem_linear(normed, rows, hidden, layer->gate_up, layer->gate_up_scales, layer->gate_up_mins,
                               shape->group, 2 * shape->intermediate, layer->gate_up_bias, gate_up, threads);
        if (status)
            return status;
        tandem_silu_and_mul(gate_up, rows, shape->intermediate, activation, threads);
        status = tandem_linear(activation, rows, shape->intermediate, layer->down, layer->down_scales, layer->down_mins,
                               shape->group, hidden, layer->down_bias, x, threads);
        if (status)
            return status;
    }
    return 0;
}
