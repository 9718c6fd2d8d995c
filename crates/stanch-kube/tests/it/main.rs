//! stanch-kube's tests: the committed CRDs, and the resources' shapes.

mod adapter;
mod client;
mod crds;
mod sequence;
mod store;
