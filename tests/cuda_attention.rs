//! mha's CUDA attention kernel (`crates/mha/kernels/attention.cu`), compiled for the CPU with
//! the CUDA built-ins emulated (`tests/support/cuda_emulation.cpp`: one system thread per
//! CUDA thread, a barrier for `__syncthreads`), against mha's reference attention
//! (`sdpa_reference_softcapped`: scores materialised, masked, soft-maxed; itself held to
//! PyTorch by mha's tests). Every head dimension the kernel has an instance for, grouped-
//! query heads, cached prefixes, windows, soft caps, strided views, half-precision keys and
//! values, queries that see no key, and shapes that leave blocks and tiles part-filled;
//! for both kernels: a thread per query (prefills) and a block per query (decoding, over
//! caches longer than one pass of its scores).
//! What this cannot show (the PTX compiler's work, the launch from Rust, the speed) is
//! checked on a GPU by `scripts/gpu_check.sh`.

use candle_core::{DType, Device, Tensor};
use gpt_workspace::cuda_emulation::mha_attention_emulated;
use mha::{sdpa_reference, sdpa_reference_softcapped, Mask, SdpaParams};

/// Deterministic values in [-1, 1) (no random generator to seed).
fn values(n: usize, seed: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let x = ((i * 2654435761 + seed * 40503) % 1_000_003) as f32;
            2.0 * (x / 1_000_003.0) - 1.0
        })
        .collect()
}

struct Case {
    b: usize,
    h: usize,
    h_kv: usize,
    tq: usize,
    tk: usize,
    d: usize,
    causal: Option<usize>,
    window: Option<usize>,
    softcap: Option<f64>,
    /// q laid out `[b, tq, h, d]` and viewed as `[b, h, tq, d]` (a projection's output).
    strided: bool,
    /// 0 f32, 1 f32 queries with f16 keys/values, 2 the same with bf16, 3 f16, 4 bf16.
    kind: i32,
    /// The block-per-query kernel (decoding's) instead of the thread-per-query one.
    decode: bool,
    /// One key (of every batch row and head) scaled by 1000: its scores dwarf the rest,
    /// and their exponentials overflow unless the softmax subtracts the true maximum.
    spike: Option<usize>,
}

impl Case {
    fn new(d: usize) -> Self {
        Case {
            b: 2,
            h: 4,
            h_kv: 2,
            tq: 70,
            tk: 75,
            d,
            causal: Some(5),
            window: None,
            softcap: None,
            strided: false,
            kind: 0,
            decode: false,
            spike: None,
        }
    }
}

/// The kernel's output `[b, h, tq, d]` as f32, and the reference's.
fn run(c: &Case) -> (Vec<f32>, Vec<f32>) {
    let dev = Device::Cpu;
    let (q_dtype, kv_dtype) = match c.kind {
        0 => (DType::F32, DType::F32),
        1 => (DType::F32, DType::F16),
        2 => (DType::F32, DType::BF16),
        3 => (DType::F16, DType::F16),
        _ => (DType::BF16, DType::BF16),
    };
    let q = match c.strided {
        true => Tensor::from_vec(
            values(c.b * c.tq * c.h * c.d, 1),
            (c.b, c.tq, c.h, c.d),
            &dev,
        )
        .unwrap()
        .transpose(1, 2)
        .unwrap(),
        false => Tensor::from_vec(
            values(c.b * c.h * c.tq * c.d, 1),
            (c.b, c.h, c.tq, c.d),
            &dev,
        )
        .unwrap(),
    };
    let kv_shape = (c.b, c.h_kv, c.tk, c.d);
    let mut kv = values(c.b * c.h_kv * c.tk * c.d, 2);
    if let Some(j) = c.spike {
        for row in kv.chunks_mut(c.d).skip(j).step_by(c.tk) {
            row.iter_mut().for_each(|x| *x *= 1000.0);
        }
    }
    let k = Tensor::from_vec(kv, kv_shape, &dev).unwrap();
    let v = Tensor::from_vec(values(c.b * c.h_kv * c.tk * c.d, 3), kv_shape, &dev).unwrap();
    let (q, k, v) = (
        q.to_dtype(q_dtype).unwrap(),
        k.to_dtype(kv_dtype).unwrap(),
        v.to_dtype(kv_dtype).unwrap(),
    );
    let scale = 1.0 / (c.d as f64).sqrt();
    let mask = Mask {
        causal: c.causal,
        window: c.window,
        ..Mask::NONE
    };
    let params = SdpaParams::inference(scale);
    let want = match c.softcap {
        Some(cap) => sdpa_reference_softcapped(&q, &k, &v, &mask, &params, cap),
        None => sdpa_reference(&q, &k, &v, &mask, &params),
    };
    let want = want.unwrap().0;
    let want = want
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();

    // The kernel reads the tensors' storage as laid out, with their strides.
    let bits = |t: &Tensor| -> Vec<u16> {
        match t.dtype() {
            DType::F16 => t
                .flatten_all()
                .unwrap()
                .to_vec1::<half::f16>()
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect(),
            _ => t
                .flatten_all()
                .unwrap()
                .to_vec1::<half::bf16>()
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect(),
        }
    };
    // q's storage in its own layout (transposed back for a strided view), its strides.
    let (q_store, q_strides) = match c.strided {
        true => (
            q.transpose(1, 2).unwrap().contiguous().unwrap(),
            [c.tq * c.h * c.d, c.d, c.h * c.d],
        ),
        false => (q.clone(), [c.h * c.tq * c.d, c.tq * c.d, c.d]),
    };
    let kv_strides = [c.h_kv * c.tk * c.d, c.tk * c.d, c.d];
    let strides: Vec<i64> = q_strides
        .iter()
        .chain(&kv_strides)
        .chain(&kv_strides)
        .map(|&s| s as i64)
        .collect();
    let n_out = c.b * c.h * c.tq * c.d;
    let (qf, kf, vf) = (
        q_store.flatten_all().unwrap(),
        k.flatten_all().unwrap(),
        v.flatten_all().unwrap(),
    );
    let (q32, k32, v32);
    let (q16, k16, v16);
    let (qp, kp, vp): (*const std::ffi::c_void, _, _) = match (q_dtype, kv_dtype) {
        (DType::F32, DType::F32) => {
            (q32, k32, v32) = (
                qf.to_vec1::<f32>().unwrap(),
                kf.to_vec1::<f32>().unwrap(),
                vf.to_vec1::<f32>().unwrap(),
            );
            (
                q32.as_ptr().cast(),
                k32.as_ptr().cast(),
                v32.as_ptr().cast(),
            )
        }
        (DType::F32, _) => {
            q32 = qf.to_vec1::<f32>().unwrap();
            (k16, v16) = (bits(&k), bits(&v));
            (
                q32.as_ptr().cast(),
                k16.as_ptr().cast(),
                v16.as_ptr().cast(),
            )
        }
        _ => {
            (q16, k16, v16) = (bits(&q_store), bits(&k), bits(&v));
            (
                q16.as_ptr().cast(),
                k16.as_ptr().cast(),
                v16.as_ptr().cast(),
            )
        }
    };
    let mut out32 = vec![0f32; n_out];
    let mut out16 = vec![0u16; n_out];
    let out: *mut std::ffi::c_void = match q_dtype {
        DType::F32 => out32.as_mut_ptr().cast(),
        _ => out16.as_mut_ptr().cast(),
    };
    // SAFETY: every pointer holds the elements its strides and shapes reach (dense tensors
    // of these shapes); `out` holds b·h·tq·d elements of the queries' type.
    let rc = unsafe {
        mha_attention_emulated(
            c.kind,
            c.decode as i32,
            c.d as i32,
            qp,
            kp,
            vp,
            out,
            c.b as i32,
            c.h as i32,
            c.h_kv as i32,
            c.tq as i32,
            c.tk as i32,
            strides.as_ptr(),
            c.causal.is_some() as i32,
            c.causal.unwrap_or(0) as i32,
            c.window.unwrap_or(0) as i32,
            scale as f32,
            c.softcap.unwrap_or(0.0) as f32,
        )
    };
    assert_eq!(
        rc, 0,
        "no kernel instance for kind {} and d {}",
        c.kind, c.d
    );
    let got = match q_dtype {
        DType::F32 => out32,
        DType::F16 => out16
            .iter()
            .map(|&b| half::f16::from_bits(b).to_f32())
            .collect(),
        _ => out16
            .iter()
            .map(|&b| half::bf16::from_bits(b).to_f32())
            .collect(),
    };
    (got, want)
}

/// `|got - want| <= atol + rtol·|want|` everywhere; the largest difference and where.
fn check(c: &Case, atol: f32, rtol: f32) {
    let (got, want) = run(c);
    assert_eq!(got.len(), want.len());
    let (mut worst, mut at) = (0f32, 0);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        let excess = (g - w).abs() - (atol + rtol * w.abs());
        if excess > worst || g.is_nan() {
            (worst, at) = (excess.max(f32::MIN_POSITIVE), i);
        }
    }
    assert!(
        worst <= 0.0,
        "d {} kind {} decode {} spike {:?} causal {:?} window {:?} softcap {:?}: element {at} is {} where the reference gives {}",
        c.d, c.kind, c.decode, c.spike, c.causal, c.window, c.softcap, got[at], want[at]
    );
}

#[test]
fn every_head_dimension_matches_the_reference() {
    for d in [8, 16, 32, 64, 80, 96, 128, 256] {
        check(&Case::new(d), 1e-5, 1e-4);
    }
}

#[test]
fn windows_soft_caps_and_no_mask_match_the_reference() {
    check(
        &Case {
            window: Some(17),
            ..Case::new(64)
        },
        1e-5,
        1e-4,
    );
    check(
        &Case {
            window: Some(1),
            ..Case::new(128)
        },
        1e-5,
        1e-4,
    );
    check(
        &Case {
            softcap: Some(0.5),
            window: Some(40),
            ..Case::new(96)
        },
        1e-5,
        1e-4,
    );
    check(
        &Case {
            causal: None,
            ..Case::new(64)
        },
        1e-5,
        1e-4,
    );
    check(
        &Case {
            causal: None,
            softcap: Some(2.0),
            h_kv: 1,
            ..Case::new(80)
        },
        1e-5,
        1e-4,
    );
    // One query, a long cache (a decoding step): one block, most threads idle.
    check(
        &Case {
            tq: 1,
            tk: 300,
            causal: Some(299),
            ..Case::new(128)
        },
        1e-5,
        1e-4,
    );
}

#[test]
fn queries_that_see_no_key_give_zeros() {
    // 10 keys, queries from position 20 on (read as 10 on, an offset past the keys being
    // clamped to them) with a window of 3: queries 2.. (positions 12..) see no key, and
    // give zeros as the reference's fully masked rows do.
    let c = Case {
        tq: 6,
        tk: 10,
        causal: Some(20),
        window: Some(3),
        ..Case::new(64)
    };
    let (got, want) = run(&c);
    for (i, (g, w)) in got.chunks(c.d).zip(want.chunks(c.d)).enumerate() {
        let blind = i % c.tq >= 2; // query i % tq of its batch row and head
        assert_eq!(w.iter().all(|&x| x == 0.0), blind, "reference row {i}");
        assert_eq!(g.iter().all(|&x| x == 0.0), blind, "kernel row {i}");
    }
    check(&c, 1e-5, 1e-4);
    check(
        &Case {
            tq: 30,
            tk: 12,
            causal: Some(0),
            window: Some(4),
            ..Case::new(64)
        },
        1e-5,
        1e-4,
    );
}

#[test]
fn strided_queries_and_half_precision_match_the_reference() {
    check(
        &Case {
            strided: true,
            ..Case::new(64)
        },
        1e-5,
        1e-4,
    );
    // Half-precision keys and values beside f32 queries: the reference widens them too.
    check(
        &Case {
            kind: 1,
            ..Case::new(128)
        },
        1e-5,
        1e-4,
    );
    check(
        &Case {
            kind: 2,
            window: Some(9),
            ..Case::new(64)
        },
        1e-5,
        1e-4,
    );
    // All in half precision: the reference multiplies the weights by v in that precision,
    // the kernel sums in f32 and rounds once.
    check(
        &Case {
            kind: 3,
            ..Case::new(64)
        },
        2e-3,
        1e-2,
    );
    check(
        &Case {
            kind: 4,
            strided: true,
            ..Case::new(96)
        },
        2e-2,
        2e-2,
    );
}

/// Decoding's kernel: a few queries over caches longer than its pass of 2,048 scores.
fn decode(tq: usize, tk: usize, d: usize) -> Case {
    Case {
        tq,
        tk,
        causal: Some(tk - tq),
        decode: true,
        ..Case::new(d)
    }
}

#[test]
fn the_decoding_kernel_matches_the_reference() {
    for d in [8, 16, 32, 64, 80, 96, 128, 256] {
        check(&decode(1, 300, d), 1e-5, 1e-4);
    }
    check(&decode(3, 5000, 64), 1e-5, 1e-4);
    check(
        &Case {
            window: Some(2100),
            ..decode(2, 4500, 32)
        },
        1e-5,
        1e-4,
    );
    check(
        &Case {
            softcap: Some(0.5),
            h_kv: 1,
            ..decode(1, 70, 128)
        },
        1e-5,
        1e-4,
    );
    check(
        &Case {
            causal: None,
            ..decode(4, 90, 64)
        },
        1e-5,
        1e-4,
    );
    check(
        &Case {
            strided: true,
            kind: 1,
            ..decode(2, 150, 64)
        },
        1e-5,
        1e-4,
    );
    check(
        &Case {
            kind: 4,
            ..decode(1, 2500, 96)
        },
        2e-2,
        2e-2,
    );
    // Queries that see no key (positions past the keys, a short window): zeros.
    let c = Case {
        tq: 6,
        tk: 10,
        causal: Some(20),
        window: Some(3),
        decode: true,
        ..Case::new(64)
    };
    let (got, want) = run(&c);
    for (i, (g, w)) in got.chunks(c.d).zip(want.chunks(c.d)).enumerate() {
        let blind = i % c.tq >= 2;
        assert_eq!(w.iter().all(|&x| x == 0.0), blind, "reference row {i}");
        assert_eq!(g.iter().all(|&x| x == 0.0), blind, "kernel row {i}");
    }
}

#[test]
fn scores_in_the_thousands_match_the_reference() {
    // One key's scores dwarf the rest: exp overflows unless the running maximum is the
    // true one, in both kernels (in the decoding one, a key of the second pass over the
    // keys, summed by the upper half of the block's threads).
    check(
        &Case {
            spike: Some(40),
            ..Case::new(32)
        },
        1e-5,
        1e-4,
    );
    check(
        &Case {
            spike: Some(2240),
            ..decode(2, 4500, 64)
        },
        1e-5,
        1e-4,
    );
}
