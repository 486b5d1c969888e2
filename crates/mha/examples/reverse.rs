//! A small encoder-decoder transformer built from `mha`, trained to reverse sequences of
//! digits: bidirectional self-attention in the encoder, causal self-attention and
//! cross-attention in the decoder, AdamW, and greedy decoding with a KV cache.
//!
//! `cargo run --release -p mha --example reverse`

use anyhow::Result;
use candle_core::{DType, Device, Tensor, D};
use candle_nn::{ops, Embedding, Module, Optimizer, VarBuilder, VarMap};
use mha::{KvCache, Mask, MhaConfig, MultiHeadAttention};

const DIGITS: usize = 10;
const BOS: u32 = DIGITS as u32;
const VOCAB: usize = DIGITS + 1;
const LEN: usize = 8;
const D_MODEL: usize = 64;
const HEADS: usize = 4;

/// LayerNorm from plain ops: Candle's fused `layer_norm` has no backward pass.
struct Norm {
    w: Tensor,
    b: Tensor,
}

impl Norm {
    fn new(vb: VarBuilder) -> Result<Self> {
        let w = vb.get_with_hints(D_MODEL, "weight", candle_nn::Init::Const(1.0))?;
        let b = vb.get_with_hints(D_MODEL, "bias", candle_nn::Init::Const(0.0))?;
        Ok(Self { w, b })
    }
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        Ok(ops::layer_norm_slow(xs, &self.w, &self.b, 1e-5)?)
    }
}

struct Mlp(candle_nn::Linear, candle_nn::Linear);

impl Mlp {
    fn new(vb: VarBuilder) -> Result<Self> {
        Ok(Self(
            candle_nn::linear(D_MODEL, 4 * D_MODEL, vb.pp("fc"))?,
            candle_nn::linear(4 * D_MODEL, D_MODEL, vb.pp("proj"))?,
        ))
    }
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        Ok(self.1.forward(&self.0.forward(xs)?.relu()?)?)
    }
}

struct Seq2Seq {
    tok: Embedding,
    pos: Embedding,
    enc_norm: [Norm; 2],
    enc_attn: MultiHeadAttention,
    enc_mlp: Mlp,
    dec_norm: [Norm; 4],
    dec_self: MultiHeadAttention,
    dec_cross: MultiHeadAttention,
    dec_mlp: Mlp,
    head: candle_nn::Linear,
}

impl Seq2Seq {
    fn new(vb: VarBuilder) -> Result<Self> {
        let cfg = MhaConfig {
            dropout: 0.1,
            seed: 1,
            ..MhaConfig::new(D_MODEL, HEADS)
        };
        let norm = |p: &str, i: usize| Norm::new(vb.pp(format!("{p}.{i}")));
        Ok(Self {
            tok: candle_nn::embedding(VOCAB, D_MODEL, vb.pp("tok"))?,
            pos: candle_nn::embedding(LEN, D_MODEL, vb.pp("pos"))?,
            enc_norm: [norm("enc_norm", 0)?, norm("enc_norm", 1)?],
            enc_attn: MultiHeadAttention::new(&cfg, vb.pp("enc_attn"))?,
            enc_mlp: Mlp::new(vb.pp("enc_mlp"))?,
            dec_norm: [
                norm("dec_norm", 0)?,
                norm("dec_norm", 1)?,
                norm("dec_norm", 2)?,
                norm("dec_norm", 3)?,
            ],
            dec_self: MultiHeadAttention::new(
                &MhaConfig {
                    seed: 2,
                    ..cfg.clone()
                },
                vb.pp("dec_self"),
            )?,
            dec_cross: MultiHeadAttention::new(
                &MhaConfig {
                    seed: 3,
                    ..cfg.clone()
                },
                vb.pp("dec_cross"),
            )?,
            dec_mlp: Mlp::new(vb.pp("dec_mlp"))?,
            head: candle_nn::linear(D_MODEL, VOCAB, vb.pp("head"))?,
        })
    }

    /// Token + position embeddings of `ids [b, t]` placed at positions `start..start + t`.
    fn embed(&self, ids: &Tensor, start: usize) -> Result<Tensor> {
        let t = ids.dim(1)?;
        let pos = Tensor::arange(start as u32, (start + t) as u32, ids.device())?;
        Ok(self
            .tok
            .forward(ids)?
            .broadcast_add(&self.pos.forward(&pos)?)?)
    }

    /// `src [b, LEN]` to the encoder's memory `[b, LEN, D_MODEL]`.
    fn encode(&self, src: &Tensor, train: bool) -> Result<Tensor> {
        let xs = self.embed(src, 0)?;
        let h = self.enc_norm[0].forward(&xs)?;
        let xs = (&xs + self.enc_attn.forward(&h, &h, &h, &Mask::NONE, train)?)?;
        let h = self.enc_norm[1].forward(&xs)?;
        Ok((&xs + self.enc_mlp.forward(&h)?)?)
    }

    /// Decoder logits `[b, t, VOCAB]` for inputs `tgt [b, t]` at positions `start..`; with a
    /// cache, the self-attention keys of earlier positions come from it.
    fn decode(
        &self,
        tgt: &Tensor,
        memory: &Tensor,
        start: usize,
        cache: Option<&mut KvCache>,
        train: bool,
    ) -> Result<Tensor> {
        let ys = self.embed(tgt, start)?;
        let h = self.dec_norm[0].forward(&ys)?;
        let attn = match cache {
            Some(cache) => self
                .dec_self
                .forward_cached(&h, &h, &h, &Mask::causal(start), cache)?,
            None => self
                .dec_self
                .forward(&h, &h, &h, &Mask::causal(start), train)?,
        };
        let ys = (&ys + attn)?;
        let h = self.dec_norm[1].forward(&ys)?;
        let ys = (&ys
            + self
                .dec_cross
                .forward(&h, memory, memory, &Mask::NONE, train)?)?;
        let h = self.dec_norm[2].forward(&ys)?;
        let ys = (&ys + self.dec_mlp.forward(&h)?)?;
        Ok(self.head.forward(&self.dec_norm[3].forward(&ys)?)?)
    }

    /// Greedy decoding, one token at a time through a KV cache.
    fn reverse(&self, src: &Tensor) -> Result<Tensor> {
        let b = src.dim(0)?;
        let memory = self.encode(src, false)?;
        let mut cache = KvCache::new(LEN);
        let mut next = Tensor::full(BOS, (b, 1), src.device())?;
        let mut out = Vec::with_capacity(LEN);
        for t in 0..LEN {
            let logits = self.decode(&next, &memory, t, Some(&mut cache), false)?;
            next = logits.argmax(D::Minus1)?;
            out.push(next.clone());
        }
        Ok(Tensor::cat(&out, 1)?)
    }
}

/// A batch of random digit sequences and their reversals.
fn batch(rng: &mut u64, b: usize, dev: &Device) -> Result<(Tensor, Tensor)> {
    let mut src = Vec::with_capacity(b * LEN);
    for _ in 0..b * LEN {
        // xorshift64: enough randomness for a toy task, and no extra dependency.
        *rng ^= *rng << 13;
        *rng ^= *rng >> 7;
        *rng ^= *rng << 17;
        src.push((*rng % DIGITS as u64) as u32);
    }
    let src = Tensor::from_vec(src, (b, LEN), dev)?;
    let tgt = src.flip(&[1])?;
    Ok((src, tgt))
}

fn main() -> Result<()> {
    let dev = Device::Cpu;
    let varmap = VarMap::new();
    let model = Seq2Seq::new(VarBuilder::from_varmap(&varmap, DType::F32, &dev))?;
    let mut opt = candle_nn::AdamW::new(
        varmap.all_vars(),
        candle_nn::ParamsAdamW {
            lr: 2e-3,
            weight_decay: 0.01,
            ..Default::default()
        },
    )?;
    let mut rng = 0x2545_F491_4F6C_DD1Du64;
    let mut held_out_rng = 0x9E37_79B9_7F4A_7C15u64;
    let (test_src, test_tgt) = batch(&mut held_out_rng, 512, &dev)?;
    let started = std::time::Instant::now();
    for step in 1..=1500 {
        let (src, tgt) = batch(&mut rng, 64, &dev)?;
        // Teacher forcing: the decoder reads BOS + target[..LEN-1].
        let bos = Tensor::full(BOS, (64, 1), &dev)?;
        let dec_in = Tensor::cat(&[&bos, &tgt.narrow(1, 0, LEN - 1)?], 1)?;
        let memory = model.encode(&src, true)?;
        let logits = model.decode(&dec_in, &memory, 0, None, true)?;
        let loss = candle_nn::loss::cross_entropy(
            &logits.reshape((64 * LEN, VOCAB))?,
            &tgt.flatten_all()?,
        )?;
        opt.backward_step(&loss)?;
        if step % 20 == 0 {
            let pred = model.reverse(&test_src)?;
            let right = pred.eq(&test_tgt)?.to_dtype(DType::F32)?;
            let token_acc = right.mean_all()?.to_scalar::<f32>()?;
            let seq_acc = right.min(1)?.mean_all()?.to_scalar::<f32>()?;
            println!(
                "step {step:4}  loss {:.4}  held-out accuracy: tokens {:5.1}%  sequences {:5.1}%  ({:.1}s)",
                loss.to_scalar::<f32>()?,
                100.0 * token_acc,
                100.0 * seq_acc,
                started.elapsed().as_secs_f32()
            );
            if seq_acc >= 0.99 {
                break;
            }
        }
    }
    let (src, _) = batch(&mut held_out_rng, 3, &dev)?;
    let pred = model.reverse(&src)?;
    for (s, p) in src.to_vec2::<u32>()?.iter().zip(pred.to_vec2::<u32>()?) {
        println!("{s:?} -> {p:?}");
    }
    Ok(())
}
