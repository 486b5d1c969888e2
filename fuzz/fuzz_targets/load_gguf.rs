//! A GGUF file from a stranger: arbitrary bytes where llama.cpp's format is expected. The
//! header, the configuration, the tokenizer metadata and the model are all read (as stored and
//! fused for inference), and a model that loads runs one step.
#![no_main]

use std::io::Write;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut file = tempfile::Builder::new()
        .suffix(".gguf")
        .tempfile()
        .expect("temporary file");
    file.write_all(data).expect("write model");
    let Ok(gguf) = gpt_blocks::Gguf::open(file.path()) else {
        return;
    };
    let _ = gguf.vocab();
    let _ = gguf.chat_template();
    let dev = candle_core::Device::Cpu;
    // As stored, and as `gpt` loads for inference: q/k/v and gate/up fused as they are read,
    // block-quantized parts packed straight into the shared slabs.
    let plain = gpt_blocks::LoadOptions::new(candle_core::DType::F32);
    for opts in [plain, plain.for_inference()] {
        if let Ok(model) = gguf.load(opts, &dev) {
            if let Ok(ids) = candle_core::Tensor::new(&[[0u32]], &dev) {
                let _ = model.infer(&ids, None, None, gpt_blocks::Logits::Last);
            }
        }
    }
});
