//! Integration tests of the controller over real HTTP on loopback.

mod admin;
mod bounds;
mod browser;
mod configure;
mod docs;
mod faults;
mod grpc;
mod history;
mod intake;
mod metrics;
mod openapi;
mod reconcile;
mod restart;
mod slow;
mod status;
mod support;
mod watch;
