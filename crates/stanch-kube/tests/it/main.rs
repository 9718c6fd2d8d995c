//! stanch-kube's tests: the committed CRDs, and the resources' shapes.

mod adapter;
mod client;
mod crds;
mod fake;
mod sequence;
mod store;
