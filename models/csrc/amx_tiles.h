/* The AMX tile configuration's memory layout (palette 1), which _tile_loadconfig reads: shared by the kernels that
 * configure tiles (amx_matmul.c, piece_products.h), each with its own tile shapes. */
#ifndef BUCKETSERVE_AMX_TILES_H
#define BUCKETSERVE_AMX_TILES_H

#include <stdint.h>

typedef struct {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

#endif
