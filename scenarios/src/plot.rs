//! `--plot FILE.svg`: hit rate, tier occupancy and in-flight (reserved)
//! bytes over simulated time, as three stacked charts.

use std::path::Path;

use plotters::prelude::*;

use crate::report::Sample;

#[derive(Debug, thiserror::Error)]
#[error("plot: {0}")]
pub struct PlotError(String);

fn e<E: std::fmt::Display>(err: E) -> PlotError {
    PlotError(err.to_string())
}

pub fn draw(path: &Path, title: &str, samples: &[Sample]) -> Result<(), PlotError> {
    let root = SVGBackend::new(path, (900, 900)).into_drawing_area();
    root.fill(&WHITE).map_err(e)?;
    let root = root
        .titled(&format!("OrbitKV replay: {title}"), ("sans-serif", 22))
        .map_err(e)?;
    let panels = root.split_evenly((3, 1));
    let t_max = samples.iter().map(|s| s.t_us).max().unwrap_or(1).max(1);
    type Series<'a> = Vec<(&'a str, RGBColor, Box<dyn Fn(&Sample) -> f64 + 'a>)>;
    let charts: [(&str, Series); 3] = [
        (
            "hit rate (cumulative)",
            vec![("hit rate", BLUE, Box::new(|s: &Sample| s.hit_rate))],
        ),
        (
            "occupancy",
            vec![
                (
                    "DRAM MiB used",
                    RED,
                    Box::new(|s: &Sample| s.dram_bytes_used as f64 / (1 << 20) as f64),
                ),
                (
                    "lower-tier pages / 1000",
                    GREEN,
                    Box::new(|s: &Sample| s.tier_pages as f64 / 1000.0),
                ),
            ],
        ),
        (
            "in flight",
            vec![(
                "reserved KiB",
                MAGENTA,
                Box::new(|s: &Sample| s.bytes_reserved as f64 / 1024.0),
            )],
        ),
    ];
    for (area, (caption, series)) in panels.iter().zip(charts) {
        let y_max = series
            .iter()
            .flat_map(|(_, _, f)| samples.iter().map(f))
            .fold(0.0f64, f64::max)
            .max(1e-9)
            * 1.1;
        let mut chart = ChartBuilder::on(area)
            .caption(caption, ("sans-serif", 16))
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(60)
            .build_cartesian_2d(0u64..t_max, 0f64..y_max)
            .map_err(e)?;
        chart
            .configure_mesh()
            .x_desc("simulated µs")
            .draw()
            .map_err(e)?;
        for (name, color, f) in series {
            chart
                .draw_series(LineSeries::new(
                    samples.iter().map(|s| (s.t_us, f(s))),
                    color,
                ))
                .map_err(e)?
                .label(name)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(e)?;
    }
    root.present().map_err(e)?;
    Ok(())
}
