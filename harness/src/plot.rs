//! `harness bench --plot FILE.svg`: the lag distributions and the throughput bars of one run.
//!
//! Left: the cumulative distribution of tail lag per offered rate, the agent as a thick line
//! and make-mirror as a thin one of the same colour, on a log axis. Right: keys/s of every
//! throughput figure, the baseline first.

use std::path::Path;
use std::time::Duration;

use plotters::prelude::*;

use crate::figures::Figures;

/// Draws `f` into an SVG file at `path`.
pub fn draw(f: &Figures, path: &Path) -> anyhow::Result<()> {
    let root = SVGBackend::new(path, (1280, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_error)?;
    let (left, right) = root.split_horizontally(660);
    lag_cdf(f, &left)?;
    throughput_bars(f, &right)?;
    root.present().map_err(plot_error)?;
    Ok(())
}

fn plot_error<E: std::error::Error + Send + Sync + 'static>(e: DrawingAreaErrorKind<E>) -> anyhow::Error {
    anyhow::anyhow!("drawing the plot: {e}")
}

/// (lag in ms, fraction of writes at or below it) for sorted `lags`, thinned to ~500 points.
fn cdf(lags: &[Duration]) -> Vec<(f64, f64)> {
    let step = (lags.len() / 500).max(1);
    let n = lags.len() as f64;
    let mut points: Vec<(f64, f64)> = lags
        .iter()
        .enumerate()
        .step_by(step)
        .map(|(i, d)| ((d.as_secs_f64() * 1e3).max(0.01), (i + 1) as f64 / n))
        .collect();
    if let Some(last) = lags.last() {
        points.push(((last.as_secs_f64() * 1e3).max(0.01), 1.0));
    }
    points
}

fn lag_cdf<DB: DrawingBackend>(
    f: &Figures,
    area: &DrawingArea<DB, plotters::coord::Shift>,
) -> anyhow::Result<()>
where
    DB::ErrorType: 'static,
{
    let loaded = f.loaded.iter().flat_map(|l| l.lags.iter());
    let all = f.tails.iter().flat_map(|t| t.agent.iter().chain(t.make_mirror.iter().flatten())).chain(loaded);
    let max_ms = all.map(|d| d.as_secs_f64() * 1e3).fold(1.0f64, f64::max) * 1.5;
    let mut chart = ChartBuilder::on(area)
        .caption("Tail lag: source put acknowledged -> visible in target", ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d((0.01f64..max_ms).log_scale(), 0f64..1f64)
        .map_err(plot_error)?;
    chart.configure_mesh().x_desc("lag, ms (log)").y_desc("fraction of writes").draw().map_err(plot_error)?;
    for (i, t) in f.tails.iter().enumerate() {
        let colour = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(cdf(&t.agent), colour.stroke_width(3)))
            .map_err(plot_error)?
            .label(format!("agent, {} writes/s", t.rate))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(3)));
        if let Some(mm) = &t.make_mirror {
            chart
                .draw_series(LineSeries::new(cdf(mm), colour.stroke_width(1)))
                .map_err(plot_error)?
                .label(format!("make-mirror, {} writes/s", t.rate))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(1)));
        }
    }
    if let Some(l) = &f.loaded {
        let colour = Palette99::pick(f.tails.len()).to_rgba();
        chart
            .draw_series(LineSeries::new(cdf(&l.lags), colour.stroke_width(3)))
            .map_err(plot_error)?
            .label(format!("agent, the minute after a sync under {} writes/s", l.rate))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(3)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(plot_error)?;
    Ok(())
}

/// The throughput figures of a run as (label, keys/s), the baseline first.
pub fn throughput(f: &Figures) -> Vec<(String, f64)> {
    let mut bars = vec![("write ceiling, flat Txns".to_owned(), f.ceiling)];
    bars.extend(f.nested.iter().map(|(n, r)| (format!("ceiling, {n} nested Txns"), *r)));
    bars.push(("naive copier".to_owned(), f.copier));
    bars.push(("agent initial sync".to_owned(), f.agent_sync));
    if let Some(mm) = f.make_mirror_sync {
        bars.push(("make-mirror initial sync".to_owned(), mm));
    }
    bars.push(("agent reconcile pass".to_owned(), f.reconcile));
    if let Some(l) = &f.loaded {
        bars.push((format!("agent initial sync, {} writes/s", l.rate), l.sync));
        bars.push((format!("agent reconcile, {} writes/s", l.rate), l.reconcile));
    }
    bars
}

fn throughput_bars<DB: DrawingBackend>(
    f: &Figures,
    area: &DrawingArea<DB, plotters::coord::Shift>,
) -> anyhow::Result<()>
where
    DB::ErrorType: 'static,
{
    let bars = throughput(f);
    let max = bars.iter().map(|(_, v)| *v).fold(1.0f64, f64::max) * 1.15;
    let caption = format!("Throughput, keys/s ({} keys of {} B)", f.keys, f.value_size);
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(190)
        .build_cartesian_2d(0f64..max, (0..bars.len()).into_segmented())
        .map_err(plot_error)?;
    let names: Vec<String> = bars.iter().map(|(n, _)| n.clone()).collect();
    let label = |v: &SegmentValue<usize>| match v {
        SegmentValue::CenterOf(i) => names.get(*i).cloned().unwrap_or_default(),
        _ => String::new(),
    };
    chart
        .configure_mesh()
        .disable_y_mesh()
        .y_labels(bars.len())
        .y_label_formatter(&label)
        .x_label_formatter(&|v| format!("{:.0}k", v / 1e3))
        .x_desc("keys/s")
        .draw()
        .map_err(plot_error)?;
    chart
        .draw_series(bars.iter().enumerate().map(|(i, (_, v))| {
            let colour = if i == 0 { BLACK.mix(0.5) } else { Palette99::pick(i).mix(0.8) };
            Rectangle::new([(0.0, SegmentValue::Exact(i)), (*v, SegmentValue::Exact(i + 1))], colour.filled())
        }))
        .map_err(plot_error)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::figures::{LoadedFigures, TailFigures};

    /// A run's figures make an SVG with both panels and every label, and the CDF ends at 1.
    #[test]
    fn draws_both_panels() {
        let lags: Vec<Duration> = (1..=2_000).map(|i| Duration::from_micros(i * 37)).collect();
        let f = Figures {
            keys: 1_000,
            value_size: 100,
            ceiling: 100_000.0,
            nested: vec![(4, 120_000.0)],
            copier: 90_000.0,
            agent_sync: 80_000.0,
            make_mirror_sync: Some(2_000.0),
            tails: vec![TailFigures { rate: 500, agent: lags.clone(), make_mirror: Some(lags.clone()) }],
            reconcile: 70_000.0,
            loaded: Some(LoadedFigures {
                rate: 2_000,
                keys: 1_000,
                sync: 60_000.0,
                backlog: Some(40),
                lags: lags.clone(),
                refused: 0,
                reconcile: 50_000.0,
            }),
            peak_rss: vec![("initial sync".into(), 12 << 20)],
        };
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bench.svg");
        draw(&f, &path).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        for text in [
            "naive copier",
            "agent initial sync",
            "agent, 500 writes/s",
            "make-mirror, 500 writes/s",
            "agent initial sync, 2000 writes/s",
            "the minute after a sync under 2000 writes/s",
        ] {
            assert!(svg.contains(text), "{text} missing from the plot");
        }
        assert_eq!(cdf(&lags).last().map(|p| p.1), Some(1.0));
        assert!(cdf(&lags).len() <= 502);
    }
}
