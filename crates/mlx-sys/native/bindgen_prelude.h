// Read by bindgen before the mlx-c headers: declare the 16-bit float types on every target so the
// generated bindings match the ones upstream mlx-sys generates on Apple Silicon.
#define HAS_FLOAT16
#define HAS_BFLOAT16
typedef __fp16 float16_t;
typedef unsigned short bfloat16_t;
