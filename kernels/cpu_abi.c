/* This build's side of the declared interface (switchyard_kernels.h), as the compiler laid it out: the size and
 * field offsets of each struct the Python side mirrors with ctypes, and each shared constant's value.
 * tests/kernels/test_kernel_c_interface.py reads the table through sy_abi_* and compares it with
 * kernels/cpu_decode.py's Structures and the Python constants; every struct field and constant of the header is
 * listed here (the test checks that against the header too). */
#include <stddef.h>
#include <stdint.h>

#include "switchyard_kernels.h"

typedef struct {
    const char *name;
    int64_t value;
} abi_entry;

#define SIZE(T) {"sizeof(" #T ")", (int64_t)sizeof(T)}
#define OFFSET(T, F) {"offsetof(" #T ", " #F ")", (int64_t)offsetof(T, F)}
#define CONSTANT(C) {#C, (int64_t)(C)}

static const abi_entry entries[] = {
    SIZE(sy_proj),
    OFFSET(sy_proj, kind),
    OFFSET(sy_proj, group_size),
    OFFSET(sy_proj, n),
    OFFSET(sy_proj, k),
    OFFSET(sy_proj, w),
    OFFSET(sy_proj, aux),
    OFFSET(sy_proj, bias),
    SIZE(sy_layer),
    OFFSET(sy_layer, input_norm),
    OFFSET(sy_layer, post_norm),
    OFFSET(sy_layer, k_cache),
    OFFSET(sy_layer, v_cache),
    OFFSET(sy_layer, qkv),
    OFFSET(sy_layer, o),
    OFFSET(sy_layer, gate_up),
    OFFSET(sy_layer, down),
    SIZE(sy_model),
    OFFSET(sy_model, num_layers),
    OFFSET(sy_model, hidden),
    OFFSET(sy_model, num_heads),
    OFFSET(sy_model, num_kv_heads),
    OFFSET(sy_model, head_dim),
    OFFSET(sy_model, inter),
    OFFSET(sy_model, eps),
    OFFSET(sy_model, scale),
    OFFSET(sy_model, kv_bf16),
    OFFSET(sy_model, block_size),
    OFFSET(sy_model, cache_sb),
    OFFSET(sy_model, cache_so),
    OFFSET(sy_model, cache_sh),
    OFFSET(sy_model, num_blocks),
    OFFSET(sy_model, cos_sin),
    OFFSET(sy_model, max_position),
    OFFSET(sy_model, layers),
    OFFSET(sy_model, final_norm),
    OFFSET(sy_model, head),
    CONSTANT(SY_MAX_Q_HEADS),
    CONSTANT(SY_MAX_HEAD_DIM),
    CONSTANT(SY_MAX_BLOCK_ROW),
    CONSTANT(SY_AMX_KEY_CHUNK),
    CONSTANT(SY_PANEL_N),
    CONSTANT(SY_QBLOCK),
    CONSTANT(SY_GROUP_Q8),
    CONSTANT(SY_GROUP_BF16),
    CONSTANT(SY_FEATURE_VNNI),
    CONSTANT(SY_FEATURE_BF16),
    CONSTANT(SY_FEATURE_AVX512_BF16),
    CONSTANT(SY_FEATURE_AMX_BF16),
    CONSTANT(SY_PROJ_F32_PANELS),
    CONSTANT(SY_PROJ_INT8),
    CONSTANT(SY_PROJ_INT4),
    CONSTANT(SY_PROJ_BF16),
    CONSTANT(SY_ERR_BLOCK),
    CONSTANT(SY_ERR_TABLE),
    CONSTANT(SY_ERR_POSITION),
    CONSTANT(SY_ERR_SLOT),
    CONSTANT(SY_ERR_NO_HEAD),
    CONSTANT(SY_ERR_TOKEN),
};

int sy_abi_count(void) { return (int)(sizeof(entries) / sizeof(entries[0])); }

const char *sy_abi_name(int i) { return i >= 0 && i < sy_abi_count() ? entries[i].name : NULL; }

int64_t sy_abi_value(int i) { return i >= 0 && i < sy_abi_count() ? entries[i].value : 0; }
