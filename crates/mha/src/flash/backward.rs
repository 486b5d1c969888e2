//! The backward pass of the fused attention kernel ([`super::flash_attn_cpu_train`]).
//!
//! With `S = scale·Q·Kᵀ`, `P = softmax(S)` (masked), `Z` the dropout factors and
//! `O = (P∘Z)·V`, the gradients given `dO` are
//!
//! ```text
//! dV = (P∘Z)ᵀ·dO        dP = (dO·Vᵀ)∘Z        D_i = Σ_j P_ij·dP_ij = dO_i·O_i
//! dS = P∘(dP - D)       dQ = scale·dS·K        dK = scale·dSᵀ·Q
//! ```
//!
//! `P` is recomputed from `S` and the forward pass's per-row log-sum-exp, one block of
//! `BR` queries × `BC` keys at a time. A task owns one key/value head of one sequence and
//! every query head that reads it, so `dQ`, `dK` and `dV` are each written by one task and
//! nothing is shared; tasks run on rayon's pool.

use candle_core::{bail, Layout, Result, Storage, Tensor};
use rayon::prelude::*;

use super::tiles::{FlashAttn, Rows, BC, BR};
use gpt_kernels::simd;

/// `(dq, dk, dv)` of the fused attention for the gradient `grad_out` of its output `out`.
pub(crate) fn backward(
    op: &FlashAttn,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    grad_out: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    if op.softcap.is_some() {
        candle_core::bail!("flash attention: soft-capped scores have no backward pass here")
    }
    let (b, h, tq, d) = q.dims4()?;
    let (_, h_kv, tk, dv) = v.dims4()?;
    let (dq, dk, dv_all) = gradients(op, q, k, v, out, grad_out)?;
    let dev = q.device();
    Ok((
        Tensor::from_vec(dq, (b, h, tq, d), dev)?,
        Tensor::from_vec(dk, (b, h_kv, tk, d), dev)?,
        Tensor::from_vec(dv_all, (b, h_kv, tk, dv), dev)?,
    ))
}

/// [`backward`]'s gradients as contiguous `[b, h, tq, d]`, `[b, h_kv, tk, d]` and
/// `[b, h_kv, tk, dv]` values.
pub(crate) fn gradients(
    op: &FlashAttn,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    grad_out: &Tensor,
) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
    let (b, h, tq, d) = q.dims4()?;
    let (_, h_kv, tk, _) = k.dims4()?;
    let dv = v.dim(3)?;
    let n_rep = h / h_kv;
    let lse = match op.lse.lock() {
        Ok(lse) if lse.len() == b * h * tq => lse.clone(),
        _ => bail!("flash_attn_cpu: backward without the forward pass's statistics"),
    };
    let grad_out = grad_out.contiguous()?;
    let mut dq_all = vec![0f32; b * h * tq * d];
    let mut dk_all = vec![0f32; b * h_kv * tk * d];
    let mut dv_all = vec![0f32; b * h_kv * tk * dv];
    if ![b, h, tq, tk].contains(&0) {
        let (sq, lq) = q.storage_and_layout();
        let (sk, lk) = k.storage_and_layout();
        let (sv, lv) = v.storage_and_layout();
        let (so, lo) = out.storage_and_layout();
        let (sg, lg) = grad_out.storage_and_layout();
        let ctx = Ctx {
            op,
            q: rows(&sq, lq, "q")?,
            k: rows(&sk, lk, "k")?,
            v: rows(&sv, lv, "v")?,
            o: rows(&so, lo, "output")?,
            g: rows(&sg, lg, "output gradient")?,
            lse: &lse,
            h,
            tq,
            tk,
            d,
            dv,
        };
        dq_all
            .par_chunks_mut(n_rep * tq * d)
            .zip(dk_all.par_chunks_mut(tk * d))
            .zip(dv_all.par_chunks_mut(tk * dv))
            .enumerate()
            .for_each_init(Scratch::new, |scratch, (task, ((dq, dk), dv))| {
                let (bi, g) = (task / h_kv, task % h_kv);
                for r in 0..n_rep {
                    let hi = g * n_rep + r;
                    let dq = &mut dq[r * tq * d..(r + 1) * tq * d];
                    for i0 in (0..tq).step_by(BR) {
                        ctx.block(bi, hi, g, i0, dq, dk, dv, scratch);
                    }
                }
            });
    }
    Ok((dq_all, dk_all, dv_all))
}

fn rows<'a>(s: &'a Storage, l: &Layout, name: &str) -> Result<Rows<'a>> {
    match s {
        Storage::Cpu(s) => Rows::new(s, l, name),
        _ => bail!("flash_attn_cpu: {name} is not on the CPU"),
    }
}

/// Everything a block needs, read-only and shared by the tasks.
struct Ctx<'a> {
    op: &'a FlashAttn,
    q: Rows<'a>,
    k: Rows<'a>,
    v: Rows<'a>,
    o: Rows<'a>,
    g: Rows<'a>,
    lse: &'a [f32],
    h: usize,
    tq: usize,
    tk: usize,
    d: usize,
    dv: usize,
}

/// Per-task buffers of one block: `P`, `dP` (then `dS`), `P∘Z`, and `D`.
struct Scratch {
    p: Vec<f32>,
    dp: Vec<f32>,
    pz: Vec<f32>,
    delta: Vec<f32>,
}

impl Scratch {
    fn new() -> Self {
        Self {
            p: vec![0.0; BR * BC],
            dp: vec![0.0; BR * BC],
            pz: vec![0.0; BR * BC],
            delta: vec![0.0; BR],
        }
    }
}

// A `gemm::gemm` call with `dst = beta·lhs·rhs (+ dst)`, each matrix as (pointer, column
// stride, row stride). All callers pass pointers into the storages or scratch buffers with
// the extents stated at the call.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm(
    (m, n, k): (usize, usize, usize),
    dst: (*mut f32, usize, usize),
    accumulate: bool,
    lhs: (*const f32, usize, usize),
    rhs: (*const f32, usize, usize),
    beta: f32,
) {
    gemm::gemm(
        m,
        n,
        k,
        dst.0,
        dst.1 as isize,
        dst.2 as isize,
        accumulate,
        lhs.0,
        lhs.1 as isize,
        lhs.2 as isize,
        rhs.0,
        rhs.1 as isize,
        rhs.2 as isize,
        if accumulate { 1.0 } else { 0.0 },
        beta,
        false,
        false,
        false,
        gemm::Parallelism::None,
    )
}

impl Ctx<'_> {
    /// Adds query rows `i0..i0+BR` of head `hi` (reading key/value head `g`) to `dq`
    /// (`[tq, d]` of this head) and `dk`, `dv` (`[tk, ·]` of head `g`).
    #[allow(clippy::too_many_arguments)]
    fn block(
        &self,
        bi: usize,
        hi: usize,
        g: usize,
        i0: usize,
        dq: &mut [f32],
        dk: &mut [f32],
        dv: &mut [f32],
        scratch: &mut Scratch,
    ) {
        let (d, dvw, tk) = (self.d, self.dv, self.tk);
        let rows = BR.min(self.tq - i0);
        let row0 = (bi * self.h + hi) * self.tq + i0;
        let lse = &self.lse[row0..row0 + rows];
        let (q, o, go) = (
            self.q.ptr(bi, hi, i0),
            self.o.ptr(bi, hi, i0),
            self.g.ptr(bi, hi, i0),
        );
        let (k, v) = (self.k.ptr(bi, g, 0), self.v.ptr(bi, g, 0));
        // D_r = dO_r · O_r
        for r in 0..rows {
            // SAFETY: rows `i0 + r < tq` of `dv` values, inside the storages.
            let (o_r, g_r) = unsafe {
                (
                    std::slice::from_raw_parts(o.add(r * self.o.st), dvw),
                    std::slice::from_raw_parts(go.add(r * self.g.st), dvw),
                )
            };
            scratch.delta[r] = simd::dot(g_r, o_r);
        }
        let vis = self.op.visibility(bi, tk, i0);
        let keys = vis.key_range(rows);
        for j0 in keys.clone().step_by(BC) {
            let bc = BC.min(keys.end - j0);
            let (p, dp, pz) = (
                &mut scratch.p[..rows * bc],
                &mut scratch.dp[..rows * bc],
                &mut scratch.pz[..rows * bc],
            );
            // SAFETY: key rows `j0 < tk` of head `g`, inside the storages.
            let (kj, vj) = unsafe { (k.add(j0 * self.k.st), v.add(j0 * self.v.st)) };
            // SAFETY (every gemm below): `rows` query rows from `i0` and `bc` key rows from
            // `j0` of the given widths lie inside the storages; the scratch buffers hold
            // `rows × bc`; `dq`, `dk`, `dv` hold `tq × d`, `tk × d`, `tk × dv`.
            unsafe {
                // S[rows, bc] = scale · Q·Kᵀ
                gemm(
                    (rows, bc, d),
                    (p.as_mut_ptr(), 1, bc),
                    false,
                    (q, 1, self.q.st),
                    (kj, self.k.st, 1),
                    self.op.scale,
                );
                // dP[rows, bc] = dO·Vᵀ
                gemm(
                    (rows, bc, dvw),
                    (dp.as_mut_ptr(), 1, bc),
                    false,
                    (go, 1, self.g.st),
                    (vj, self.v.st, 1),
                    1.0,
                );
            }
            for r in 0..rows {
                let row = &mut p[r * bc..(r + 1) * bc];
                vis.mask_row(row, r, j0);
                // P = exp(S - lse): hidden keys (-inf) and empty rows (lse = +inf) give 0.
                simd::exp_sub_sum(row, lse[r]);
                let dp_row = &mut dp[r * bc..(r + 1) * bc];
                if let Some(mask) = self.op.drop {
                    let first = (((bi * self.h + hi) * self.tq + i0 + r) * tk + j0) as u64;
                    let pz_row = &mut pz[r * bc..(r + 1) * bc];
                    for c in 0..bc {
                        let z = mask.factor(first + c as u64);
                        pz_row[c] = row[c] * z;
                        dp_row[c] *= z;
                    }
                }
                // dS = P∘(dP - D)
                simd::softmax_grad(row, dp_row, scratch.delta[r]);
            }
            let pz = if self.op.drop.is_some() { &*pz } else { &*p };
            unsafe {
                // dV[j0.., dv] += (P∘Z)ᵀ·dO
                gemm(
                    (bc, dvw, rows),
                    (dv.as_mut_ptr().add(j0 * dvw), 1, dvw),
                    true,
                    (pz.as_ptr(), bc, 1),
                    (go, 1, self.g.st),
                    1.0,
                );
                // dQ[i0.., d] += scale · dS·K
                gemm(
                    (rows, d, bc),
                    (dq.as_mut_ptr().add(i0 * d), 1, d),
                    true,
                    (dp.as_ptr(), 1, bc),
                    (kj, 1, self.k.st),
                    self.op.scale,
                );
                // dK[j0.., d] += scale · dSᵀ·Q
                gemm(
                    (bc, d, rows),
                    (dk.as_mut_ptr().add(j0 * d), 1, d),
                    true,
                    (dp.as_ptr(), bc, 1),
                    (q, 1, self.q.st),
                    self.op.scale,
                );
            }
        }
    }
}
