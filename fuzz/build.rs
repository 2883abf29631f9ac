fn main() {
    // Not on every change in fuzz/ (the corpus grows while fuzzing).
    println!("cargo:rerun-if-changed=build.rs");
    // The fuzz binaries load libmlx from the wheel directory mlx-sys linked against.
    if let Ok(dir) = std::env::var("DEP_MLX_LIB_DIR") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
}
