//! The HTML page of a [`ChartData`]: hand-written inline SVG (line charts for CDFs and time
//! series, bar charts for per-policy and per-rank numbers), an inline style sheet and nothing
//! else — no script, no external reference. Output is a pure function of the data, so the same
//! run gives a byte-identical page. Owns no data computation (see the parent module).

use std::fmt::Write;

use super::{ChartData, Section, Series};

const WIDTH: f64 = 760.0;
const HEIGHT: f64 = 300.0;
const LEFT: f64 = 64.0;
const RIGHT: f64 = 180.0;
const TOP: f64 = 30.0;
const BOTTOM: f64 = 44.0;
/// Colour-blind-safe palette (Okabe-Ito, then Tableau's), cycled.
const PALETTE: [&str; 12] = [
    "#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000",
    "#8c564b", "#7f7f7f", "#bcbd22", "#17becf",
];

/// The charts of a section fill the page's width: a grid of as many columns of at least ~520 px as
/// fit (one on a phone, two on a laptop, three on a wide screen), each SVG scaled to its column
/// (it has a viewBox and no fixed size), so a wide window shows bigger charts, not margins.
const STYLE: &str = "body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}\
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:2em;border-bottom:1px solid #ccc}\
p.note{color:#555}\
div.charts{display:grid;grid-template-columns:repeat(auto-fit,minmax(min(100%,520px),1fr));gap:1em}\
figure{margin:0}figure svg{display:block;width:100%;height:auto}\
svg text{font-family:system-ui,sans-serif;font-size:11px;fill:#222}\
svg .title{font-size:13px;font-weight:600}svg .grid{stroke:#e5e5e5}svg .axis{stroke:#555}";

/// The whole page.
pub fn page(data: &ChartData) -> String {
    let mut out = String::new();
    let _ = write!(
        out,
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n\
         <title>{}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n<h1>{}</h1>\n",
        esc(&data.title),
        esc(&data.title)
    );
    for section in &data.sections {
        out.push_str(&section_html(section));
    }
    out.push_str("</body>\n</html>\n");
    out
}

/// The charts a section shows, in page order: (title, SVG).
pub fn section_charts(section: &Section) -> Vec<(String, String)> {
    let policies = &section.policies;
    let names: Vec<&str> = policies.iter().map(|p| p.name.as_str()).collect();
    let mut charts = Vec::new();
    let ttft: Vec<Line> = policies
        .iter()
        .map(|p| (p.name.as_str(), p.ttft_cdf.clone()))
        .collect();
    let e2e: Vec<Line> = policies
        .iter()
        .map(|p| (p.name.as_str(), p.e2e_cdf.clone()))
        .collect();
    for (title, lines) in [("TTFT CDF", ttft), ("E2E latency CDF", e2e)] {
        let svg = line_chart(
            title,
            "milliseconds",
            "fraction of requests",
            &lines,
            Some((0.0, 1.0)),
        );
        charts.push((title.to_string(), svg));
    }
    let hits: Vec<f64> = policies.iter().map(|p| p.kv_hit_rate * 100.0).collect();
    charts.push((
        "KV hit rate".into(),
        bar_chart("KV hit rate", "% of prompt tokens", &names, &[("", hits)]),
    ));
    let ranks = policies
        .iter()
        .map(|p| p.requests_per_rank.len())
        .max()
        .unwrap_or(0);
    let rank_labels: Vec<String> = (0..ranks).map(|r| format!("rank {r}")).collect();
    let per_rank: Vec<(&str, Vec<f64>)> = policies
        .iter()
        .map(|p| {
            let mut v: Vec<f64> = p.requests_per_rank.iter().map(|&n| n as f64).collect();
            v.resize(ranks, 0.0);
            (p.name.as_str(), v)
        })
        .collect();
    let labels: Vec<&str> = rank_labels.iter().map(String::as_str).collect();
    charts.push((
        "Requests per rank".into(),
        bar_chart("Requests per rank", "requests", &labels, &per_rank),
    ));
    for p in policies {
        if let Some(load) = &p.load {
            let title = format!("Load per rank over time: {}", p.name);
            let lines = series_lines(load, |c| format!("rank {c}"));
            let svg = line_chart(&title, "seconds", "in-flight requests", &lines, None);
            charts.push((title, svg));
        }
    }
    let queues: Vec<(String, Vec<(f64, f64)>)> = policies
        .iter()
        .filter_map(|p| {
            let q = p.queue.as_ref()?;
            let (_, points) = series_lines(q, |_| String::new()).into_iter().next()?;
            Some((p.name.clone(), points))
        })
        .collect();
    if !queues.is_empty() {
        let title = "Router queue length over time";
        let svg = line_chart(title, "seconds", "queued requests", &queues, None);
        charts.push((title.into(), svg));
    }
    charts
}

fn section_html(section: &Section) -> String {
    let mut out = format!("<section>\n<h2>{}</h2>\n", esc(&section.title));
    if !section.note.is_empty() {
        let _ = writeln!(out, "<p class=\"note\">{}</p>", esc(&section.note));
    }
    out.push_str("<div class=\"charts\">\n");
    for (title, svg) in section_charts(section) {
        let _ = writeln!(
            out,
            "<figure aria-label=\"{}\">\n{svg}</figure>",
            esc(&title)
        );
    }
    out.push_str("</div>\n</section>\n");
    out
}

/// A named curve.
type Line<'a> = (&'a str, Vec<(f64, f64)>);

fn series_lines(series: &Series, name: impl Fn(usize) -> String) -> Vec<(String, Vec<(f64, f64)>)> {
    series
        .values
        .iter()
        .enumerate()
        .map(|(c, channel)| {
            let points = series
                .t_s
                .iter()
                .copied()
                .zip(channel.iter().copied())
                .collect();
            (name(c), points)
        })
        .collect()
}

struct Frame {
    x: (f64, f64),
    y: (f64, f64),
}

impl Frame {
    fn px(&self, x: f64) -> f64 {
        LEFT + (x - self.x.0) / (self.x.1 - self.x.0) * (WIDTH - LEFT - RIGHT)
    }
    fn py(&self, y: f64) -> f64 {
        HEIGHT - BOTTOM - (y - self.y.0) / (self.y.1 - self.y.0) * (HEIGHT - TOP - BOTTOM)
    }
}

fn svg_open(title: &str) -> String {
    format!(
        "<svg viewBox=\"0 0 {WIDTH} {HEIGHT}\" role=\"img\">\n<title>{t}</title>\n\
         <text class=\"title\" x=\"{LEFT}\" y=\"18\">{t}</text>\n",
        t = esc(title)
    )
}

/// Grid, ticks and axis labels of `frame`; `x_ticks` = false for a categorical x axis.
fn axes(out: &mut String, frame: &Frame, xlabel: &str, ylabel: &str, x_ticks: bool) {
    let (x0, x1, y0, y1) = (LEFT, WIDTH - RIGHT, TOP, HEIGHT - BOTTOM);
    for t in nice_ticks(frame.y.0, frame.y.1, 5) {
        let y = frame.py(t);
        let _ = writeln!(
            out,
            "<line class=\"grid\" x1=\"{x0}\" y1=\"{y:.1}\" x2=\"{x1}\" y2=\"{y:.1}\"/>\
             <text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>",
            x0 - 4.0,
            y + 4.0,
            fmt_num(t)
        );
    }
    if x_ticks {
        for t in nice_ticks(frame.x.0, frame.x.1, 6) {
            let x = frame.px(t);
            let _ = writeln!(
                out,
                "<line class=\"grid\" x1=\"{x:.1}\" y1=\"{y0}\" x2=\"{x:.1}\" y2=\"{y1}\"/>\
                 <text x=\"{x:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>",
                y1 + 14.0,
                fmt_num(t)
            );
        }
    }
    let _ = writeln!(
        out,
        "<line class=\"axis\" x1=\"{x0}\" y1=\"{y1}\" x2=\"{x1}\" y2=\"{y1}\"/>\
         <line class=\"axis\" x1=\"{x0}\" y1=\"{y0}\" x2=\"{x0}\" y2=\"{y1}\"/>\
         <text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>\
         <text transform=\"translate(14 {:.1}) rotate(-90)\" text-anchor=\"middle\">{}</text>",
        (x0 + x1) / 2.0,
        HEIGHT - 8.0,
        esc(xlabel),
        (y0 + y1) / 2.0,
        esc(ylabel)
    );
}

fn legend(out: &mut String, names: &[&str]) {
    for (i, name) in names.iter().enumerate().filter(|(_, n)| !n.is_empty()) {
        let y = TOP + 6.0 + 16.0 * i as f64;
        let x = WIDTH - RIGHT + 14.0;
        let _ = writeln!(
            out,
            "<rect x=\"{x}\" y=\"{:.1}\" width=\"12\" height=\"10\" fill=\"{}\"/>\
             <text x=\"{:.1}\" y=\"{y:.1}\" dominant-baseline=\"middle\">{}</text>",
            y - 5.0,
            color(i),
            x + 18.0,
            esc(name)
        );
    }
}

/// Lines through each curve's points (step-free: CDF quantiles and samples are dense enough).
/// `y_range` fixes the y axis (else 0..max). An empty curve is listed in the legend only.
pub fn line_chart(
    title: &str,
    xlabel: &str,
    ylabel: &str,
    lines: &[(impl AsRef<str>, Vec<(f64, f64)>)],
    y_range: Option<(f64, f64)>,
) -> String {
    let points = || lines.iter().flat_map(|(_, p)| p.iter());
    let x_min = points().map(|p| p.0).fold(f64::INFINITY, f64::min).min(0.0);
    let x_max = points().map(|p| p.0).fold(0.0, f64::max);
    let y_max = points().map(|p| p.1).fold(0.0, f64::max);
    let frame = Frame {
        x: (x_min, nice_max(x_max)),
        y: y_range.unwrap_or((0.0, nice_max(y_max))),
    };
    let mut out = svg_open(title);
    axes(&mut out, &frame, xlabel, ylabel, true);
    for (i, (_, pts)) in lines.iter().enumerate() {
        if pts.is_empty() {
            continue;
        }
        let d: Vec<String> = pts
            .iter()
            .map(|&(x, y)| format!("{:.1},{:.1}", frame.px(x), frame.py(y)))
            .collect();
        let _ = writeln!(
            out,
            "<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"1.6\" points=\"{}\"/>",
            color(i),
            d.join(" ")
        );
    }
    let names: Vec<&str> = lines.iter().map(|(n, _)| n.as_ref()).collect();
    legend(&mut out, &names);
    out.push_str("</svg>\n");
    out
}

/// Grouped bars: one group per category, one bar per series in it.
pub fn bar_chart(
    title: &str,
    ylabel: &str,
    categories: &[&str],
    series: &[(&str, Vec<f64>)],
) -> String {
    let y_max = series
        .iter()
        .flat_map(|(_, v)| v.iter().copied())
        .fold(0.0, f64::max);
    let frame = Frame {
        x: (0.0, categories.len().max(1) as f64),
        y: (0.0, nice_max(y_max)),
    };
    let mut out = svg_open(title);
    axes(&mut out, &frame, "", ylabel, false);
    let group = (WIDTH - LEFT - RIGHT) / categories.len().max(1) as f64;
    let bar = group * 0.8 / series.len().max(1) as f64;
    for (c, name) in categories.iter().enumerate() {
        let gx = LEFT + group * c as f64 + group * 0.1;
        for (s, (_, values)) in series.iter().enumerate() {
            let v = values.get(c).copied().unwrap_or(0.0);
            let (top, base) = (frame.py(v), frame.py(0.0));
            // A single-series chart colours by category, a grouped one by series.
            let fill = color(if series.len() == 1 { c } else { s });
            let _ = writeln!(
                out,
                "<rect x=\"{:.1}\" y=\"{top:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"{fill}\">\
                 <title>{}: {}</title></rect>",
                gx + bar * s as f64,
                bar.max(0.5),
                base - top,
                esc(name),
                fmt_num(v)
            );
        }
        let _ = writeln!(
            out,
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>",
            gx + group * 0.4,
            HEIGHT - BOTTOM + 14.0,
            esc(name)
        );
    }
    if series.len() > 1 {
        let names: Vec<&str> = series.iter().map(|(n, _)| *n).collect();
        legend(&mut out, &names);
    }
    out.push_str("</svg>\n");
    out
}

fn color(i: usize) -> &'static str {
    PALETTE[i % PALETTE.len()]
}

/// A round axis end at or above `v` (1, 2, 2.5, 5 × 10^k); 1 for nothing positive.
pub fn nice_max(v: f64) -> f64 {
    if !(v.is_finite() && v > 0.0) {
        return 1.0;
    }
    let base = 10f64.powf(v.log10().floor());
    [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * base)
        .find(|&m| m >= v * (1.0 - 1e-12))
        .unwrap_or(10.0 * base)
}

/// About `n` round tick values spanning `[lo, hi]`.
pub fn nice_ticks(lo: f64, hi: f64, n: usize) -> Vec<f64> {
    if !(hi > lo && lo.is_finite() && hi.is_finite()) || n == 0 {
        return vec![lo];
    }
    let raw = (hi - lo) / n as f64;
    let base = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * base)
        .find(|&m| m >= raw)
        .unwrap_or(10.0 * base);
    let first = (lo / step).ceil() as i64;
    let last = (hi / step + 1e-9).floor() as i64;
    (first..=last).map(|k| k as f64 * step).collect()
}

/// A tick or tooltip number: integers plainly, others with up to 3 significant decimals.
fn fmt_num(v: f64) -> String {
    if v == v.round() && v.abs() < 1e15 {
        format!("{}", v as i64)
    } else {
        let s = format!("{v:.3}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    }
}

/// HTML/XML text escape.
pub fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            _ => out.push(c),
        }
    }
    out
}
