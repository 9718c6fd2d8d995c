//! Tests of the `stanch` binary as an operator runs it.

mod architecture;
mod chart;
mod cli;
mod deps;
mod drill;
mod e2e;
mod early;
mod exposition;
mod flood;
mod grpc_peer;
mod ha;
mod image;
mod kubernetes;
mod process;
mod proto;
mod rules;
mod sizes;
mod sleeps;
mod ui;
