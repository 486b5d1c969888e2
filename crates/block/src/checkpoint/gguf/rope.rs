//! llama.cpp's rotary conventions: the order of a Llama's query and key rows (adjacent
//! pairs, where Hugging Face rotates halves), and Llama 3's frequency scaling stored as one
//! divisor per frequency.

use candle_core::quantized::{QStorage, QTensor};
use candle_core::{bail, Result, Tensor};
use mha::{RopeConfig, RopeScaling};

/// The inverse frequencies of `dim` rotated features, in f32 as transformers computes them.
pub(super) fn inv_freqs(theta: f64, dim: usize) -> Vec<f32> {
    (0..dim / 2)
        .map(|i| 1.0 / (theta as f32).powf((2 * i) as f32 / dim as f32))
        .collect()
}

/// Llama 3's scaling from the per-frequency divisors llama.cpp stores (`rope_freqs`):
/// `factor` is the lowest frequency's divisor, and the blend between the bands is linear in
/// `1/wavelength`, so two of its points fix it (with `high - low = 1`; one point or none
/// leave a range, and any value in it gives the same divisors). The result is checked
/// against every stored divisor; anything else is refused.
pub(super) fn llama3_from_factors(factors: &[f32], theta: f64, dim: usize) -> Result<RopeScaling> {
    let freqs = inv_freqs(theta, dim);
    let bad = || {
        candle_core::Error::Msg(
            "tensor rope_freqs.weight does not follow Llama 3's frequency scaling; other scalings are not supported".into(),
        )
    };
    let (Some(&factor), true) = (factors.last(), factors.len() == freqs.len()) else {
        return Err(bad());
    };
    if !(factor.is_finite() && factor >= 1.0) {
        return Err(bad());
    }
    let close = |a: f32, b: f32| (a - b).abs() <= 1e-5 * b.abs().max(1.0);
    if factors.iter().all(|&f| close(f, 1.0)) {
        return Ok(RopeScaling::None);
    }
    // (1 / wavelength, blend) of each frequency between the bands.
    let x = |i: usize| freqs[i] as f64 / (2.0 * std::f64::consts::PI);
    let blend = |f: f32| (1.0 / f as f64 - 1.0 / factor as f64) / (1.0 - 1.0 / factor as f64);
    let medium: Vec<usize> = (0..factors.len())
        .filter(|&i| !close(factors[i], 1.0) && !close(factors[i], factor))
        .collect();
    // blend = a / wavelength + b
    let (a, b) = match medium.as_slice() {
        [first, .., last] => {
            let (s0, s1) = (blend(factors[*first]), blend(factors[*last]));
            let a = (s1 - s0) / (x(*last) - x(*first));
            (a, s0 - a * x(*first))
        }
        [m] if *m > 0 && *m + 1 < factors.len() => {
            let s = blend(factors[*m]);
            let a = ((1.0 - s) / (x(m - 1) - x(*m))).max(s / (x(*m) - x(m + 1)));
            (a, s - a * x(*m))
        }
        [] => match (1..factors.len()).find(|&k| !close(factors[k], 1.0)) {
            Some(k) => {
                let a = 1.0 / (x(k - 1) - x(k));
                (a, -a * x(k))
            }
            None => return Err(bad()),
        },
        _ => return Err(bad()),
    };
    let scaling = RopeScaling::Llama3 {
        factor: factor as f64,
        low_freq_factor: -b,
        high_freq_factor: 1.0 - b,
        original_max_position_embeddings: a,
    };
    let ok = RopeConfig {
        scaling: scaling.clone(),
        ..Default::default()
    }
    .validate(2)
    .is_ok()
        && freqs
            .iter()
            .zip(factors)
            .all(|(&f, &div)| close(scaling.apply(f) * div / f, 1.0));
    match ok {
        true => Ok(scaling),
        false => Err(bad()),
    }
}

/// The order of the rows of `[heads·hd, ..]` q/k weights between Hugging Face's rotary
/// layout (halves) and llama.cpp's (adjacent pairs): output row `r` is input row
/// `order[r]`. llama.cpp's converter writes row `(j, i)` of each `[2, hd/2]` head at
/// `2·i + j`; `to_llama` goes that way, else back.
pub(super) fn rotary_order(rows: usize, heads: usize, to_llama: bool) -> Result<Vec<usize>> {
    let hd = rows / heads.max(1);
    if heads == 0 || !rows.is_multiple_of(heads) || !hd.is_multiple_of(2) {
        bail!("{rows} rows cannot be split into {heads} rotary heads")
    }
    Ok((0..rows)
        .map(|r| {
            let (h, p) = (r / hd, r % hd);
            h * hd
                + match to_llama {
                    true => (p % 2) * (hd / 2) + p / 2,
                    false => 2 * (p % (hd / 2)) + p / (hd / 2),
                }
        })
        .collect())
}

/// Rows of a dense tensor in `order`.
pub(super) fn select_rows(t: &Tensor, order: &[usize]) -> Result<Tensor> {
    let idx: Vec<u32> = order.iter().map(|&r| r as u32).collect();
    t.index_select(&Tensor::new(idx, t.device())?, 0)
}

/// Reorders the rows of an `[heads·hd, in]` matrix (any format: rows are whole blocks)
/// from llama.cpp's rotary layout back to Hugging Face's.
pub(super) fn rotary_rows(w: &QTensor, heads: usize) -> Result<QTensor> {
    let (rows, cols) = w.shape().dims2()?;
    let order = rotary_order(rows, heads, false)?;
    let row_bytes = cols / w.dtype().block_size() * w.dtype().type_size();
    let data = w.data()?;
    let mut out = Vec::with_capacity(data.len());
    for src in order {
        out.extend_from_slice(&data[src * row_bytes..(src + 1) * row_bytes]);
    }
    let storage = QStorage::from_data(std::borrow::Cow::Owned(out), &w.device(), w.dtype())?;
    QTensor::new(storage, (rows, cols))
}
