/* The AVX512-BF16 build of the CPU kernels (the AVX-512 build and its bfloat16 prefill attention), for their tests
 * on a CPU without AVX-512: SIMDe (simde-py's headers) carries out each AVX-512 intrinsic in AVX2 ones, and the
 * few it lacks or gets wrong are written out below, lane by lane. Force-included (-include) ahead of cpu_kernels.c,
 * compiled with the kernels' FLAGS and -I<simde_py.get_include()>. */
#include <stdint.h>
#include <string.h>

#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

/* to.to_lane[i] = from.from_lane[i] for each of `lanes` lanes, as C converts the one to the other: the widening
 * and truncating conversions that SIMDe lacks */
#define LANE_BY_LANE(name, from_type, to_type, lanes, from_lane, to_lane)      \
    static inline simde__##to_type name(simde__##from_type a)                  \
    {                                                                          \
        simde__##from_type##_private from = simde__##from_type##_to_private(a); \
        simde__##to_type##_private to;                                         \
        for (int i = 0; i < lanes; i++)                                        \
            to.to_lane[i] = from.from_lane[i];                                 \
        return simde__##to_type##_from_private(to);                            \
    }

LANE_BY_LANE(widen_int8_to_int32, m128i, m512i, 16, i8, i32)
LANE_BY_LANE(widen_uint8_to_int16, m256i, m512i, 32, u8, i16)
LANE_BY_LANE(truncate_int32_to_int16, m512i, m256i, 16, i32, i16)

static inline float sum_of_sixteen(simde__m512 a)
{
    simde__m512_private lanes = simde__m512_to_private(a);
    float sum = 0.0f;
    for (int i = 0; i < 16; i++)
        sum += lanes.f32[i];
    return sum;
}

/* within each 128-bit lane, element i takes that lane's element (control >> 2i) & 3 */
static inline simde__m512 permute_within_lanes(simde__m512 a, int control)
{
    simde__m512_private from = simde__m512_to_private(a), to;
    for (int i = 0; i < 16; i++)
        to.f32[i] = from.f32[(i & ~3) | ((control >> 2 * (i & 3)) & 3)];
    return simde__m512_from_private(to);
}

/* masked loads and stores that touch only the mask's lanes, as the CPU's do: SIMDe's read and write all 64 bytes */
static inline simde__m512 load_float32_lanes(simde__mmask16 mask, const void *from)
{
    simde__m512_private to = simde__m512_to_private(simde_mm512_setzero_ps());
    for (int i = 0; i < 16; i++)
        if (mask >> i & 1)
            memcpy(&to.f32[i], (const float *)from + i, sizeof to.f32[i]);
    return simde__m512_from_private(to);
}

static inline void store_float32_lanes(void *to, simde__mmask16 mask, simde__m512 a)
{
    simde__m512_private from = simde__m512_to_private(a);
    for (int i = 0; i < 16; i++)
        if (mask >> i & 1)
            memcpy((float *)to + i, &from.f32[i], sizeof from.f32[i]);
}

static inline void store_int16_lanes(void *to, simde__mmask16 mask, simde__m256i a)
{
    simde__m256i_private from = simde__m256i_to_private(a);
    for (int i = 0; i < 16; i++)
        if (mask >> i & 1)
            memcpy((int16_t *)to + i, &from.i16[i], sizeof from.i16[i]);
}

#undef _mm512_cvtepi8_epi32
#define _mm512_cvtepi8_epi32 widen_int8_to_int32
#undef _mm512_cvtepu8_epi16
#define _mm512_cvtepu8_epi16 widen_uint8_to_int16
#undef _mm512_cvtepi32_epi16
#define _mm512_cvtepi32_epi16 truncate_int32_to_int16
#undef _mm512_reduce_add_ps
#define _mm512_reduce_add_ps sum_of_sixteen
#undef _mm512_permute_ps
#define _mm512_permute_ps permute_within_lanes
#undef _mm512_maskz_loadu_ps
#define _mm512_maskz_loadu_ps load_float32_lanes
#undef _mm512_mask_storeu_ps
#define _mm512_mask_storeu_ps store_float32_lanes
#undef _mm256_mask_storeu_epi16
#define _mm256_mask_storeu_epi16 store_int16_lanes

/* float32 lanes rounded to bfloat16 (to nearest, ties to even), as vcvtneps2bf16 rounds them */
static inline __m256bh round_to_bfloat16(simde__m512 a)
{
    simde__m512_private from = simde__m512_to_private(a);
    uint16_t to[16];
    for (int i = 0; i < 16; i++) {
        uint32_t bits;
        memcpy(&bits, &from.f32[i], sizeof bits);
        to[i] = (uint16_t)((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
    }
    __m256bh rounded;
    memcpy(&rounded, to, sizeof rounded);
    return rounded;
}

static inline __m512bh round_pair_to_bfloat16(simde__m512 high, simde__m512 low)
{
    __m256bh halves[2] = {round_to_bfloat16(low), round_to_bfloat16(high)};
    __m512bh rounded;
    memcpy(&rounded, halves, sizeof rounded);
    return rounded;
}

#define _mm512_cvtneps_pbh round_to_bfloat16
#define _mm512_cvtne2ps_pbh round_pair_to_bfloat16

/* what the AVX512-BF16 build's flags define */
#define __AVX512F__ 1
#define __AVX512BW__ 1
#define __AVX512VL__ 1
#define __AVX512VNNI__ 1
#define __AVX512BF16__ 1
