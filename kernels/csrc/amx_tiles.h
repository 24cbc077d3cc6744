/* The AMX tile configuration every Parkade kernel on the tiles uses (attention_amx.h, linear_amx.c):
 * palette 1, all eight tiles 16 rows x 64 bytes. Loaded per call of a kernel entry on each thread,
 * since oneDNN's matmuls configure the same registers in between. Include after <immintrin.h>,
 * built with AMX. */
#ifndef PARKADE_AMX_TILES_H
#define PARKADE_AMX_TILES_H
#include <stdint.h>
#include <string.h>

static inline void amx_configure(void) {
    struct __attribute__((packed)) {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
}
#endif
