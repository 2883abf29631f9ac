use mlx_rs::{ops, transforms::eval, Array};
fn main() {
    let dir = std::path::Path::new("/work/shared/models/SmolLM2-135M-Instruct-4bit");
    let model = perch_engine::models::load(dir).unwrap();
    let ref_: serde_json::Value = serde_json::from_str(&std::fs::read_to_string("/work/shared/reference/smollm2-135m-4bit-greedy.json").unwrap()).unwrap();
    for case in ref_["cases"].as_array().unwrap() {
        let prompt: Vec<u32> = case["prompt_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        let want: Vec<u32> = case["greedy_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        let mut cache = model.make_cache();
        let n = prompt.len() as i32;
        let t = std::time::Instant::now();
        let head = Array::from_slice(&prompt[..prompt.len()-1], &[1, n - 1]);
        let _ = model.forward(&head, &mut cache).unwrap();
        let states: Vec<&Array> = cache.iter().flat_map(|c| c.state()).collect();
        eval(states).unwrap();
        let mut tok = prompt[prompt.len()-1];
        let mut got = vec![];
        for _ in 0..want.len() {
            let logits = model.forward(&Array::from_slice(&[tok], &[1, 1]), &mut cache).unwrap();
            let y = ops::indexing::argmax_axis(&logits, -1, None).unwrap();
            tok = y.item::<u32>();
            got.push(tok);
        }
        println!("{} match={} {:?} ({:?})", case["id"], got == want, &got[..8.min(got.len())], t.elapsed());
    }
}
