// mlx-c declares its float16/bfloat16 accessors only on ARM (mlx/c/half.h); mlx-rs calls them on
// every platform. Same symbols, with the 16-bit payload passed as uint16_t (identical ABI).
#include <cstdint>
#include <cstring>

#include "mlx/c/error.h"
#include "mlx/c/private/mlx.h"

namespace {
template <typename T>
int item_bits(uint16_t* res, const mlx_array arr) {
  try {
    T value = mlx_array_get_(arr).item<T>();
    std::memcpy(res, &value, sizeof(uint16_t));
  } catch (std::exception& e) {
    mlx_error(e.what());
    return 1;
  }
  return 0;
}

template <typename T>
const uint16_t* data_bits(const mlx_array arr) {
  try {
    return reinterpret_cast<const uint16_t*>(mlx_array_get_(arr).data<T>());
  } catch (std::exception& e) {
    mlx_error(e.what());
    return nullptr;
  }
}
} // namespace

extern "C" int mlx_array_item_float16(uint16_t* res, const mlx_array arr) {
  return item_bits<mlx::core::float16_t>(res, arr);
}
extern "C" int mlx_array_item_bfloat16(uint16_t* res, const mlx_array arr) {
  return item_bits<mlx::core::bfloat16_t>(res, arr);
}
extern "C" const uint16_t* mlx_array_data_float16(const mlx_array arr) {
  return data_bits<mlx::core::float16_t>(arr);
}
extern "C" const uint16_t* mlx_array_data_bfloat16(const mlx_array arr) {
  return data_bits<mlx::core::bfloat16_t>(arr);
}
