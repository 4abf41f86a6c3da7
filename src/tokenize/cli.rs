//! `kvpick tokenize`: runs request bodies through the configured tokenizers and prints the ids,
//! so a tokenizer config can be checked against an engine (and parity-tested in CI). It only
//! reads stdin and writes stdout; it starts no server.

use std::io::{BufRead, Write};
use std::path::PathBuf;

use bytes::Bytes;

use super::prompt::Endpoint;
use super::{TokenizeOutcome, Tokenizers};

#[derive(Debug, Clone, clap::Args)]
pub struct TokenizeArgs {
    /// The tokenizer config (same file as `serve --tokenizer-config`).
    #[arg(long, value_name = "FILE", env = "KVPICK_TOKENIZER_CONFIG")]
    pub tokenizer_config: PathBuf,
    /// The request path the bodies were sent to (`/v1/messages`, `/generate`, `/v1/embeddings`);
    /// by default chat, completions and responses bodies, told apart by their fields.
    #[arg(long, value_name = "PATH", default_value = "/v1/chat/completions")]
    pub path: String,
}

pub fn run(args: TokenizeArgs) -> anyhow::Result<()> {
    let registry = prometheus::Registry::new();
    // A checking tool tokenizes one body at a time, whatever its size: no request limits.
    let tokenizers =
        Tokenizers::load(&args.tokenizer_config, &registry)?.with_limits(super::TokenizeLimits {
            max_body_bytes: usize::MAX,
            queue_timeout: std::time::Duration::from_secs(3600),
        });
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let endpoint = Endpoint::from_path(&args.path);
    let stdin = std::io::stdin();
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    for line in stdin.lock().lines() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        // A body naming no model (SGLang `/generate`) uses the only configured model, if one.
        let model = serde_json::from_str::<serde_json::Value>(&line)
            .ok()
            .and_then(|v| v.get("model").and_then(|m| m.as_str()).map(String::from))
            .or_else(|| tokenizers.sole_model().map(String::from))
            .unwrap_or_default();
        let outcome =
            runtime.block_on(tokenizers.tokenize_request(endpoint, &model, Bytes::from(line)));
        let answer = match outcome {
            TokenizeOutcome::Tokens { ids, source } => {
                serde_json::json!({"ids": ids, "source": source.label()})
            }
            TokenizeOutcome::Fallback { reason } => serde_json::json!({ "fallback": reason }),
            TokenizeOutcome::Skipped { reason } => serde_json::json!({ "fallback": reason }),
            TokenizeOutcome::NotApplicable => serde_json::json!({ "fallback": "not applicable" }),
        };
        writeln!(out, "{answer}")?;
        out.flush()?;
    }
    Ok(())
}
