/* The AMX build of the CPU kernels, for their tests on a CPU without AMX tiles: each tile instruction the kernels
 * use is carried out in C on this thread's eight tiles, with the checks the CPU makes before it runs one (palette 1
 * configured, shapes that fit a tile and each other). Force-included (-include) ahead of cpu_kernels.c, or ahead
 * of avx512_on_avx2.c where the CPU has no AVX-512 either. */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define __AMX_TILE__ 1
#define __AMX_BF16__ 1

#define TILES 8

static _Thread_local struct {
    int configured;
    int rows[TILES], bytes_per_row[TILES];
    uint8_t data[TILES][16][64];
} tiles;

static void tile_fault(const char *what, int tile)
{
    fprintf(stderr, "emulated AMX tiles: %s (tile %d); an AMX CPU raises #UD or #GP here\n", what, tile);
    abort();
}

/* ldtilecfg's 64-byte operand: palette, start row, 14 reserved bytes, 16 row widths in bytes, 16 row counts */
static void emulated_tile_loadconfig(const void *config)
{
    const uint8_t *bytes = config;
    if (bytes[0] != 1)
        tile_fault("a palette other than 1", -1);
    memset(&tiles, 0, sizeof tiles);
    for (int t = 0; t < 16; t++) {
        uint16_t bytes_per_row;
        memcpy(&bytes_per_row, bytes + 16 + 2 * t, sizeof bytes_per_row);
        int rows = bytes[48 + t];
        if (t >= TILES ? rows || bytes_per_row : rows > 16 || bytes_per_row > 64 || bytes_per_row % 4)
            tile_fault("a shape palette 1 does not have", t);
        if (t < TILES) {
            tiles.rows[t] = rows;
            tiles.bytes_per_row[t] = bytes_per_row;
        }
    }
    tiles.configured = 1;
}

static void configured(int t)
{
    if (!tiles.configured || t < 0 || t >= TILES || !tiles.rows[t])
        tile_fault("a tile that is not configured", t);
}

static void emulated_tile_zero(int t)
{
    configured(t);
    memset(tiles.data[t], 0, sizeof tiles.data[t]);
}

static void emulated_tile_loadd(int t, const void *base, long stride)
{
    configured(t);
    for (int r = 0; r < tiles.rows[t]; r++)
        memcpy(tiles.data[t][r], (const uint8_t *)base + r * stride, tiles.bytes_per_row[t]);
}

static void emulated_tile_stored(int t, void *base, long stride)
{
    configured(t);
    for (int r = 0; r < tiles.rows[t]; r++)
        memcpy((uint8_t *)base + r * stride, tiles.data[t][r], tiles.bytes_per_row[t]);
}

/* bfloat16 to float32, a denormal read as zero (as the tiles read it) */
static float tile_bfloat16(const uint8_t *row, int i)
{
    uint16_t half;
    memcpy(&half, row + 2 * i, sizeof half);
    uint32_t bits = (half & 0x7f80) ? (uint32_t)half << 16 : (uint32_t)(half & 0x8000) << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* sums [m][n] += Σ_k a[m][2k] · b[k][2n] + a[m][2k + 1] · b[k][2n + 1], float32 sums of bfloat16 pairs */
static void emulated_tile_dpbf16ps(int sums, int a, int b)
{
    configured(sums);
    configured(a);
    configured(b);
    int depth = tiles.bytes_per_row[a] / 4, columns = tiles.bytes_per_row[sums] / 4;
    if (tiles.rows[sums] != tiles.rows[a] || depth != tiles.rows[b] || tiles.bytes_per_row[b] != 4 * columns)
        tile_fault("shapes that do not fit", sums);
    for (int m = 0; m < tiles.rows[sums]; m++) {
        float row[16];
        memcpy(row, tiles.data[sums][m], sizeof row);
        for (int k = 0; k < depth; k++) {
            float first = tile_bfloat16(tiles.data[a][m], 2 * k), second = tile_bfloat16(tiles.data[a][m], 2 * k + 1);
            for (int n = 0; n < columns; n++) {
                row[n] += first * tile_bfloat16(tiles.data[b][k], 2 * n);
                row[n] += second * tile_bfloat16(tiles.data[b][k], 2 * n + 1);
            }
        }
        memcpy(tiles.data[sums][m], row, sizeof row);
    }
}

#undef _tile_zero
#undef _tile_loadd
#undef _tile_stored
#undef _tile_dpbf16ps
#define _tile_loadconfig emulated_tile_loadconfig
#define _tile_zero emulated_tile_zero
#define _tile_loadd emulated_tile_loadd
#define _tile_stored emulated_tile_stored
#define _tile_dpbf16ps emulated_tile_dpbf16ps

/* The tiles are this thread's memory: there is no tile state to ask Linux for. */
int tandem_amx_init(void)
{
    return 0;
}
#define tandem_amx_init tandem_amx_init_on_an_amx_cpu
