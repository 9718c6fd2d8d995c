//! Tests of the `stanch` binary as an operator runs it.

mod cli;
mod process;
mod rules;
