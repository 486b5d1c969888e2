//! A Hugging Face GPT-2 directory from a stranger: arbitrary `config.json` and
//! `model.safetensors` bytes, loaded as `gpt --model DIR` loads them.
#![no_main]

use std::io::Write;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The first two bytes say where the config ends and the weights begin.
    if data.len() < 2 {
        return;
    }
    let split = (u16::from_le_bytes([data[0], data[1]]) as usize).min(data.len() - 2);
    let (config, weights) = data[2..].split_at(split);
    let dir = tempfile::tempdir().expect("temporary directory");
    std::fs::File::create(dir.path().join("config.json"))
        .and_then(|mut f| f.write_all(config))
        .expect("write config");
    std::fs::File::create(dir.path().join("model.safetensors"))
        .and_then(|mut f| f.write_all(weights))
        .expect("write weights");
    let dev = candle_core::Device::Cpu;
    // As stored, and fused for inference as `gpt` loads it.
    let plain = gpt_blocks::LoadOptions::new(candle_core::DType::F32);
    for opts in [plain, plain.for_inference()] {
        if let Ok(model) = gpt_blocks::load(dir.path(), opts, &dev) {
            // A model that loads must also run (or fail cleanly) on a short prompt.
            let _ = model.check_weights();
            if let Ok(ids) = candle_core::Tensor::new(&[[0u32, 1]], &dev) {
                let _ = model.infer(&ids, None, None, gpt_blocks::Logits::Last);
            }
        }
    }
});
