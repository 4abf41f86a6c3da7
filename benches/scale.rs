//! The scale benchmark (issue 27 item 5): `cargo bench --bench scale [-- FLAGS]` runs the real
//! `kvpick serve` (the release build cargo bench makes) against a fake Kubernetes API server with
//! 1,000 pods × 8 data-parallel ranks, 100 pod changes/s, a KV-event publisher per rank and
//! 2,000 ext_proc picks/s, prints a table and writes `target/bench-scale.json`
//! (`kvpick_testkit::scale`; `-- --help` lists the flags, `-- --quick` is the smoke size).
//! Without `--bench` (as under `cargo test --all-targets`) it makes the `--quick` run only, into
//! `target/bench-scale-smoke.json`.

use clap::Parser;
use kvpick_testkit::scale::{run, ScaleArgs};

fn main() -> anyhow::Result<()> {
    let mut args = ScaleArgs::parse();
    if !args.bench {
        args.quick = true;
        args.out = "target/bench-scale-smoke.json".into();
    }
    if args.out.is_relative() {
        args.out = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(&args.out);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let out = args.out.clone();
    let binary = std::path::Path::new(env!("CARGO_BIN_EXE_kvpick"));
    let report = runtime.block_on(run(binary, args))?;
    print!("{}", report.table());
    println!("wrote {}", out.display());
    Ok(())
}
