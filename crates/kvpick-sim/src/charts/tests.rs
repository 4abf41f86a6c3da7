use super::*;

#[test]
fn cdf_of_few_values_keeps_every_sample_and_merges_ties() {
    let points = cdf(&[30.0, 10.0, 20.0, 20.0, f64::NAN], 100);
    assert_eq!(points, vec![(10.0, 0.25), (20.0, 0.75), (30.0, 1.0)]);
    assert!(cdf(&[], 10).is_empty());
    assert!(cdf(&[1.0], 0).is_empty());
}

#[test]
fn cdf_of_many_values_is_quantiles_ending_at_one() {
    let values: Vec<f64> = (1..=10_000).rev().map(f64::from).collect();
    let points = cdf(&values, 200);
    assert_eq!(points.len(), 200);
    assert_eq!(points[0], (1.0, 1e-4));
    assert_eq!(*points.last().unwrap(), (10_000.0, 1.0));
    for w in points.windows(2) {
        assert!(w[0].0 < w[1].0 && w[0].1 < w[1].1, "{w:?}");
    }
    // The median point is where it should be.
    let mid = points.iter().find(|p| p.1 >= 0.5).unwrap();
    assert!((mid.0 - 5_000.0).abs() <= 60.0, "{mid:?}");
}

#[test]
fn step_recorder_samples_the_state_in_force() {
    let mut r = StepRecorder::default();
    r.record(100, &[1, 0]);
    r.record(150, &[1, 0]); // no change: not stored
    r.record(200, &[2, 1]);
    r.record(200, &[3, 1]); // same instant: replaces
    r.record(400, &[0, 0]);
    assert_eq!(r.changes.len(), 3);
    let s = r.sample(2, 0, 400, 5);
    assert_eq!(s.t_s, vec![0.0, 1e-7, 2e-7, 3e-7, 4e-7]);
    assert_eq!(s.values[0], vec![0.0, 1.0, 3.0, 3.0, 0.0]);
    assert_eq!(s.values[1], vec![0.0, 0.0, 1.0, 1.0, 0.0]);
    // Fewer than two samples still spans the interval.
    assert_eq!(r.sample(1, 0, 400, 0).t_s.len(), 2);
}

fn policy(name: &str, queue: bool) -> PolicyCharts {
    PolicyCharts {
        name: name.into(),
        ttft_cdf: vec![(5.0, 0.5), (9.0, 1.0)],
        e2e_cdf: vec![(50.0, 0.5), (90.0, 1.0)],
        kv_hit_rate: 0.4,
        requests_per_rank: vec![3, 1],
        load: Some(Series {
            t_s: vec![0.0, 1.0],
            values: vec![vec![1.0, 2.0], vec![0.0, 1.0]],
        }),
        queue: queue.then(|| Series {
            t_s: vec![0.0, 1.0],
            values: vec![vec![0.0, 4.0]],
        }),
    }
}

#[test]
fn page_has_one_svg_per_chart_and_escapes_names() {
    let data = ChartData {
        title: "t <1>".into(),
        sections: vec![Section {
            title: "s".into(),
            note: String::new(),
            policies: vec![policy("kvpick", true), policy("a&b", false)],
        }],
    };
    let html = svg::page(&data);
    // TTFT, E2E, hit rate, per rank, one load chart per policy, one queue chart.
    assert_eq!(svg::section_charts(&data.sections[0]).len(), 7);
    assert_eq!(html.matches("<svg ").count(), 7);
    assert_eq!(html.matches("</svg>").count(), 7);
    assert!(html.contains("a&amp;b") && !html.contains("a&b"));
    assert!(html.contains("t &lt;1&gt;"));
    assert!(!html.contains("http://") && !html.contains("https://"));
    assert!(!html.contains("<script"));
}

#[test]
fn charts_fill_the_page_width() {
    let data = ChartData {
        title: "t".into(),
        sections: vec![Section {
            title: "s".into(),
            note: String::new(),
            policies: vec![policy("kvpick", true)],
        }],
    };
    let html = svg::page(&data);
    // No cap on the page and no fixed chart size: every SVG scales to its grid column.
    assert!(!html.contains("max-width"), "the page is capped");
    assert!(html.contains("figure svg{display:block;width:100%;height:auto}"));
    assert!(html.contains("div.charts{display:grid;"));
    let svgs: Vec<&str> = html.split("<svg ").skip(1).collect();
    assert_eq!(svgs.len(), svg::section_charts(&data.sections[0]).len());
    for s in svgs {
        let open = &s[..s.find('>').unwrap()];
        assert!(open.starts_with("viewBox=\"0 0 "), "{open}");
        assert!(
            !open.contains("width") && !open.contains("height"),
            "fixed size: {open}"
        );
    }
    // The figures sit in the section's grid.
    let grid = html.find("<div class=\"charts\">").unwrap();
    assert!(grid < html.find("<figure").unwrap());
    assert!(html.rfind("</figure>").unwrap() < html.rfind("</div>").unwrap());
}

#[test]
fn validate_rejects_input_just_over_each_limit() {
    let mut p = policy("kvpick", false);
    p.ttft_cdf = vec![(1.0, 1.0); MAX_POINTS];
    let ok = ChartData {
        title: String::new(),
        sections: vec![Section {
            title: String::new(),
            note: String::new(),
            policies: vec![p.clone(); MAX_POLICIES],
        }],
    };
    ok.validate().unwrap();
    let mut over = ok.clone();
    over.sections[0].policies[0].ttft_cdf.push((1.0, 1.0));
    assert!(over.validate().unwrap_err().to_string().contains("at most"));
    let mut over = ok.clone();
    over.sections[0].policies.push(p.clone());
    assert!(over.validate().is_err());
    let mut over = ok.clone();
    over.sections[0].policies[0].requests_per_rank = vec![0; MAX_RANKS + 1];
    assert!(over.validate().is_err());
    let mut over = ok.clone();
    over.sections = vec![over.sections[0].clone(); MAX_SECTIONS + 1];
    assert!(over.validate().is_err());
    let mut bad = ok.clone();
    bad.sections[0].policies[0].load = Some(Series {
        t_s: vec![0.0, 1.0],
        values: vec![vec![1.0]],
    });
    assert!(bad.validate().is_err());
}

#[test]
fn report_html_refuses_an_input_over_the_size_limit() {
    let dir = std::env::temp_dir().join(format!("kvpick-charts-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let input = dir.join("big.json");
    let f = std::fs::File::create(&input).unwrap();
    f.set_len(MAX_INPUT_BYTES + 1).unwrap(); // sparse: no 64 MiB written
    let err = run(ReportHtmlArgs {
        input: input.clone(),
        out: dir.join("out.html"),
    })
    .unwrap_err();
    assert!(err.to_string().contains("larger than"), "{err}");
    std::fs::write(&input, "{\"title\": 1}").unwrap();
    let err = run(ReportHtmlArgs {
        input,
        out: dir.join("out.html"),
    })
    .unwrap_err();
    assert!(err.to_string().contains("not chart data"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn nice_axis_helpers() {
    assert_eq!(svg::nice_max(0.0), 1.0);
    assert_eq!(svg::nice_max(7.3), 10.0);
    assert_eq!(svg::nice_max(180.0), 200.0);
    assert_eq!(svg::nice_max(2.2), 2.5);
    let ticks = svg::nice_ticks(0.0, 1.0, 5);
    assert_eq!(ticks.len(), 6);
    assert_eq!((ticks[0], ticks[5]), (0.0, 1.0));
    assert_eq!(svg::nice_ticks(0.0, 0.0, 5), vec![0.0]);
}
