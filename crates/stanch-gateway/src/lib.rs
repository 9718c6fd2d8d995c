//! stanch-gateway: the reference data plane. An OpenAI-compatible proxy that applies
//! stanch's route table per request and heals per request on its own.
//!
//! Owns: serving `/v1/chat/completions`, `/v1/completions`, `/v1/embeddings`,
//! `/v1/models`; applying the table (rungs, VIP exemption, blocks, leases); choosing
//! endpoints; classifying outcomes; passive blocking; retries within a budget; pool,
//! model and FAQ fallbacks; streaming pass-through. Does not own: decisions across the
//! fleet (the controller's) or capacity limits.

pub mod budget;
pub mod config;
pub mod endpoints;
pub mod faq;
mod headers;
mod json;
pub mod metrics;
pub mod outcome;
mod per_worker;
pub mod table;
mod window;

// A request's way through the gateway: the front, admission, the route table's word,
// the plan served attempt by attempt, a stream or a whole answer; and what it carries.
mod admit;
mod attempt;
mod error;
mod front;
mod request;
mod respond;
mod route;
mod serving;
mod stream;
mod upstream;

// What runs beside the requests.
mod background;

// The gateway, and serving it.
mod gateway;
mod server;

pub use background::{probe_loop, report_loop};
pub use gateway::{Gateway, StartError, applied_table};
pub use server::{serve, serve_on};
pub use upstream::SetupError;
