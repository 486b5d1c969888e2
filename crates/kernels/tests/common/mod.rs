//! Helpers shared by the integration tests.
#![allow(dead_code)]

use candle_core::backprop::GradStore;
use candle_core::{DType, Result, Tensor, Var};

/// Asserts `|a - b| <= atol + rtol·|b|` elementwise, skipping non-finite reference values,
/// and reports the worst element.
pub fn assert_close(a: &Tensor, b: &Tensor, atol: f32, rtol: f32, what: &str) {
    assert_eq!(a.dims(), b.dims(), "{what}: shapes differ");
    let a = flat(a).unwrap();
    let b = flat(b).unwrap();
    let mut worst = (0usize, 0f32, 0f32, 0f32); // index, excess over tolerance, a, b
    let mut max_diff = 0f32;
    for (i, (&x, &y)) in a.iter().zip(&b).enumerate() {
        if !y.is_finite() {
            continue;
        }
        let diff = (x - y).abs();
        let excess = diff - (atol + rtol * y.abs());
        max_diff = max_diff.max(if diff.is_nan() { f32::INFINITY } else { diff });
        if excess > worst.1 || diff.is_nan() {
            worst = (i, if diff.is_nan() { f32::INFINITY } else { excess }, x, y);
        }
    }
    assert!(
        worst.1 <= 0.0,
        "{what}: element {} is {} vs reference {} (max |diff| {max_diff:e}, atol {atol:e}, rtol {rtol:e})",
        worst.0,
        worst.2,
        worst.3
    );
}

/// Largest absolute difference.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    let a = flat(a).unwrap();
    let b = flat(b).unwrap();
    a.iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

pub fn flat(t: &Tensor) -> Result<Vec<f32>> {
    t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()
}

/// Every variable of `varmap`, named.
pub fn vars_of(varmap: &candle_nn::VarMap) -> Vec<(String, Var)> {
    let data = varmap.data().lock().unwrap();
    data.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
}

/// Compares each variable's autograd gradient with central finite differences (step 1e-5)
/// on about `per_var` of its coordinates: `|fd - g| <= 1e-6 + rtol·max(|fd|, |g|)`.
/// `loss` recomputes the loss from the variables' current values. Returns how many
/// coordinates were checked.
pub fn check_gradients(
    vars: &[(String, Var)],
    grads: &GradStore,
    per_var: usize,
    rtol: f64,
    loss: impl Fn() -> Result<f64>,
) -> Result<usize> {
    let mut checked = 0;
    for (name, var) in vars {
        let g = grads
            .get(var.as_tensor())
            .unwrap_or_else(|| panic!("no gradient for {name}"));
        let g = g.flatten_all()?.to_vec1::<f64>()?;
        let base = var.as_tensor().flatten_all()?.to_vec1::<f64>()?;
        let set = |v: Vec<f64>| var.set(&Tensor::from_vec(v, var.shape(), var.device())?);
        for i in (0..base.len()).step_by(base.len().div_ceil(per_var)) {
            let eps = 1e-5;
            let mut v = base.clone();
            v[i] += eps;
            set(v.clone())?;
            let up = loss()?;
            v[i] -= 2.0 * eps;
            set(v)?;
            let down = loss()?;
            set(base.clone())?;
            let numeric = (up - down) / (2.0 * eps);
            assert!(
                (numeric - g[i]).abs() <= 1e-6 + rtol * numeric.abs().max(g[i].abs()),
                "{name}[{i}]: autograd {} vs finite difference {numeric}",
                g[i]
            );
            checked += 1;
        }
    }
    Ok(checked)
}

/// Runs this test binary again with `GPT_GENERIC_PATHS=1`: its tests on the paths other
/// devices take (Candle's generic ops where our CPU kernels would run, as on a GPU), less
/// `this` (the caller) and `skip` (tests of the CPU's own layouts and dispatch). Asserts
/// that they pass and that at least `at_least` ran. Does nothing in that second run.
pub fn rerun_on_generic_paths(this: &str, skip: &[&str], at_least: usize) {
    if std::env::var("GPT_GENERIC_PATHS").is_ok_and(|v| v == "1") {
        return;
    }
    let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
    cmd.env("GPT_GENERIC_PATHS", "1").args(["--skip", this]);
    for s in skip {
        cmd.args(["--skip", s]);
    }
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "on the generic paths:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let passed: usize = stdout
        .lines()
        .find_map(|l| l.strip_prefix("test result: ok. "))
        .and_then(|r| r.split(' ').next()?.parse().ok())
        .unwrap_or(0);
    assert!(
        passed >= at_least,
        "on the generic paths only {passed} tests ran:\n{stdout}"
    );
}
