//! `stanch ctl watch`: the route table followed with the gateways' own client.

use clap::ValueEnum;

use crate::{CtlError, Output, WatchVia};

/// One line per version applied (the table itself with `-o json`,
/// one per line), until `count` versions or an interrupt. A table the controller
/// serves is applied whatever it holds: there is no gateway here to refuse it.
pub(crate) fn follow(
    server: &str,
    token: Option<String>,
    via: WatchVia,
    id: &str,
    count: Option<usize>,
    output: Output,
) -> Result<(), CtlError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(CtlError::Runtime)?;
    let mut config = stanch_client::WatchConfig::new(server, id);
    config.token = token.map(secrecy::SecretString::from);
    config.transport = match via {
        WatchVia::Sse => stanch_client::Transport::Sse,
        WatchVia::LongPoll => stanch_client::Transport::LongPoll,
        WatchVia::Grpc => stanch_client::Transport::Grpc,
    };
    let name = via
        .to_possible_value()
        .map_or_else(String::new, |v| v.get_name().to_owned());
    runtime.block_on(async {
        let (mut routes, _task) = stanch_client::start(config, None);
        let mut seen = 0;
        let mut version = 0;
        let interrupted = stanch_net::shutdown_signal();
        tokio::pin!(interrupted);
        while count.is_none_or(|n| seen < n) {
            let table = tokio::select! {
                t = routes.changed_from(version) => t,
                () = &mut interrupted => break,
            };
            let Some(table) = table else { break };
            version = table.version;
            seen += 1;
            let line = match output {
                Output::Json => serde_json::to_string(&*table).unwrap_or_default(),
                Output::Table => format!(
                    "{} version {} epoch {} hash {} via {name}: {} model(s), {} blocked",
                    table.generated_at,
                    table.version,
                    table.epoch,
                    table.hash,
                    table.models.len(),
                    table.blocked.len()
                ),
            };
            println!("{line}");
        }
    });
    Ok(())
}
