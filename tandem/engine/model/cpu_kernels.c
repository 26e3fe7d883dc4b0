/* CPU kernels for decode steps of a float32 model, on AVX2 + FMA + F16C; work is shared out between
 * `threads` OpenMP threads of torch's own libgomp (already loaded when this library is).
 *
 * tandem_linear_f16: y = x · wᵀ (+ bias) for a few float32 rows x and float16 weights w.
 * A decode step multiplies every weight matrix by a handful of rows, so it is bound by reading the
 * weights. Stored as float16 they are half the bytes of float32; F16C widens them to float32 in
 * registers, and every product and sum is float32. The weight rows are cut into tiles of TILE_N rows,
 * shared out between the threads; a tile stays in L1 while all the input rows, TILE_M at a time, pass
 * over it. Built with AVX-512 (-mavx512f), it works on 16 floats at a time instead of 8 (CHUNK), and
 * the weights are packed for that width.
 *
 * tandem_decode_attention: one query token per sequence against its context in the paged KV cache,
 * read in place through the sequence's block table: one pass over the keys and values with an online
 * softmax, the query heads that share a key-value head together.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#define TILE_N 3

#ifdef __AVX512F__
#define TILE_M 8 /* 24 accumulators of the 32 vector registers */
#define CHUNK 16
typedef __m512 chunk_vector;
#define chunk_zero _mm512_setzero_ps
#define chunk_load _mm512_loadu_ps
#define chunk_load_f16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define chunk_fmadd _mm512_fmadd_ps
#define chunk_sum _mm512_reduce_add_ps
#else
#define TILE_M 4 /* 12 accumulators of the 16 vector registers */
#define CHUNK 8
typedef __m256 chunk_vector;
#define chunk_zero _mm256_setzero_ps
#define chunk_load _mm256_loadu_ps
#define chunk_load_f16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define chunk_fmadd _mm256_fmadd_ps
#define chunk_sum horizontal_sum
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

/* Weight rows tile by tile, each tile's TILE_N rows interleaved in chunks of CHUNK: [n / TILE_N]
 * [k / CHUNK][TILE_N][CHUNK], so the kernel reads the weight in one sequential stream (the hardware
 * prefetcher keeps up with one stream, not with TILE_N short ones). The last tile is padded with zero
 * rows. */
int tandem_linear_f16_tile_rows(void)
{
    return TILE_N;
}

int tandem_linear_f16_chunk(void)
{
    return CHUNK;
}

/* rows m < rows_m of x against one packed tile; rows_m is a constant at every call site, so the
 * accumulators stay in registers. Writes the first `columns` of the tile's TILE_N outputs. */
static inline __attribute__((always_inline)) void tile(
    const float *x, int64_t k_size, const uint16_t *w, const float *bias, float *y, int64_t ldy,
    int rows_m, int columns)
{
    chunk_vector acc[TILE_M][TILE_N];
    for (int m = 0; m < rows_m; m++)
        for (int n = 0; n < TILE_N; n++)
            acc[m][n] = chunk_zero();
    for (int64_t k = 0; k < k_size; k += CHUNK) {
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

/* x [rows, k_size] float32 (k_size a multiple of CHUNK), w packed as above from [n_size, k_size] float16
 * bits, bias [n_size] float32 or NULL, y [rows, n_size] float32; all contiguous. */
void tandem_linear_f16(const float *x, int64_t rows, int64_t k_size, const uint16_t *w, int64_t n_size,
                       const float *bias, float *y, int threads)
{
    int64_t tiles = (n_size + TILE_N - 1) / TILE_N;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < tiles; t++) {
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

/* The eight sums of a[0..7], as one vector. */
static inline __m256 horizontal_sums(const __m256 a[8])
{
    __m256 low = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 high = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20), _mm256_permute2f128_ps(low, high, 0x31));
}

/* q · keys[t] for eight keys (a key past the context repeats the last one; its score is masked). */
static inline __m256 dot8(const float *q, const float *const keys[8], int64_t head_dim)
{
    __m256 acc[8];
    for (int t = 0; t < 8; t++)
        acc[t] = _mm256_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += 8) {
        __m256 qv = _mm256_loadu_ps(q + d);
        for (int t = 0; t < 8; t++)
            acc[t] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(keys[t] + d), acc[t]);
    }
    return horizontal_sums(acc);
}

/* acc[h] = acc[h] · corrections[h] + Σ_t scores[h][t] · values[t] for `heads` query heads (a constant at
 * each call site): every value row is loaded once for all of them, 32 dimensions at a time. */
static inline __attribute__((always_inline)) void accumulate_values(
    float (*acc)[MAX_HEAD_DIM], float (*scores)[BLOCK_CHUNK], const float *corrections,
    const float *const values[BLOCK_CHUNK], int count, int64_t head_dim, int heads)
{
    for (int64_t d = 0; d < head_dim; d += 32) {
        int lanes = head_dim - d >= 32 ? 4 : (int)(head_dim - d) / 8;
        __m256 a[3][4];
        for (int h = 0; h < heads; h++) {
            __m256 correction = _mm256_set1_ps(corrections[h]);
            for (int l = 0; l < lanes; l++)
                a[h][l] = _mm256_mul_ps(_mm256_loadu_ps(acc[h] + d + 8 * l), correction);
        }
        for (int t = 0; t < count; t++) {
            __m256 p[3];
            for (int h = 0; h < heads; h++)
                p[h] = _mm256_broadcast_ss(&scores[h][t]);
            for (int l = 0; l < lanes; l++) {
                __m256 v = _mm256_loadu_ps(values[t] + d + 8 * l);
                for (int h = 0; h < heads; h++)
                    a[h][l] = _mm256_fmadd_ps(p[h], v, a[h][l]);
            }
        }
        for (int h = 0; h < heads; h++)
            for (int l = 0; l < lanes; l++)
                _mm256_storeu_ps(acc[h] + d + 8 * l, a[h][l]);
    }
}

/* The query heads [first_head, first_head + group) of one sequence, all reading key-value head kv_head. */
static void attend(const float *q, const float *k_cache, const float *v_cache, const int64_t *block_table,
                   int64_t context_len, int64_t block_size, int64_t kv_stride, int64_t kv_head, int group,
                   int64_t head_dim, float scale, float *out)
{
    float acc[MAX_GROUP][MAX_HEAD_DIM];
    float running_max[MAX_GROUP], running_sum[MAX_GROUP];
    float scores[MAX_GROUP][BLOCK_CHUNK], corrections[MAX_GROUP];
    const __m256 lane_index = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    for (int g = 0; g < group; g++) {
        running_max[g] = -INFINITY;
        running_sum[g] = 0.0f;
        for (int64_t d = 0; d < head_dim; d++)
            acc[g][d] = 0.0f;
    }
    for (int64_t start = 0; start < context_len; start += BLOCK_CHUNK) {
        int count = context_len - start < BLOCK_CHUNK ? (int)(context_len - start) : BLOCK_CHUNK;
        const float *keys[BLOCK_CHUNK], *values[BLOCK_CHUNK];
        for (int t = 0; t < BLOCK_CHUNK; t++) {
            int64_t position = start + (t < count ? t : count - 1);
            int64_t slot = block_table[position / block_size] * block_size + position % block_size;
            keys[t] = k_cache + slot * kv_stride + kv_head * head_dim;
            values[t] = v_cache + slot * kv_stride + kv_head * head_dim;
        }
        __m256 scale_vector = _mm256_set1_ps(scale), past = _mm256_set1_ps(-INFINITY);
        for (int g = 0; g < group; g++) {
            __m256 chunk_maximum = _mm256_set1_ps(running_max[g]);
            for (int t = 0; t < BLOCK_CHUNK; t += 8) {
                __m256 score = _mm256_mul_ps(dot8(q + g * head_dim, keys + t, head_dim), scale_vector);
                __m256 inside = _mm256_cmp_ps(_mm256_add_ps(_mm256_set1_ps((float)t), lane_index),
                                              _mm256_set1_ps((float)count), _CMP_LT_OQ);
                score = _mm256_blendv_ps(past, score, inside);
                _mm256_storeu_ps(scores[g] + t, score);
                chunk_maximum = _mm256_max_ps(chunk_maximum, score);
            }
            float chunk_max = horizontal_max(chunk_maximum);
            float correction = running_max[g] == -INFINITY ? 0.0f : expf(running_max[g] - chunk_max);
            running_max[g] = chunk_max;
            __m256 total = _mm256_setzero_ps(), maximum = _mm256_set1_ps(chunk_max);
            for (int t = 0; t < BLOCK_CHUNK; t += 8) {
                __m256 p = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(scores[g] + t), maximum));
                _mm256_storeu_ps(scores[g] + t, p);
                total = _mm256_add_ps(total, p);
            }
            running_sum[g] = running_sum[g] * correction + horizontal_sum(total);
            corrections[g] = correction;
        }
        int g = 0;
        for (; g + 3 <= group; g += 3)
            accumulate_values(acc + g, scores + g, corrections + g, values, count, head_dim, 3);
        for (; g < group; g++)
            accumulate_values(acc + g, scores + g, corrections + g, values, count, head_dim, 1);
    }
    for (int g = 0; g < group; g++) {
        __m256 inverse = _mm256_set1_ps(1.0f / running_sum[g]);
        for (int64_t d = 0; d < head_dim; d += 8)
            _mm256_storeu_ps(out + g * head_dim + d, _mm256_mul_ps(_mm256_loadu_ps(acc[g] + d), inverse));
    }
}

/* q [num_seqs, num_heads, head_dim], each sequence's query q_stride floats after the last one's (the
 * heads of one sequence contiguous); out [num_seqs, num_heads, head_dim]; k_cache, v_cache [num_slots,
 * num_kv_heads, head_dim] (one layer); block_tables [num_seqs]: each sequence's block ids, at least
 * ceil(context_len / block_size) of them; context_lens [num_seqs], each at least 1. Returns -1, computing
 * nothing, for a shape it does not take: head_dim not a multiple of 8 or above MAX_HEAD_DIM, more than
 * MAX_GROUP query heads per key-value head. */
int tandem_decode_attention(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                            const int64_t *const *block_tables, const int64_t *context_lens, int64_t num_seqs,
                            int64_t block_size, int64_t num_heads, int64_t num_kv_heads,
                            int64_t head_dim, float scale, float *out, int threads)
{
    int64_t group = num_heads / num_kv_heads;
    if (head_dim % 8 || head_dim > MAX_HEAD_DIM || group > MAX_GROUP || group * num_kv_heads != num_heads)
        return -1;
    int64_t items = num_seqs * num_kv_heads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t item = 0; item < items; item++) {
        int64_t seq = item / num_kv_heads, kv_head = item % num_kv_heads;
        int64_t head = kv_head * group * head_dim;
        attend(q + seq * q_stride + head, k_cache, v_cache, block_tables[seq], context_lens[seq], block_size,
               num_kv_heads * head_dim, kv_head, (int)group, head_dim, scale,
               out + seq * num_heads * head_dim + head);
    }
    return 0;
}

/* out[r] = weight ⊙ x[r] / sqrt(mean(x[r]²) + eps) for x [rows, size]. With residual (not NULL):
 * residual[r] += x[r] first, and the sum is what is normalized. */
void tandem_rms_norm(const float *x, float *residual, const float *weight, int64_t rows, int64_t size, float eps,
                     float *out, int threads)
{
#pragma omp parallel for schedule(static) num_threads(threads) if (rows >= 16)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * size;
        if (residual) {
            float *sum = residual + r * size;
            for (int64_t i = 0; i < size; i++)
                sum[i] += row[i];
            row = sum;
        }
        float squares = 0.0f;
        for (int64_t i = 0; i < size; i++)
            squares += row[i] * row[i];
        float inverse = 1.0f / sqrtf(squares / size + eps);
        for (int64_t i = 0; i < size; i++)
            out[r * size + i] = weight[i] * (row[i] * inverse);
    }
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

/* out [rows, size] = silu(gate) ⊙ up, for gate_up [rows, 2 · size] (gate, then up, in each row). */
void tandem_silu_and_mul(const float *gate_up, int64_t rows, int64_t size, float *out, int threads)
{
#pragma omp parallel for schedule(static) num_threads(threads) if (rows >= 16)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * size, *up = gate + size;
        int64_t i = 0;
        for (; i + 8 <= size; i += 8) {
            __m256 g = _mm256_loadu_ps(gate + i);
            /* sigmoid(g) from e = exp(-|g|) <= 1: 1 / (1 + e) for g >= 0, e / (1 + e) below */
            __m256 e = exp_nonpositive(_mm256_or_ps(_mm256_set1_ps(-0.0f), g));
            __m256 one = _mm256_set1_ps(1.0f);
            __m256 sigmoid = _mm256_div_ps(_mm256_blendv_ps(one, e, g), _mm256_add_ps(one, e));
            _mm256_storeu_ps(out + r * size + i, _mm256_mul_ps(_mm256_mul_ps(g, sigmoid), _mm256_loadu_ps(up + i)));
        }
        for (; i < size; i++)
            out[r * size + i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
    }
}

/* One decoder layer's weights for tandem_decode_layers: its norms', and its linears' packed float16
 * weights (see tandem_linear_f16) and biases (NULL where none). */
typedef struct {
    const float *input_norm, *post_attention_norm;
    const uint16_t *qkv, *o, *gate_up, *down;
    const float *qkv_bias, *o_bias, *gate_up_bias, *down_bias;
} tandem_layer;

typedef struct {
    int64_t hidden, num_heads, num_kv_heads, head_dim, intermediate;
    float eps, scale;
} tandem_layer_shape;

/* A decode step's decoder layers, each exactly as the kernels above compute it one call at a time:
 * x [rows, hidden] comes in as the embeddings and leaves as the last layer's output; residual [rows,
 * hidden] comes in as zeros and leaves as the residual stream before it (the hidden state is their sum).
 * k_cache, v_cache: [num_layers, slots, kv_heads, head_dim], cache_layer_size floats per layer. scratch
 * holds rows · (hidden + qkv + heads · head_dim + 3 · intermediate) floats. One call instead of nine per
 * layer takes the dispatch of each op out of the step. Returns -1 where decode attention does not take
 * the shape. */
int tandem_decode_layers(const tandem_layer *layers, int64_t num_layers, const tandem_layer_shape *shape,
                         int64_t rows, float *x, float *residual, const int64_t *positions, const float *cos_table,
                         const float *sin_table, const int64_t *slot_mapping, float *k_cache, float *v_cache,
                         int64_t cache_layer_size, const int64_t *const *block_tables, const int64_t *context_lens,
                         int64_t block_size, float *scratch, int threads)
{
    int64_t hidden = shape->hidden, q_size = shape->num_heads * shape->head_dim;
    int64_t qkv_size = q_size + 2 * shape->num_kv_heads * shape->head_dim;
    float *normed = scratch, *qkv = normed + rows * hidden, *attention = qkv + rows * qkv_size;
    float *gate_up = attention + rows * q_size, *activation = gate_up + rows * 2 * shape->intermediate;
    for (int64_t l = 0; l < num_layers; l++) {
        const tandem_layer *layer = layers + l;
        float *keys = k_cache + l * cache_layer_size, *values = v_cache + l * cache_layer_size;
        tandem_rms_norm(x, residual, layer->input_norm, rows, hidden, shape->eps, normed, threads);
        tandem_linear_f16(normed, rows, hidden, layer->qkv, qkv_size, layer->qkv_bias, qkv, threads);
        tandem_rope_and_cache(qkv, rows, shape->num_heads, shape->num_kv_heads, shape->head_dim, positions,
                              cos_table, sin_table, slot_mapping, keys, values, threads);
        if (tandem_decode_attention(qkv, qkv_size, keys, values, block_tables, context_lens, rows, block_size,
                                    shape->num_heads, shape->num_kv_heads, shape->head_dim, shape->scale,
                                    attention, threads))
            return -1;
        tandem_linear_f16(attention, rows, q_size, layer->o, hidden, layer->o_bias, x, threads);
        tandem_rms_norm(x, residual, layer->post_attention_norm, rows, hidden, shape->eps, normed, threads);
        tandem_linear_f16(normed, rows, hidden, layer->gate_up, 2 * shape->intermediate, layer->gate_up_bias,
                          gate_up, threads);
        tandem_silu_and_mul(gate_up, rows, shape->intermediate, activation, threads);
        tandem_linear_f16(activation, rows, shape->intermediate, layer->down, hidden, layer->down_bias, x, threads);
    }
    return 0;
}
