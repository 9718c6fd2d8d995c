//! The gateway over real HTTP, in front of real mock upstreams: every failure class,
//! streaming and not, asserting what the caller got and what each upstream saw.

mod connections;
mod failures;
mod fleet;
mod headers;
mod layers;
mod process;
mod rescue;
mod resume;
mod routing;
mod sdk;
mod slow;
mod support;
mod usage;
mod wire;
