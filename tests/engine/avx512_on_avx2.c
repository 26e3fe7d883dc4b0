/* The AVX-512 build of the CPU kernels, for their tests on a CPU without AVX-512: SIMDe (simde-py's headers)
 * carries out each AVX-512 intrinsic in AVX2 ones, and the few it lacks are written out below, lane by lane.
 * Compiled with the kernels' FLAGS, -I<simde_py.get_include()> and -DKERNELS_SOURCE="<cpu_kernels.c>". */
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

static inline simde__m512i widen_int8_to_int32(simde__m128i a)
{
    simde__m128i_private from = simde__m128i_to_private(a);
    simde__m512i_private to;
    for (int i = 0; i < 16; i++)
        to.i32[i] = from.i8[i];
    return simde__m512i_from_private(to);
}

static inline simde__m512i widen_uint8_to_int16(simde__m256i a)
{
    simde__m256i_private from = simde__m256i_to_private(a);
    simde__m512i_private to;
    for (int i = 0; i < 32; i++)
        to.i16[i] = from.u8[i];
    return simde__m512i_from_private(to);
}

static inline simde__m256i truncate_int32_to_int16(simde__m512i a)
{
    simde__m512i_private from = simde__m512i_to_private(a);
    simde__m256i_private to;
    for (int i = 0; i < 16; i++)
        to.i16[i] = (int16_t)from.i32[i];
    return simde__m256i_from_private(to);
}

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

/* what the AVX-512 build's flags define */
#define __AVX512F__ 1
#define __AVX512BW__ 1
#define __AVX512VL__ 1
#define __AVX512VNNI__ 1
#include KERNELS_SOURCE
