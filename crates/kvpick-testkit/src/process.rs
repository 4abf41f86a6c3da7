//! The real `kvpick serve` binary as a child process: started with its ports on 127.0.0.1:0 and
//! its log in a fresh directory, its port file awaited, its gRPC readiness asked, its `/metrics`
//! page read, its RSS and CPU time read from `/proc`. Killed and its directory removed on drop.
//!
//! Owns the process only; what the numbers mean is the caller's.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

/// Linux's USER_HZ: `/proc/PID/stat` counts CPU time in these ticks (100 on every mainstream
/// kernel configuration).
const TICKS_PER_SECOND: f64 = 100.0;

pub struct Kvpick {
    child: Child,
    dir: PathBuf,
    pub grpc: u16,
    pub health: u16,
    pub metrics: u16,
}

impl Kvpick {
    /// Starts `binary serve` with `args` after the port flags, waits (bounded) for its ports.
    pub async fn start(binary: &Path, args: &[String]) -> anyhow::Result<Kvpick> {
        let dir = std::env::temp_dir().join(format!("kvpick-bench-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir)?;
        let port_file = dir.join("ports.json");
        let log = std::fs::File::create(dir.join("kvpick.log"))?;
        let child = Command::new(binary)
            .args(["serve", "--bind", "127.0.0.1", "--grpc-port", "0"])
            .args(["--grpc-health-port", "0", "--metrics-port", "0"])
            .arg("--port-file")
            .arg(&port_file)
            .args(args)
            .env_remove("NAMESPACE")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", binary.display()))?;
        let mut kvpick = Kvpick {
            child,
            dir,
            grpc: 0,
            health: 0,
            metrics: 0,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        let ports = loop {
            if let Ok(text) = std::fs::read_to_string(&port_file) {
                break text;
            }
            if let Ok(Some(status)) = kvpick.child.try_wait() {
                bail!("kvpick exited early ({status}):\n{}", kvpick.log_tail(30));
            }
            if Instant::now() > deadline {
                bail!(
                    "kvpick wrote no port file in 60 s:\n{}",
                    kvpick.log_tail(30)
                );
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        let ports: serde_json::Value = serde_json::from_str(&ports)?;
        let port = |name: &str| -> anyhow::Result<u16> {
            ports[name]
                .as_u64()
                .and_then(|p| u16::try_from(p).ok())
                .with_context(|| format!("port file without {name}: {ports}"))
        };
        kvpick.grpc = port("grpc")?;
        kvpick.health = port("health")?;
        kvpick.metrics = port("metrics")?;
        Ok(kvpick)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether the process is still running.
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// The last `lines` lines of kvpick's log.
    pub fn log_tail(&self, lines: usize) -> String {
        let log = std::fs::read_to_string(self.dir.join("kvpick.log")).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(lines).collect();
        tail.into_iter().rev().collect::<Vec<_>>().join("\n")
    }

    /// Copies kvpick's log (so far) to `to`.
    pub fn copy_log(&self, to: &Path) -> anyhow::Result<()> {
        std::fs::copy(self.dir.join("kvpick.log"), to)
            .with_context(|| format!("copying kvpick's log to {}", to.display()))?;
        Ok(())
    }

    /// A health client of the readiness port (one connection, reused by every check).
    pub async fn health_client(&self) -> anyhow::Result<HealthClient<tonic::transport::Channel>> {
        let channel =
            tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{}", self.health))?
                .connect()
                .await?;
        Ok(HealthClient::new(channel))
    }

    /// The `/metrics` page.
    pub async fn metrics_text(&self) -> anyhow::Result<String> {
        let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", self.metrics)).await?;
        stream
            .write_all(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
            .await?;
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await?;
        let text = String::from_utf8(raw).context("/metrics is not UTF-8")?;
        match text.split_once("\r\n\r\n") {
            Some((head, body)) if head.starts_with("HTTP/1.") && head.contains(" 200 ") => {
                Ok(body.to_string())
            }
            _ => bail!("/metrics answered {:?}", text.lines().next()),
        }
    }

    /// Resident set size in bytes (`VmRSS`), and its peak (`VmHWM`).
    pub fn memory(&self) -> Option<(u64, u64)> {
        memory_of(self.pid())
    }

    /// CPU seconds (user + system) the process has used.
    pub fn cpu_seconds(&self) -> Option<f64> {
        cpu_seconds_of(self.pid())
    }
}

/// Whether the readiness service says SERVING.
pub async fn is_ready(client: &mut HealthClient<tonic::transport::Channel>) -> bool {
    let request = HealthCheckRequest {
        service: "readiness".into(),
    };
    match client.check(request).await {
        Ok(response) => response.into_inner().status == ServingStatus::Serving as i32,
        Err(_) => false,
    }
}

/// Resident set size of process `pid` in bytes, and its peak, from `/proc/PID/status`.
pub fn memory_of(pid: u32) -> Option<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kib = |key: &str| -> Option<u64> {
        let line = status.lines().find(|l| l.starts_with(key))?;
        line.split_whitespace().nth(1)?.parse::<u64>().ok()
    };
    Some((kib("VmRSS:")? * 1024, kib("VmHWM:")? * 1024))
}

/// Resident set size of process `pid` in bytes.
pub fn rss_of(pid: u32) -> Option<u64> {
    memory_of(pid).map(|(rss, _)| rss)
}

/// CPU seconds (user + system) of process `pid`, from `/proc/PID/stat`.
pub fn cpu_seconds_of(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name, which may hold spaces but ends at the last ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the whole line: 12 and 13 after the name.
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) / TICKS_PER_SECOND)
}

impl Drop for Kvpick {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_has_cpu_time_and_memory() {
        let spent = cpu_seconds_of(std::process::id()).unwrap();
        assert!(spent >= 0.0);
        let (rss, peak) = memory_of(std::process::id()).unwrap();
        assert!(rss > 0 && peak >= rss, "{rss} {peak}");
    }
}
