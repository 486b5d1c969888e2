//! The blocked forward pass (and its backward, through [`super::backward`]) as a Candle op
//! over q, k and v: blocks of `BR` query rows against blocks of `BC` keys, an online
//! softmax, the log-sum-exp of each row saved for the backward pass; few query rows per
//! head (decoding) go to [`super::decode`].

use candle_core::{bail, CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};
use gpt_kernels::simd;
use rayon::prelude::*;

use super::decode;
use super::tiles::{soft_cap, FlashAttn, KvPtr, KvRows, Rows, Visibility, BC, BR, DIRECT_ROWS};
use crate::dropout::DropMask;

impl CustomOp3 for FlashAttn {
    fn name(&self) -> &'static str {
        "flash-attn-cpu"
    }

    fn cpu_fwd(
        &self,
        sq: &CpuStorage,
        lq: &Layout,
        sk: &CpuStorage,
        lk: &Layout,
        sv: &CpuStorage,
        lv: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (b, h, tq, d) = lq.shape().dims4()?;
        let (bk, h_kv, tk, dk) = lk.shape().dims4()?;
        let (bv, hv, tv, dv) = lv.shape().dims4()?;
        if bk != b || bv != b || hv != h_kv || tv != tk || dk != d || h_kv == 0 || h % h_kv != 0 {
            bail!(
                "flash_attn_cpu: q {:?}, k {:?} and v {:?} do not fit [b, h, tq, d], [b, h_kv, tk, d], [b, h_kv, tk, dv] with h a multiple of h_kv",
                lq.dims(),
                lk.dims(),
                lv.dims()
            )
        }
        let (q, k, v) = (
            Rows::new(sq, lq, "q")?,
            KvRows::new(sk, lk, "k")?,
            KvRows::new(sv, lv, "v")?,
        );
        if (k.is_half() || v.is_half()) && self.drop.is_some() {
            bail!("flash_attn_cpu: half-precision keys and values are for inference")
        }
        if let Some(keep) = &self.keep {
            if keep.len() != b * tk {
                bail!(
                    "flash_attn_cpu: key padding has {} entries, expected {}",
                    keep.len(),
                    b * tk
                )
            }
        }
        let n_rep = h / h_kv;
        let mut out = vec![0f32; b * h * tq * dv];
        let mut lse = vec![f32::INFINITY; b * h * tq];
        if out.is_empty() {
            return Ok((CpuStorage::F32(out), Shape::from((b, h, tq, dv))));
        }
        if tq <= DIRECT_ROWS && self.drop.is_none() {
            let dims = decode::Dims {
                b,
                h,
                h_kv,
                tq,
                tk,
                d,
                dv,
            };
            decode::run(self, q, k, v, dims, &mut out, &mut lse);
            if let Ok(mut slot) = self.lse.lock() {
                *slot = lse;
            }
            return Ok((CpuStorage::F32(out), Shape::from((b, h, tq, dv))));
        }
        // Scratch sized by what the blocks use: scores for up to BR rows, and a block of
        // widened keys and values where they are half precision. Each head of each step
        // allocates and zeroes it.
        let half = |kv: &KvRows, width: usize| match kv.is_half() {
            true => BC * width,
            false => 0,
        };
        let (k_buf, v_buf) = (half(&k, d), half(&v, dv));
        let score_rows = tq.min(BR);
        out.par_chunks_mut(tq * dv)
            .zip(lse.par_chunks_mut(tq))
            .enumerate()
            .for_each(|(bh, (out_head, lse_head))| {
                let (bi, hi) = (bh / h, bh % h);
                let hk = hi / n_rep;
                out_head
                    .par_chunks_mut(BR * dv)
                    .zip(lse_head.par_chunks_mut(BR))
                    .enumerate()
                    .for_each_init(
                        || Scratch {
                            scores: vec![0f32; score_rows * BC],
                            k: vec![0f32; k_buf],
                            v: vec![0f32; v_buf],
                        },
                        |scratch, (blk, (out_blk, lse_blk))| {
                            let i0 = blk * BR;
                            let block = Block {
                                q: q.ptr(bi, hi, i0),
                                q_st: q.st,
                                k: k.ptr(bi, hk, 0),
                                k_st: k.st(),
                                v: v.ptr(bi, hk, 0),
                                v_st: v.st(),
                                rows: lse_blk.len(),
                                d,
                                dv,
                                vis: self.visibility(bi, tk, i0),
                                drop: self.drop.map(|m| (m, ((bh * tq + i0) * tk) as u64)),
                                scale: self.scale,
                                softcap: self.softcap,
                            };
                            block.run(out_blk, lse_blk, scratch);
                        },
                    );
            });
        if let Ok(mut slot) = self.lse.lock() {
            *slot = lse;
        }
        Ok((CpuStorage::F32(out), Shape::from((b, h, tq, dv))))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        grad_out: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dq, dk, dv) = super::backward::backward(self, q, k, v, out, grad_out)?;
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

/// A task's scratch: a block of scores, and widened keys and values (half precision).
struct Scratch {
    scores: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
}

/// One block of query rows of one head.
struct Block<'a> {
    q: *const f32,
    q_st: usize,
    k: KvPtr,
    k_st: usize,
    v: KvPtr,
    v_st: usize,
    rows: usize,
    d: usize,
    dv: usize,
    vis: Visibility<'a>,
    /// The dropout mask and the index of the block's element `(0, 0)` in it.
    drop: Option<(DropMask, u64)>,
    scale: f32,
    softcap: Option<f32>,
}

impl Block<'_> {
    /// Writes the block's `[rows, dv]` output into `out` and each row's log-sum-exp into
    /// `lse`.
    fn run(&self, out: &mut [f32], lse: &mut [f32], scratch: &mut Scratch) {
        let Scratch {
            scores,
            k: k_buf,
            v: v_buf,
        } = scratch;
        let rows = self.rows;
        let mut m = [f32::NEG_INFINITY; BR];
        let mut l = [0f32; BR];
        out.fill(0.0);
        let keys = self.vis.key_range(rows);
        for j0 in keys.clone().step_by(BC) {
            let bc = BC.min(keys.end - j0);
            let s = &mut scores[..rows * bc];
            // SAFETY: key rows j0..j0 + bc lie in the storage (see `Rows::ptr`).
            let (k, k_st) = unsafe { self.k.rows(j0, bc, self.k_st, self.d, k_buf) };
            // S[rows, bc] = scale · Q[rows, d] · K[j0.., d]ᵀ
            // SAFETY: the pointers address `rows` query rows and `bc` key rows of length
            // `d` with the given strides, all inside the storages (see `Rows::ptr`) or the
            // scratch.
            unsafe {
                gemm::gemm(
                    rows,
                    bc,
                    self.d,
                    s.as_mut_ptr(),
                    1,
                    bc as isize,
                    false,
                    self.q,
                    1,
                    self.q_st as isize,
                    k,
                    k_st as isize,
                    1,
                    0.0,
                    self.scale,
                    false,
                    false,
                    false,
                    gemm::Parallelism::None,
                );
            }
            for r in 0..rows {
                let row = &mut s[r * bc..(r + 1) * bc];
                soft_cap(row, self.softcap);
                let visible = self.vis.mask_row(row, r, j0);
                let row_max = simd::max(&row[..visible]);
                let m_new = m[r].max(row_max);
                if m_new == f32::NEG_INFINITY {
                    // Nothing visible yet: this block contributes nothing to the row.
                    row.fill(0.0);
                    continue;
                }
                let corr = (m[r] - m_new).exp();
                // Hidden keys hold -inf and become exactly 0.
                let sum = simd::exp_sub_sum(row, m_new);
                l[r] = l[r] * corr + sum;
                m[r] = m_new;
                if corr != 1.0 {
                    simd::scale(&mut out[r * self.dv..(r + 1) * self.dv], corr);
                }
                // Dropout acts on the normalised weights; the sum above is before it.
                if let Some((mask, base)) = self.drop {
                    let first = base + (r * self.vis.tk + j0) as u64;
                    for (c, x) in row[..visible].iter_mut().enumerate() {
                        *x *= mask.factor(first + c as u64);
                    }
                }
            }
            // SAFETY: value rows j0..j0 + bc lie in the storage.
            let (v, v_st) = unsafe { self.v.rows(j0, bc, self.v_st, self.dv, v_buf) };
            // O[rows, dv] += P[rows, bc] · V[j0.., dv]
            // SAFETY: as above, for `bc` value rows of length `dv`.
            unsafe {
                gemm::gemm(
                    rows,
                    self.dv,
                    bc,
                    out.as_mut_ptr(),
                    1,
                    self.dv as isize,
                    true,
                    s.as_ptr(),
                    1,
                    bc as isize,
                    v,
                    1,
                    v_st as isize,
                    1.0,
                    1.0,
                    false,
                    false,
                    false,
                    gemm::Parallelism::None,
                );
            }
        }
        for r in 0..rows {
            // A row that saw no key keeps its zeros, and its weights are all 0.
            let (inv, row_lse) = if l[r] > 0.0 {
                (1.0 / l[r], m[r] + l[r].ln())
            } else {
                (0.0, f32::INFINITY)
            };
            simd::scale(&mut out[r * self.dv..(r + 1) * self.dv], inv);
            lse[r] = row_lse;
        }
    }
}
