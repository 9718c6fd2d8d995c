//! stanch-kube's tests: the committed CRDs, and the resources' shapes.

mod crds;
mod fake;
