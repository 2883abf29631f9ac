//! Prints milliseconds per `matmul_transposed` call and GFLOP/s for SmolLM2-135M's layer shapes
//! (4-bit, group size 64). Run: `cargo run --release -p perch-qgemm --example qgemm_bench [ROWS...]`.

use std::time::Instant;

use perch_qgemm::{matmul_transposed, QuantizedMatrix};

fn main() {
    // Optional arguments: the row counts to run (default 1 4 32 512).
    let ms: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("row counts are integers"))
        .collect();
    let ms = if ms.is_empty() {
        vec![1, 4, 32, 512]
    } else {
        ms
    };
    let shapes = [(576, 576), (1536, 576), (576, 1536), (49152, 576)];
    println!("| weight | rows | ms per call | GFLOP/s |");
    println!("|---|---|---|---|");
    for (rows, cols) in shapes {
        let (bits, group_size) = (4u32, 64usize);
        let packed: Vec<u32> = (0..rows * cols / 8)
            .map(|i| (i as u32).wrapping_mul(2_654_435_761))
            .collect();
        let scales = vec![0.01f32; rows * cols / group_size];
        let biases = vec![-0.05f32; rows * cols / group_size];
        let w = QuantizedMatrix::new(&packed, &scales, &biases, rows, cols, group_size, bits)
            .expect("valid matrix");
        for &m in &ms {
            let x: Vec<f32> = (0..m * cols).map(|i| (i % 13) as f32 * 0.1).collect();
            let mut y = vec![0f32; m * rows];
            matmul_transposed(&x, m, &w, &mut y).expect("shapes match");
            let runs = (200_000_000 / (rows * cols * m.max(8))).clamp(3, 200);
            let start = Instant::now();
            for _ in 0..runs {
                matmul_transposed(&x, m, &w, &mut y).expect("shapes match");
            }
            let secs = start.elapsed().as_secs_f64() / runs as f64;
            let gflops = 2.0 * (m * rows * cols) as f64 / secs / 1e9;
            println!("| {rows}x{cols} | {m} | {:.3} | {gflops:.1} |", secs * 1e3);
        }
    }
}
