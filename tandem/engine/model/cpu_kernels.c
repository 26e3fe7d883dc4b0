/* CPU kernels for decode steps of a float32 model, on AVX2 + FMA + F16C; work is shared out between
 * `threads` OpenMP threads of torch's own libgomp (already loaded when this library is).
 *
 * tandem_linear_f16: y = x · wᵀ (+ bias) for a few float32 rows x and float16 weights w.
 * A decode step multiplies every weight matrix by a handful of rows, so it is bound by reading the
 * weights. Stored as float16 they are half the bytes of float32; F16C widens them to float32 in
 * registers, and every product and sum is float32. The weight rows are cut into tiles of TILE_N rows,
 * shared out between the threads; a tile stays in L1 while all the input rows, TILE_M at a time, pass
 * over it.
 *
 * tandem_decode_attention: one query token per sequence against its context in the paged KV cache,
 * read in place through the sequence's block table: one pass over the keys and values with an online
 * softmax, the query heads that share a key-value head together.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#define TILE_M 4
#define TILE_N 2

static inline float horizontal_sum(__m256 v)
{
    __m128 sum = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
    sum = _mm_add_ss(sum, _mm_movehdup_ps(sum));
    return _mm_cvtss_f32(sum);
}

/* rows m of x (m < rows_m) against weight rows n (n < rows_n); both counts are constants at every
 * call site, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void tile(
    const float *x, int64_t k_size, const uint16_t *w, const float *bias, float *y, int64_t ldy,
    int rows_m, int rows_n)
{
    __m256 acc[TILE_M][TILE_N];
    for (int m = 0; m < rows_m; m++)
        for (int n = 0; n < rows_n; n++)
            acc[m][n] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= k_size; k += 8) {
        __m256 wv[TILE_N];
        for (int n = 0; n < rows_n; n++)
            wv[n] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + n * k_size + k)));
        for (int m = 0; m < rows_m; m++) {
            __m256 xv = _mm256_loadu_ps(x + m * k_size + k);
            for (int n = 0; n < rows_n; n++)
                acc[m][n] = _mm256_fmadd_ps(wv[n], xv, acc[m][n]);
        }
    }
    for (int m = 0; m < rows_m; m++)
        for (int n = 0; n < rows_n; n++) {
            float sum = horizontal_sum(acc[m][n]);
            for (int64_t tail = k; tail < k_size; tail++)
                sum += x[m * k_size + tail] * _cvtsh_ss(w[n * k_size + tail]);
            y[m * ldy + n] = bias ? sum + bias[n] : sum;
        }
}

static void rows_against_tile(const float *x, int64_t rows, int64_t k_size, const uint16_t *w,
                              const float *bias, float *y, int64_t ldy, int rows_n)
{
    int64_t m = 0;
    for (; m + TILE_M <= rows; m += TILE_M) {
        if (rows_n == TILE_N)
            tile(x + m * k_size, k_size, w, bias, y + m * ldy, ldy, TILE_M, TILE_N);
        else
            tile(x + m * k_size, k_size, w, bias, y + m * ldy, ldy, TILE_M, 1);
    }
    for (; m < rows; m++) {
        if (rows_n == TILE_N)
            tile(x + m * k_size, k_size, w, bias, y + m * ldy, ldy, 1, TILE_N);
        else
            tile(x + m * k_size, k_size, w, bias, y + m * ldy, ldy, 1, 1);
    }
}

/* x [rows, k_size] float32, w [n_size, k_size] float16 bits, bias [n_size] float32 or NULL,
 * y [rows, n_size] float32; all contiguous. */
void tandem_linear_f16(const float *x, int64_t rows, int64_t k_size, const uint16_t *w, int64_t n_size,
                       const float *bias, float *y, int threads)
{
    int64_t tiles = (n_size + TILE_N - 1) / TILE_N;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < tiles; t++) {
        int64_t n = t * TILE_N;
        int rows_n = n_size - n >= TILE_N ? TILE_N : 1;
        for (int64_t part = n; part < n + TILE_N && part < n_size; part += rows_n)
            rows_against_tile(x, rows, k_size, w + part * k_size, bias ? bias + part : 0, y + part, n_size,
                              rows_n);
    }
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
#define BLOCK_CHUNK 16 /* tokens scored at once */

static float dot(const float *a, const float *b, int64_t size)
{
    __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= size; i += 16) {
        even = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), even);
        odd = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), odd);
    }
    for (; i < size; i += 8)
        even = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), even);
    return horizontal_sum(_mm256_add_ps(even, odd));
}

/* The query heads [first_head, first_head + group) of one sequence, all reading key-value head kv_head. */
static void attend(const float *q, const float *k_cache, const float *v_cache, const int64_t *block_table,
                   int64_t context_len, int64_t block_size, int64_t kv_stride, int64_t kv_head, int group,
                   int64_t head_dim, float scale, float *out)
{
    float acc[MAX_GROUP][MAX_HEAD_DIM];
    float running_max[MAX_GROUP], running_sum[MAX_GROUP];
    float scores[MAX_GROUP][BLOCK_CHUNK];
    for (int g = 0; g < group; g++) {
        running_max[g] = -INFINITY;
        running_sum[g] = 0.0f;
        for (int64_t d = 0; d < head_dim; d++)
            acc[g][d] = 0.0f;
    }
    for (int64_t start = 0; start < context_len; start += BLOCK_CHUNK) {
        int count = context_len - start < BLOCK_CHUNK ? (int)(context_len - start) : BLOCK_CHUNK;
        const float *keys[BLOCK_CHUNK], *values[BLOCK_CHUNK];
        for (int t = 0; t < count; t++) {
            int64_t position = start + t;
            int64_t slot = block_table[position / block_size] * block_size + position % block_size;
            keys[t] = k_cache + slot * kv_stride + kv_head * head_dim;
            values[t] = v_cache + slot * kv_stride + kv_head * head_dim;
        }
        for (int g = 0; g < group; g++) {
            float chunk_max = running_max[g];
            for (int t = 0; t < count; t++) {
                scores[g][t] = dot(q + g * head_dim, keys[t], head_dim) * scale;
                if (scores[g][t] > chunk_max)
                    chunk_max = scores[g][t];
            }
            for (int t = count; t < BLOCK_CHUNK; t++)
                scores[g][t] = -INFINITY;
            float correction = running_max[g] == -INFINITY ? 0.0f : expf(running_max[g] - chunk_max);
            running_max[g] = chunk_max;
            __m256 total = _mm256_setzero_ps(), maximum = _mm256_set1_ps(chunk_max);
            for (int t = 0; t < BLOCK_CHUNK; t += 8) {
                __m256 p = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(scores[g] + t), maximum));
                _mm256_storeu_ps(scores[g] + t, p);
                total = _mm256_add_ps(total, p);
            }
            running_sum[g] = running_sum[g] * correction + horizontal_sum(total);
            __m256 scale_acc = _mm256_set1_ps(correction);
            for (int64_t d = 0; d < head_dim; d += 8) {
                __m256 a = _mm256_mul_ps(_mm256_loadu_ps(acc[g] + d), scale_acc);
                for (int t = 0; t < count; t++)
                    a = _mm256_fmadd_ps(_mm256_set1_ps(scores[g][t]), _mm256_loadu_ps(values[t] + d), a);
                _mm256_storeu_ps(acc[g] + d, a);
            }
        }
    }
    for (int g = 0; g < group; g++) {
        __m256 inverse = _mm256_set1_ps(1.0f / running_sum[g]);
        for (int64_t d = 0; d < head_dim; d += 8)
            _mm256_storeu_ps(out + g * head_dim + d, _mm256_mul_ps(_mm256_loadu_ps(acc[g] + d), inverse));
    }
}

/* q, out [num_seqs, num_heads, head_dim]; k_cache, v_cache [num_slots, num_kv_heads, head_dim] (one
 * layer); block_tables [num_seqs, max_blocks]; context_lens [num_seqs], each at least 1. Returns -1,
 * computing nothing, for a shape it does not take: head_dim not a multiple of 8 or above MAX_HEAD_DIM,
 * more than MAX_GROUP query heads per key-value head. */
int tandem_decode_attention(const float *q, const float *k_cache, const float *v_cache,
                            const int64_t *block_tables, const int64_t *context_lens, int64_t num_seqs,
                            int64_t max_blocks, int64_t block_size, int64_t num_heads, int64_t num_kv_heads,
                            int64_t head_dim, float scale, float *out, int threads)
{
    int64_t group = num_heads / num_kv_heads;
    if (head_dim % 8 || head_dim > MAX_HEAD_DIM || group > MAX_GROUP || group * num_kv_heads != num_heads)
        return -1;
    int64_t items = num_seqs * num_kv_heads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t item = 0; item < items; item++) {
        int64_t seq = item / num_kv_heads, kv_head = item % num_kv_heads;
        int64_t offset = (seq * num_heads + kv_head * group) * head_dim;
        attend(q + offset, k_cache, v_cache, block_tables + seq * max_blocks, context_lens[seq], block_size,
               num_kv_heads * head_dim, kv_head, (int)group, head_dim, scale, out + offset);
    }
    return 0;
}
