fn main() {
    // Test binaries of this crate load libmlx from the wheel directory mlx-sys linked against.
    if let Ok(dir) = std::env::var("DEP_MLX_LIB_DIR") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
}
