//! Pictures: loss curves and attention heatmaps, as PNG or SVG (by file extension).

use std::path::Path;
use std::sync::Once;

use anyhow::{anyhow, bail, Result};
use plotters::coord::Shift;
use plotters::prelude::*;

/// Registers the embedded DejaVu Sans as plotters' sans-serif, so text renders on machines
/// without fonts.
fn fonts() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let _ = plotters::style::register_font(
            "sans-serif",
            FontStyle::Normal,
            dejavu::sans::regular(),
        );
    });
}

fn err(e: impl std::fmt::Display) -> anyhow::Error {
    anyhow!("drawing: {e}")
}

/// Draws on a PNG or SVG canvas of `size` chosen by `path`'s extension.
fn with_canvas(
    path: &Path,
    size: (u32, u32),
    draw: impl FnOnce(&DrawingArea<BitMapBackend, Shift>) -> Result<()>,
    draw_svg: impl FnOnce(&DrawingArea<SVGBackend, Shift>) -> Result<()>,
) -> Result<()> {
    fonts();
    match path
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase)
        .as_deref()
    {
        Some("png") => {
            let root = BitMapBackend::new(path, size).into_drawing_area();
            draw(&root)?;
            root.present().map_err(err)
        }
        Some("svg") => {
            let root = SVGBackend::new(path, size).into_drawing_area();
            draw_svg(&root)?;
            root.present().map_err(err)
        }
        _ => bail!("{}: the picture must end in .png or .svg", path.display()),
    }
}

fn loss_chart<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    rows: &[(f64, f64, f64)],
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE).map_err(err)?;
    let max_step = rows.iter().map(|r| r.0).fold(1.0, f64::max);
    let (lo, hi) = rows
        .iter()
        .flat_map(|r| [r.1, r.2])
        .filter(|x| x.is_finite())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), x| {
            (a.min(x), b.max(x))
        });
    let (lo, hi) = if lo.is_finite() {
        (lo * 0.95, hi * 1.05)
    } else {
        (0.0, 1.0)
    };
    let mut chart = ChartBuilder::on(root)
        .caption("loss", ("sans-serif", 24))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(52)
        .build_cartesian_2d(0.0..max_step, lo..hi)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc("cross-entropy (nats)")
        .draw()
        .map_err(err)?;
    chart
        .draw_series(LineSeries::new(rows.iter().map(|r| (r.0, r.1)), &BLUE))
        .map_err(err)?
        .label("train")
        .legend(|(x, y)| PathElement::new([(x, y), (x + 16, y)], BLUE));
    chart
        .draw_series(LineSeries::new(rows.iter().map(|r| (r.0, r.2)), &RED))
        .map_err(err)?
        .label("validation")
        .legend(|(x, y)| PathElement::new([(x, y), (x + 16, y)], RED));
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    Ok(())
}

/// A train/validation loss curve from `(step, train, val)` rows.
pub fn loss_curve(rows: &[(f64, f64, f64)], path: &Path) -> Result<()> {
    with_canvas(
        path,
        (800, 500),
        |r| loss_chart(r, rows),
        |r| loss_chart(r, rows),
    )
}

/// One heatmap to draw: a title and a `q × k` matrix of weights in [0, 1].
pub struct Heatmap {
    pub title: String,
    pub weights: Vec<Vec<f32>>,
}

fn heat_color(w: f32) -> RGBColor {
    // White to dark blue.
    let w = w.clamp(0.0, 1.0);
    let mix = |a: f32, b: f32| (a + (b - a) * w) as u8;
    RGBColor(mix(255.0, 8.0), mix(255.0, 48.0), mix(255.0, 107.0))
}

fn heatmaps_chart<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    maps: &[Heatmap],
    tokens: &[String],
    cols: usize,
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE).map_err(err)?;
    let rows = maps.len().div_ceil(cols);
    let cells = root.split_evenly((rows, cols));
    let n = tokens.len();
    let label_size = if n > 24 { 9 } else { 12 };
    for (map, area) in maps.iter().zip(cells.iter()) {
        // Segmented axes put each token label in the middle of its cell.
        let mut chart = ChartBuilder::on(area)
            .caption(&map.title, ("sans-serif", 16))
            .margin(6)
            .x_label_area_size(60)
            .y_label_area_size(70)
            .build_cartesian_2d((0..n - 1).into_segmented(), (0..n - 1).into_segmented())
            .map_err(err)?;
        let label = |v: &SegmentValue<usize>, flip: bool| match v {
            SegmentValue::CenterOf(i) if *i < n => {
                tokens[if flip { n - 1 - i } else { *i }].clone()
            }
            _ => String::new(),
        };
        chart
            .configure_mesh()
            .disable_mesh()
            .x_labels(n)
            .y_labels(n)
            .x_label_formatter(&|v| label(v, false))
            .y_label_formatter(&|v| label(v, true))
            .x_label_style(
                ("sans-serif", label_size)
                    .into_font()
                    .transform(FontTransform::Rotate90),
            )
            .y_label_style(("sans-serif", label_size))
            .x_desc("key")
            .y_desc("query")
            .draw()
            .map_err(err)?;
        chart
            .draw_series(map.weights.iter().enumerate().flat_map(|(q, row)| {
                row.iter().enumerate().map(move |(k, &w)| {
                    // Query 0 at the top, as attention figures are drawn.
                    let y = n - 1 - q;
                    Rectangle::new(
                        [
                            (SegmentValue::Exact(k), SegmentValue::Exact(y)),
                            (SegmentValue::Exact(k + 1), SegmentValue::Exact(y + 1)),
                        ],
                        heat_color(w).filled(),
                    )
                })
            }))
            .map_err(err)?;
    }
    Ok(())
}

/// Attention heatmaps in a grid (`cols` per row), tokens on both axes.
pub fn attention_heatmaps(maps: &[Heatmap], tokens: &[String], path: &Path) -> Result<()> {
    let cols = (maps.len() as f64).sqrt().ceil().max(1.0) as usize;
    let rows = maps.len().div_ceil(cols);
    let cell = 120 + 22 * tokens.len().min(40) as u32;
    let size = (cols as u32 * cell, rows as u32 * cell);
    with_canvas(
        path,
        size,
        |r| heatmaps_chart(r, maps, tokens, cols),
        |r| heatmaps_chart(r, maps, tokens, cols),
    )
}
