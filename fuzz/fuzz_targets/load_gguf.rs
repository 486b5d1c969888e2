//! A GGUF file from a stranger: arbitrary bytes where llama.cpp's format is expected. The
//! header, the configuration, the tokenizer metadata and the model are all read, and a model
//! that loads runs one step.
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
    if let Ok(model) = gguf.load(candle_core::DType::F32, &dev) {
        if let Ok(ids) = candle_core::Tensor::new(&[[0u32]], &dev) {
            let _ = model.infer(&ids, None, None, gpt_blocks::Logits::Last);
        }
    }
});
