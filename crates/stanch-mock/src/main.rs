//! `stanch-mock`: run one mock upstream.

use std::net::SocketAddr;
use std::time::Duration;

use clap::Parser;
use stanch_mock::{Mock, MockConfig, Prefill};

/// An OpenAI-compatible mock upstream with runtime fault injection.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// Address to listen on.
    #[arg(long, env = "STANCH_MOCK_LISTEN", default_value = "127.0.0.1:8001")]
    listen: SocketAddr,
    /// The model name it answers as.
    #[arg(long, env = "STANCH_MOCK_MODEL", default_value = "qwen-72b")]
    model: String,
    /// This instance's name (X-Mock-Instance, metrics).
    #[arg(long, env = "STANCH_MOCK_INSTANCE")]
    instance: Option<String>,
    /// Require `Authorization: Bearer <key>` on API requests.
    #[arg(long, env = "STANCH_MOCK_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Require `Authorization: Bearer <token>` on the admin API.
    #[arg(long, env = "STANCH_MOCK_ADMIN_TOKEN", hide_env_values = true)]
    admin_token: Option<String>,
    /// Prompts longer than this many words get 400 context_length_exceeded.
    #[arg(long, default_value_t = 4096)]
    max_context_words: usize,
    /// Milliseconds between streamed tokens.
    #[arg(long, default_value_t = 0)]
    token_interval_ms: u64,
    /// Close keep-alive connections idle this many seconds (uvicorn, hence vLLM: 5).
    #[arg(long)]
    keep_alive_seconds: Option<f64>,
    /// What it makes of a chat request ending with an assistant message.
    #[arg(long, value_enum, default_value_t = Prefill::Ignore)]
    prefill: Prefill,
    /// Serve TLS with this PEM certificate chain (with --tls-key).
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<std::path::PathBuf>,
    /// The PEM private key for --tls-cert.
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<std::path::PathBuf>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let _logging = stanch_log::init(stanch_log::Format::Text);
    let args = Args::parse();
    let mut config = MockConfig::new(
        &args.model,
        &args.instance.unwrap_or_else(|| args.listen.to_string()),
    );
    config.api_key = args.api_key;
    config.admin_token = args.admin_token;
    config.max_context_words = args.max_context_words;
    config.token_interval = Duration::from_millis(args.token_interval_ms);
    config.prefill = args.prefill;
    config.keep_alive = args
        .keep_alive_seconds
        .map(Duration::try_from_secs_f64)
        .transpose()
        .map_err(|e| anyhow::anyhow!("--keep-alive-seconds: {e}"))?;
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Some(stanch_net::tls_acceptor(cert, key, false)?),
        _ => None,
    };
    let listener = tokio::net::TcpListener::bind(args.listen).await?;
    tracing::info!(addr = %args.listen, model = %config.model, instance = %config.instance, "stanch-mock listening");
    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    stanch_mock::serve(listener, Mock::new(config), tls, shutdown).await;
    Ok(())
}
