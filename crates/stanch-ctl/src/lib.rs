//! `stanch ctl`: the command-line client of the controller's status and override
//! APIs, for humans (tables) and scripts (`--output json`).
//!
//! - [`run`] parses nothing itself: the `stanch` binary hands it [`CtlArgs`].
//! - `client`: the HTTP API (status, history, routes, overrides).
//! - `watch`: `stanch ctl watch`, following the table as a gateway does.
//! - `cluster`: `--kubeconfig`, reading what the cluster holds instead.
//! - `render`: tables for humans; every value from outside printed as text.
#![expect(
    clippy::print_stdout,
    reason = "a command-line client prints its results"
)]

mod client;
mod cluster;
mod error;
mod render;
mod watch;

use std::process::ExitCode;

use clap::{Args, Subcommand, ValueEnum};
use stanch_api::{HumanDuration, Rung};

pub use error::CtlError;

/// `stanch ctl`'s arguments.
#[derive(Debug, Args)]
pub struct CtlArgs {
    /// The controller's URL.
    #[arg(
        long,
        env = "STANCH_URL",
        default_value = "http://127.0.0.1:9797",
        global = true
    )]
    server: String,
    /// Bearer token (admin for overrides, read or admin otherwise).
    #[arg(long, env = "STANCH_TOKEN", global = true, hide_env_values = true)]
    token: Option<String>,
    /// Output format.
    #[arg(long, short, value_enum, default_value = "table", global = true)]
    output: Output,
    /// Read from the cluster instead of the controller's API, with this kubeconfig:
    /// `routes` (the route-table resource) and `status` (the policies' statuses).
    /// Overrides and history are the controller's API's alone.
    #[arg(long, global = true)]
    kubeconfig: Option<std::path::PathBuf>,
    /// With --kubeconfig: the controller's namespace (default: the context's).
    #[arg(long, global = true)]
    namespace: Option<String>,
    /// With --kubeconfig: the route-table resource's name (the controller's Lease name).
    #[arg(long, global = true, default_value = "stanch")]
    route_table: String,
    #[command(subcommand)]
    command: CtlCmd,
}

/// How results are printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Output {
    /// Aligned columns, for humans.
    Table,
    /// The API's JSON, for scripts.
    Json,
}

/// A watch transport, as `stanch ctl watch --transport` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum WatchVia {
    Sse,
    LongPoll,
    Grpc,
}

#[derive(Debug, Subcommand)]
enum CtlCmd {
    #[command(flatten)]
    Read(ReadCmd),
    /// Follow the route table as a gateway does, printing each version as it arrives.
    Watch {
        /// How: sse, long-poll or grpc.
        #[arg(long, value_enum, default_value = "sse")]
        transport: WatchVia,
        /// The identity to watch as (status lists it among the gateways).
        #[arg(long, default_value = "stanch-ctl")]
        id: String,
        /// Stop after this many versions (default: follow until interrupted).
        #[arg(long)]
        count: Option<usize>,
    },
    #[command(flatten)]
    Override(OverrideCmd),
}

/// What is read and printed once.
#[derive(Debug, Subcommand)]
enum ReadCmd {
    /// Models, blocks, overrides and gateways at a glance.
    Status,
    /// The audit history, newest last.
    History {
        /// Entries to show.
        #[arg(long, default_value_t = 50)]
        limit: usize,
        /// Only this model.
        #[arg(long)]
        model: Option<String>,
    },
    /// The published route table.
    Routes,
}

/// An override: authenticated with the admin token, journaled, in the history.
#[derive(Debug, Subcommand)]
enum OverrideCmd {
    /// Pin a model to a rung.
    Force {
        model: String,
        /// normal, failover, degraded or static.
        rung: Rung,
        #[arg(long)]
        ttl: Option<HumanDuration>,
        #[arg(long)]
        reason: String,
    },
    /// Hand a pinned model back to automation.
    Release {
        model: String,
        #[arg(long)]
        reason: String,
    },
    /// Stop automation for one model (or every model).
    Freeze {
        #[arg(long)]
        model: Option<String>,
        #[arg(long)]
        ttl: Option<HumanDuration>,
        #[arg(long)]
        reason: String,
    },
    /// End a freeze.
    Thaw {
        #[arg(long)]
        model: Option<String>,
        #[arg(long)]
        reason: String,
    },
    /// Cut a model's fail-back short: skip (the rest of its traffic returns now) or
    /// abort (all of it back, with backoff). A freeze pauses one.
    Failback {
        model: String,
        /// skip or abort.
        action: stanch_api::admin::FailbackAction,
        #[arg(long)]
        reason: String,
    },
    /// Soft-block an endpoint.
    Block {
        endpoint: String,
        #[arg(long)]
        model: Option<String>,
        #[arg(long)]
        ttl: Option<HumanDuration>,
        #[arg(long)]
        reason: String,
    },
    /// Lift a block.
    Unblock {
        endpoint: String,
        #[arg(long)]
        model: Option<String>,
        #[arg(long)]
        reason: String,
    },
    /// Lift every block.
    UnblockAll {
        #[arg(long)]
        reason: String,
    },
    /// Decide and report without publishing (on), or publish again (off).
    DryRun {
        state: Toggle,
        #[arg(long)]
        reason: String,
    },
}

/// On or off, as `stanch ctl dry-run` takes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Toggle {
    On,
    Off,
}

/// Runs one `stanch ctl` command; prints its result, or the error and its causes.
pub fn run(args: CtlArgs) -> ExitCode {
    let token = || {
        args.token
            .clone()
            .or_else(|| std::env::var("STANCH_ADMIN_TOKEN").ok())
            .filter(|t| !t.is_empty())
    };
    let result = match (args.kubeconfig.as_deref(), args.command) {
        (Some(kubeconfig), CtlCmd::Read(read)) => cluster::read(
            kubeconfig,
            args.namespace.as_deref(),
            &args.route_table,
            read,
            args.output,
        ),
        (Some(_), _) => Err(CtlError::ClusterReadsOnly),
        (
            None,
            CtlCmd::Watch {
                transport,
                id,
                count,
            },
        ) => watch::follow(&args.server, token(), transport, &id, count, args.output)
            .map(|()| String::new()),
        (None, CtlCmd::Read(read)) => {
            client::Client::new(&args.server, token()).and_then(|c| c.read(read, args.output))
        }
        (None, CtlCmd::Override(command)) => {
            client::Client::new(&args.server, token()).and_then(|c| c.apply(command, args.output))
        }
    };
    finish(result)
}

/// Prints what a command made, or why it failed, with every cause.
fn finish(result: Result<String, CtlError>) -> ExitCode {
    // Whatever a value from outside holds, it cannot drive the terminal: every control
    // character but the renderers' own line ends is written as an escape.
    let safe = |text: &str| -> String {
        text.split('\n')
            .map(|line| render::printable(line).into_owned())
            .collect::<Vec<_>>()
            .join("\n")
    };
    match result {
        Ok(text) => {
            print!("{}", safe(&text));
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {}", safe(&error::chain(&e)));
            ExitCode::FAILURE
        }
    }
}
