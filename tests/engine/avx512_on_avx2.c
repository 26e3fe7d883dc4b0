/* The AVX512-BF16 build of the CPU kernels (the AVX-512 build and its bfloat16 prefill attention), for their tests
 * on a CPU without AVX-512: SIMDe (simde-py's headers) carries out each AVX-512 intrinsic in AVX2 ones, and the
 * few it lacks are written out below, lane by lane.
 * Compiled with the kernels' FLAGS, -I<simde_py.get_include()> and -DKERNELS_SOURCE="<cpu_kernels.c>". */
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

#undef _mm512_cvtepi8_epi32
#define _mm512_cvtepi8_epi32 widen_int8_to_int32
#undef _mm512_cvtepu8_epi16
#define _mm512_cvtepu8_epi16 widen_uint8_to_int16
#undef _mm512_cvtepi32_epi16
#define _mm512_cvtepi32_epi16 truncate_int32_to_int16
#undef _mm512_reduce_add_ps
#define _mm512_reduce_add_ps sum_of_sixteen

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
#include KERNELS_SOURCE
