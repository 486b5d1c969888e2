//! The model shipped in `crates/cli/models/default` (and built into `gpt`): it loads with its
//! tokenizer, and it has learned its corpus: real Shakespeare scores far better than the
//! same tokens shuffled.

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use gpt_blocks::{load, token_logprobs, Logits};

const PASSAGE: &str = "Friends, Romans, countrymen, lend me your ears;\n\
I come to bury Caesar, not to praise him.\n\
The evil that men do lives after them;\n\
The good is oft interred with their bones;\n\
So let it be with Caesar.";

fn nll(model: &gpt_blocks::Gpt, ids: &[u32]) -> f64 {
    let t = Tensor::new(ids, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let logits = model.infer(&t, None, None, Logits::All).unwrap();
    let lp: Vec<f32> = token_logprobs(&logits, &t)
        .unwrap()
        .squeeze(0)
        .unwrap()
        .to_vec1()
        .unwrap();
    -lp.iter().map(|&x| x as f64).sum::<f64>() / lp.len() as f64
}

#[test]
fn default_model_has_learned_its_corpus() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("crates/cli/models/default");
    let model = load(&dir, DType::F32, &Device::Cpu).unwrap();
    let tok = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    assert_eq!(tok.get_vocab_size(true), model.config().vocab_size);
    let ids = tok.encode(PASSAGE, false).unwrap().get_ids().to_vec();
    assert_eq!(
        tok.decode(&ids, false).unwrap(),
        PASSAGE,
        "byte-level BPE round-trips text"
    );
    // A fixed shuffle of the same tokens: same unigram statistics, no order.
    let mut shuffled = ids.clone();
    let mut state = 12345u64;
    for i in (1..shuffled.len()).rev() {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        shuffled.swap(i, (state >> 33) as usize % (i + 1));
    }
    let (real, mixed) = (nll(&model, &ids), nll(&model, &shuffled));
    assert!(
        real < mixed - 1.0,
        "real text {real:.3} nats/token vs shuffled {mixed:.3}"
    );
}
