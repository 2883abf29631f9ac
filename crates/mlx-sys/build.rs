//! Builds mlx-c 0.7.0 against the official MLX 0.32.2 wheel and generates its bindings.
//!
//! Steps (the traps behind each are recorded in `README.md`):
//! 1. find the mlx-c sources that ship inside crates.io's `mlx-sys-0.7.0` (or `MLX_C_SRC_DIR`);
//! 2. install the MLX wheel for the chosen backend with pip (or use `MLX_WHEEL_DIR`), check its version;
//! 3. on Linux CPU, point the wheel's reference BLAS at OpenBLAS when the system has it;
//! 4. compile mlx-c (plus a small shim on non-ARM targets) into a static `mlxc`;
//! 5. run bindgen over `mlx/c/*.h`;
//! 6. link `mlxc` statically and `libmlx` dynamically, and publish the library directory as
//!    `DEP_MLX_LIB_DIR` so each final binary's build script can add an rpath.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The MLX release the bindings are written for. mlx-c 0.7.0 does not compile against 0.32.4.
const MLX_VERSION: &str = "0.32.2";
const UPSTREAM_MLX_SYS: &str = "mlx-sys-0.7.0";

type BuildResult<T> = Result<T, String>;

fn main() {
    if let Err(message) = build() {
        // A build script reports failure by panicking; make the message the first thing people read.
        panic!("\n\nmlx-sys: {message}\n\n");
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Backend {
    Cpu,
    Metal,
    Cuda12,
    Cuda13,
}

impl Backend {
    fn from_env(target_os: &str) -> BuildResult<Self> {
        match env::var("PERCH_MLX_BACKEND").ok().as_deref() {
            None | Some("") => Ok(if target_os == "macos" {
                Self::Metal
            } else {
                Self::Cpu
            }),
            Some("cpu") => Ok(Self::Cpu),
            Some("metal") => Ok(Self::Metal),
            Some("cuda12") | Some("cuda-12") => Ok(Self::Cuda12),
            Some("cuda13") | Some("cuda-13") => Ok(Self::Cuda13),
            Some(other) => Err(format!(
                "PERCH_MLX_BACKEND={other} is not a backend; use one of cpu, metal, cuda12, cuda13"
            )),
        }
    }

    /// The PyPI distribution that carries `libmlx` for this backend.
    fn wheel(self) -> &'static str {
        match self {
            Self::Cpu => "mlx-cpu",
            Self::Metal => "mlx-metal",
            Self::Cuda12 => "mlx-cuda-12",
            Self::Cuda13 => "mlx-cuda-13",
        }
    }
}

fn build() -> BuildResult<()> {
    for var in [
        "PERCH_MLX_BACKEND",
        "MLX_WHEEL_DIR",
        "MLX_C_SRC_DIR",
        "PERCH_BLAS",
        "PERCH_BLAS_LIB",
        "PYTHON",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    println!("cargo:rerun-if-changed=native");

    let out_dir = PathBuf::from(env::var("OUT_DIR").map_err(|e| e.to_string())?);
    let target_os = env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    let target_arch = env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
    let backend = Backend::from_env(&target_os)?;

    let mlx_c = mlx_c_sources(&out_dir)?;
    check_mlx_c_tag(&mlx_c)?;
    let wheel = wheel_dir(&out_dir, backend)?;
    let include_dir = wheel.join("mlx/include");
    let lib_dir = wheel.join("mlx/lib");
    check_wheel_version(&include_dir)?;
    if backend == Backend::Cpu && target_os == "linux" {
        use_openblas(&wheel)?;
    }

    let arm = target_arch == "aarch64";
    // Bindings first: they fail in seconds, the C++ build takes minutes.
    generate_bindings(&mlx_c, &out_dir, arm)?;
    compile_mlx_c(&mlx_c, &include_dir, arm)?;

    println!("cargo:rustc-link-search=native={}", lib_dir.display());
    println!("cargo:rustc-link-lib=dylib=mlx");
    if target_os == "macos" {
        println!("cargo:rustc-link-lib=dylib=c++");
    } else {
        println!("cargo:rustc-link-lib=dylib=stdc++");
    }
    println!("cargo::metadata=lib_dir={}", lib_dir.display());
    println!("cargo::metadata=backend={backend:?}");
    println!("cargo:rustc-env=PERCH_MLX_LIB_DIR={}", lib_dir.display());
    println!("cargo:rustc-env=PERCH_MLX_VERSION={MLX_VERSION}");
    Ok(())
}

/// Step 1: mlx-c's sources. They ship inside crates.io's mlx-sys 0.7.0, which our patch hides from
/// the workspace, so fetch that crate through a throwaway manifest when the registry lacks it.
fn mlx_c_sources(out_dir: &Path) -> BuildResult<PathBuf> {
    if let Some(dir) = env::var_os("MLX_C_SRC_DIR") {
        let dir = PathBuf::from(dir);
        return if dir.join("mlx/c/array.h").is_file() {
            Ok(dir)
        } else {
            Err(format!(
                "MLX_C_SRC_DIR={} holds no mlx/c/array.h",
                dir.display()
            ))
        };
    }
    if let Some(found) = find_in_registry() {
        return Ok(found);
    }
    let helper = out_dir.join("fetch-mlx-c");
    fs::create_dir_all(helper.join("src")).map_err(|e| e.to_string())?;
    fs::write(
        helper.join("Cargo.toml"),
        "[package]\nname = \"perch-fetch-mlx-c\"\nversion = \"0.0.0\"\nedition = \"2021\"\n\
         [dependencies]\nmlx-sys = \"=0.7.0\"\n[workspace]\n",
    )
    .map_err(|e| e.to_string())?;
    fs::write(helper.join("src/lib.rs"), "").map_err(|e| e.to_string())?;
    let cargo = env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let status = Command::new(cargo)
        .arg("fetch")
        .current_dir(&helper)
        .status()
        .map_err(|e| format!("could not run `cargo fetch` for the mlx-c sources: {e}"))?;
    if !status.success() {
        return Err(format!(
            "`cargo fetch` of {UPSTREAM_MLX_SYS} (which carries the mlx-c sources) failed; \
             set MLX_C_SRC_DIR to an mlx-c 0.7.0 checkout to build offline"
        ));
    }
    find_in_registry().ok_or_else(|| {
        format!("{UPSTREAM_MLX_SYS} was fetched but its src/mlx-c was not found under $CARGO_HOME/registry/src")
    })
}

fn find_in_registry() -> Option<PathBuf> {
    let cargo_home = env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| env::var_os("HOME").map(|home| PathBuf::from(home).join(".cargo")))?;
    let registries = fs::read_dir(cargo_home.join("registry/src")).ok()?;
    registries
        .filter_map(|entry| entry.ok())
        .map(|entry| entry.path().join(UPSTREAM_MLX_SYS).join("src/mlx-c"))
        .find(|dir| dir.join("mlx/c/array.h").is_file())
}

/// mlx-c pins the MLX it was written for in its CMakeLists (`GIT_TAG vX.Y.Z`).
fn check_mlx_c_tag(mlx_c: &Path) -> BuildResult<()> {
    let cmake = fs::read_to_string(mlx_c.join("CMakeLists.txt")).map_err(|e| e.to_string())?;
    let tag = cmake
        .lines()
        .find_map(|line| line.trim().strip_prefix("GIT_TAG v"))
        .map(|rest| rest.trim_end_matches(')').trim().to_string());
    match tag {
        Some(tag) if tag == MLX_VERSION => Ok(()),
        Some(tag) => Err(format!(
            "mlx-c at {} is written for MLX {tag}, but Perch pins MLX {MLX_VERSION}",
            mlx_c.display()
        )),
        None => Err(format!("no GIT_TAG in {}/CMakeLists.txt", mlx_c.display())),
    }
}

/// Step 2: the wheel, installed with `pip install --no-deps --target`.
fn wheel_dir(out_dir: &Path, backend: Backend) -> BuildResult<PathBuf> {
    if let Some(dir) = env::var_os("MLX_WHEEL_DIR") {
        let dir = PathBuf::from(dir);
        return if dir.join("mlx/include/mlx/version.h").is_file() {
            Ok(dir)
        } else {
            Err(format!(
                "MLX_WHEEL_DIR={} is not a `pip install --target` of an MLX wheel (no mlx/include/mlx/version.h)",
                dir.display()
            ))
        };
    }
    let dir = out_dir.join(format!("{}-{MLX_VERSION}", backend.wheel()));
    if dir.join("mlx/include/mlx/version.h").is_file() {
        return Ok(dir);
    }
    let python = env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let requirement = format!("{}=={MLX_VERSION}", backend.wheel());
    let output = Command::new(&python)
        .args(["-m", "pip", "install", "--quiet", "--no-deps", "--target"])
        .arg(&dir)
        .arg(&requirement)
        .output()
        .map_err(|e| format!("could not run `{python} -m pip` to install {requirement}: {e}"))?;
    if !output.status.success() {
        return Err(format!(
            "`pip install {requirement}` failed (Perch links the official MLX wheel; set MLX_WHEEL_DIR \
             to a directory made by `pip install --no-deps --target DIR {requirement}` to build offline):\n{}",
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    Ok(dir)
}

fn check_wheel_version(include_dir: &Path) -> BuildResult<()> {
    let header =
        fs::read_to_string(include_dir.join("mlx/version.h")).map_err(|e| e.to_string())?;
    let part = |name: &str| {
        header.lines().find_map(|line| {
            let rest = line.trim().strip_prefix("#define ")?.strip_prefix(name)?;
            Some(rest.trim().to_string())
        })
    };
    let found = match (
        part("MLX_VERSION_MAJOR"),
        part("MLX_VERSION_MINOR"),
        part("MLX_VERSION_PATCH"),
    ) {
        (Some(a), Some(b), Some(c)) => format!("{a}.{b}.{c}"),
        _ => {
            return Err(format!(
                "could not read the MLX version from {}",
                include_dir.display()
            ))
        }
    };
    if found != MLX_VERSION {
        return Err(format!(
            "the MLX wheel at {} is version {found}; mlx-c 0.7.0 needs exactly {MLX_VERSION}",
            include_dir.display()
        ));
    }
    Ok(())
}

/// Step 3: the `mlx-cpu` wheel bundles netlib's reference BLAS (~4 GFLOP/s here). libmlx finds it
/// by its hashed file name through an RPATH, so replacing that file with a link to OpenBLAS makes
/// every matmul use OpenBLAS (~20x faster at batch 32). `PERCH_BLAS=reference` keeps the original.
fn use_openblas(wheel: &Path) -> BuildResult<()> {
    let libs = wheel.join("mlx_cpu.libs");
    let Ok(entries) = fs::read_dir(&libs) else {
        return Ok(());
    };
    let Some(bundled) = entries
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .find(|p| file_name(p).starts_with("libblas-") && !file_name(p).ends_with(".reference"))
    else {
        return Ok(());
    };
    let reference = bundled.with_file_name(format!("{}.reference", file_name(&bundled)));
    if !reference.exists() {
        fs::rename(&bundled, &reference).map_err(|e| e.to_string())?;
    }
    let openblas = env::var_os("PERCH_BLAS_LIB")
        .map(PathBuf::from)
        .or_else(|| {
            [
                "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
                "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
                "/usr/lib64/libopenblas.so.0",
            ]
            .iter()
            .map(PathBuf::from)
            .find(|p| p.exists())
        });
    let target = match (env::var("PERCH_BLAS").ok().as_deref(), openblas) {
        (Some("reference"), _) => reference.clone(),
        (_, Some(openblas)) => openblas,
        (_, None) => {
            println!(
                "cargo:warning=OpenBLAS not found (apt-get install libopenblas0-pthread); MLX will use the \
                 reference BLAS, ~20x slower on CPU"
            );
            reference.clone()
        }
    };
    let _ = fs::remove_file(&bundled);
    std::os::unix::fs::symlink(&target, &bundled).map_err(|e| {
        format!(
            "could not link {} to {}: {e}",
            bundled.display(),
            target.display()
        )
    })?;
    Ok(())
}

fn file_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// Step 4: mlx-c is plain C++20 over the MLX headers; `cc` builds it without cmake.
fn compile_mlx_c(mlx_c: &Path, include_dir: &Path, arm: bool) -> BuildResult<()> {
    let native =
        PathBuf::from(env::var("CARGO_MANIFEST_DIR").map_err(|e| e.to_string())?).join("native");
    let mut sources: Vec<PathBuf> = fs::read_dir(mlx_c.join("mlx/c"))
        .map_err(|e| e.to_string())?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        // object.cpp is commented out of mlx-c's own CMakeLists.
        .filter(|p| p.extension().is_some_and(|x| x == "cpp") && file_name(p) != "object.cpp")
        .collect();
    sources.sort();
    if !arm {
        sources.push(native.join("half_shim.cpp"));
    }
    sources.push(native.join("array_id.cpp"));
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .std("c++20")
        // -O2, but unoptimized where the profile is (test builds): thin wrappers over libmlx,
        // whose work is MLX's own, compile in half the time at -O0.
        .opt_level(if env::var("OPT_LEVEL").as_deref() == Ok("0") {
            0
        } else {
            2
        })
        .debug(false)
        .warnings(false)
        .include(mlx_c)
        .include(include_dir)
        .files(&sources);
    if !build.get_compiler().is_like_clang() {
        build
            .flag("-include")
            .flag(native.join("format_compat.h").to_string_lossy().as_ref());
    }
    build
        .try_compile("mlxc")
        .map_err(|e| format!("compiling mlx-c failed: {e}"))
}

/// Step 5: bindings for every public mlx-c header, as upstream mlx-sys generates them.
fn generate_bindings(mlx_c: &Path, out_dir: &Path, arm: bool) -> BuildResult<()> {
    let mut headers: Vec<PathBuf> = fs::read_dir(mlx_c.join("mlx/c"))
        .map_err(|e| e.to_string())?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "h"))
        .collect();
    headers.sort();
    let mut builder = bindgen::Builder::default()
        .rust_target(bindgen::RustTarget::stable(73, 0).map_err(|e| e.to_string())?)
        .clang_arg(format!("-I{}", mlx_c.display()))
        .blocklist_function("malloc")
        .blocklist_function("realloc")
        .layout_tests(false);
    if !arm {
        let prelude = PathBuf::from(env::var("CARGO_MANIFEST_DIR").map_err(|e| e.to_string())?)
            .join("native/bindgen_prelude.h");
        builder = builder.header(prelude.to_string_lossy());
    }
    for header in &headers {
        builder = builder.header(header.to_string_lossy());
    }
    let bindings = builder
        .generate()
        .map_err(|e| format!("bindgen failed on mlx-c's headers (is libclang installed?): {e}"))?;
    bindings
        .write_to_file(out_dir.join("bindings.rs"))
        .map_err(|e| e.to_string())
}
