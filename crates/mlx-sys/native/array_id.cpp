// The identity of an MLX array, which mlx-c does not expose: `mlx::core::array::id`, the address of
// the descriptor every handle to one array shares (the same before and after it is evaluated).
#include <cstdint>

#include "mlx/c/private/mlx.h"

extern "C" uintptr_t perch_mlx_array_id(const mlx_array arr) {
  return mlx_array_get_(arr).id();
}
