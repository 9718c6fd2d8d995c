//! Why a `stanch ctl` command failed, with its cause kept.

use std::path::PathBuf;

use stanch_api::ErrorBody;

/// Why a `stanch ctl` command failed.
#[derive(Debug, thiserror::Error)]
pub enum CtlError {
    /// The async runtime for a watch or a cluster read could not start.
    #[error("cannot start the runtime")]
    Runtime(#[source] std::io::Error),
    /// The HTTP client could not be built (its TLS roots, say).
    #[error("cannot build the HTTP client")]
    Client(#[source] reqwest::Error),
    /// The controller could not be reached, or its answer not read.
    #[error("cannot reach {base}")]
    Unreachable {
        /// The controller's URL.
        base: String,
        /// The cause.
        #[source]
        source: reqwest::Error,
    },
    /// The controller refused, saying why.
    #[error("{status}: {}: {}", body.error, body.detail)]
    Refused {
        /// The HTTP status.
        status: reqwest::StatusCode,
        /// The controller's error body.
        body: ErrorBody,
    },
    /// The controller refused with a status and no error body (a proxy's answer).
    #[error("{status}")]
    Status {
        /// The HTTP status.
        status: reqwest::StatusCode,
    },
    /// The answer was not what the API documents.
    #[error("unexpected answer")]
    UnexpectedAnswer(#[source] reqwest::Error),
    /// The kubeconfig could not be read or used.
    #[error("{}", path.display())]
    Kubeconfig {
        /// The kubeconfig file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The Kubernetes API refused or failed a read.
    #[error("cannot {what}")]
    Cluster {
        /// What was being read (`read stanchroutetable monitoring/stanch`).
        what: String,
        /// The cause.
        #[source]
        source: kube::Error,
    },
    /// The route-table resource does not exist.
    #[error(
        "no stanchroutetable {namespace}/{name}: is a controller with --store kubernetes running there?"
    )]
    NoRouteTable {
        /// Its namespace.
        namespace: String,
        /// Its name.
        name: String,
    },
    /// The route-table resource exists but no leader has written a table to it yet.
    #[error("stanchroutetable {namespace}/{name} holds no table yet")]
    EmptyRouteTable {
        /// Its namespace.
        namespace: String,
        /// Its name.
        name: String,
    },
    /// A command the cluster cannot answer was asked of it.
    #[error(
        "--kubeconfig reads only (routes, status): overrides and the history are the \
         controller's API (--server), where they are authenticated with its tokens and \
         audited"
    )]
    ClusterReadsOnly,
}

/// `error` and every cause below it, as one line: `cannot reach http://…: error
/// sending request: connection refused`.
pub(crate) fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let said = cause.to_string();
        // Some causes repeat what their error already said.
        if !text.ends_with(&said) {
            text.push_str(": ");
            text.push_str(&said);
        }
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_chain_names_every_cause_once() {
        let io = std::io::Error::new(std::io::ErrorKind::PermissionDenied, "denied");
        let e = CtlError::Kubeconfig {
            path: "/etc/kube".into(),
            source: Box::new(io),
        };
        assert_eq!(chain(&e), "/etc/kube: denied");
        assert_eq!(
            chain(&CtlError::Runtime(std::io::Error::other("no threads"))),
            "cannot start the runtime: no threads"
        );
    }
}
