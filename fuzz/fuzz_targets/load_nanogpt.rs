//! A nanoGPT `ckpt.pt` from a stranger: arbitrary bytes where a PyTorch zip with a pickle
//! is expected.
#![no_main]

use std::io::Write;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut file = tempfile::Builder::new()
        .suffix(".pt")
        .tempfile()
        .expect("temporary file");
    file.write_all(data).expect("write checkpoint");
    let dev = candle_core::Device::Cpu;
    if let Ok(model) = gpt_blocks::load_nanogpt(file.path(), candle_core::DType::F32, &dev) {
        if let Ok(ids) = candle_core::Tensor::new(&[[0u32, 1]], &dev) {
            let _ = model.infer(&ids, None, None, gpt_blocks::Logits::Last);
        }
    }
});
