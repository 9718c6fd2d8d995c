//! Tests of the `stanch` binary as an operator runs it.

mod cli;
mod drill;
mod e2e;
mod kubernetes;
mod process;
mod rules;
