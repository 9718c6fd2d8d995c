//! Bearer tokens per role, compared in constant time.
//!
//! Four roles: `ingest` (alerts, and gateway reports), `report` (gateway reports
//! only), `admin` (overrides) and `read` (routes, status, history). The admin token is
//! accepted for every role, and the ingest token for reports. A role without a token
//! is open, which `serve` allows only on a loopback listener; `report` without a token
//! of its own takes the ingest token's, so it is open only when ingest is.
//!
//! The report role exists so that gateways need not hold the ingest token: a gateway
//! pod that is compromised can then report outcomes (which the controller bounds and
//! checks against the topology) but not raise or resolve alerts.

use std::fmt;

use axum::http::{HeaderMap, header};
use secrecy::{ExposeSecret, SecretString};
use subtle::ConstantTimeEq;

use crate::error::ApiError;

/// Who may call a route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Alert intake and gateway reports.
    Ingest,
    /// Gateway reports only.
    Report,
    /// Overrides.
    Admin,
    /// Routes, status, history.
    Read,
}

impl Role {
    /// Every role.
    pub const ALL: [Role; 4] = [Role::Ingest, Role::Report, Role::Admin, Role::Read];

    /// The role's name, as in `STANCH_<NAME>_TOKEN`.
    pub const fn name(self) -> &'static str {
        match self {
            Role::Ingest => "ingest",
            Role::Report => "report",
            Role::Admin => "admin",
            Role::Read => "read",
        }
    }
}

/// The tokens in force. `Debug` never shows them.
#[derive(Clone, Default)]
pub struct Tokens {
    ingest: Option<SecretString>,
    report: Option<SecretString>,
    admin: Option<SecretString>,
    read: Option<SecretString>,
}

impl fmt::Debug for Tokens {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let set = |t: &Option<SecretString>| if t.is_some() { "set" } else { "unset" };
        f.debug_struct("Tokens")
            .field("ingest", &set(&self.ingest))
            .field("report", &set(&self.report))
            .field("admin", &set(&self.admin))
            .field("read", &set(&self.read))
            .finish()
    }
}

/// A token from a value; an empty one counts as unset.
fn secret(value: Option<String>) -> Option<SecretString> {
    value
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .map(SecretString::from)
}

impl Tokens {
    /// Tokens from values; empty strings count as unset. The report role has none of
    /// its own ([`Tokens::with_report`]).
    pub fn new(ingest: Option<String>, admin: Option<String>, read: Option<String>) -> Tokens {
        Tokens {
            ingest: secret(ingest),
            report: None,
            admin: secret(admin),
            read: secret(read),
        }
    }

    /// These tokens, with `report` the report role's own.
    pub fn with_report(self, report: Option<String>) -> Tokens {
        Tokens {
            report: secret(report),
            ..self
        }
    }

    /// The token that opens `role` by itself (besides the admin token): its own; for
    /// `report` without one of its own, the ingest token.
    fn own(&self, role: Role) -> Option<&SecretString> {
        match role {
            Role::Ingest => self.ingest.as_ref(),
            Role::Report => self.report.as_ref().or(self.ingest.as_ref()),
            Role::Admin => self.admin.as_ref(),
            Role::Read => self.read.as_ref(),
        }
    }

    /// Whether `role` has no token, and so is open.
    pub fn is_open(&self, role: Role) -> bool {
        self.own(role).is_none()
    }

    /// Roles that have no token, and so are open.
    pub fn open_roles(&self) -> Vec<Role> {
        Role::ALL
            .into_iter()
            .filter(|r| self.own(*r).is_none())
            .collect()
    }

    /// Checks the request's bearer token for `role`.
    pub fn check(&self, role: Role, headers: &HeaderMap) -> Result<(), ApiError> {
        let Some(own) = self.own(role) else {
            return Ok(());
        };
        let presented = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| {
                let (scheme, token) = v.split_once(' ')?;
                scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
            })
            .ok_or(ApiError::Unauthorized)?;
        let matches = |secret: &SecretString| {
            bool::from(
                secret
                    .expose_secret()
                    .as_bytes()
                    .ct_eq(presented.as_bytes()),
            )
        };
        // Reports take the ingest token too (it took them before the report role).
        let also = match role {
            Role::Report => self.ingest.as_ref(),
            _ => None,
        };
        if [Some(own), self.admin.as_ref(), also]
            .into_iter()
            .flatten()
            .any(matches)
        {
            Ok(())
        } else {
            Err(ApiError::Unauthorized)
        }
    }
}

/// What an open role still asks of a request, so that a web page in an operator's
/// browser cannot use a controller that runs without tokens: the request names the
/// controller by a loopback name (no DNS rebinding), and one that changes state
/// (`changes`) carries JSON (a form or `text/plain` needs no preflight) and no
/// `Origin` other than a loopback one.
pub fn same_machine(
    headers: &HeaderMap,
    authority: Option<&str>,
    changes: bool,
) -> Result<(), ApiError> {
    let host = headers
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .or(authority);
    if let Some(host) = host
        && !loopback(host)
    {
        return Err(ApiError::Forbidden {
            kind: "not_loopback_host",
            detail: "without tokens, stanch answers only requests that name it by a loopback \
                     address (localhost, 127.0.0.1, [::1]); set tokens to serve other names"
                .to_owned(),
        });
    }
    if !changes {
        return Ok(());
    }
    if let Some(origin) = headers.get(header::ORIGIN) {
        let authority = origin
            .to_str()
            .ok()
            .and_then(|o| o.split_once("://"))
            .map(|(_, rest)| rest);
        if !authority.is_some_and(loopback) {
            return Err(ApiError::Forbidden {
                kind: "cross_site",
                detail: "without tokens, a request from a web page of another site cannot \
                         change state; set tokens, or send it from the controller's machine"
                    .to_owned(),
            });
        }
    }
    let json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|t| t.trim().eq_ignore_ascii_case("application/json"));
    if !json {
        return Err(ApiError::UnsupportedMediaType);
    }
    Ok(())
}

/// Whether an authority (`host`, `host:port`, `[v6]:port`) names this machine.
fn loopback(authority: &str) -> bool {
    let host = match authority.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or(""),
        None => authority.rsplit_once(':').map_or(authority, |(h, port)| {
            if port.bytes().all(|b| b.is_ascii_digit()) {
                h
            } else {
                authority
            }
        }),
    };
    let host = host.trim_end_matches('.');
    host.eq_ignore_ascii_case("localhost")
        || host.to_ascii_lowercase().ends_with(".localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bearer(t: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            header::AUTHORIZATION,
            format!("Bearer {t}").parse().unwrap(),
        );
        h
    }

    #[test]
    fn loopback_names_only() {
        for ok in [
            "localhost",
            "localhost:9797",
            "LOCALHOST.",
            "ui.localhost:1",
            "127.0.0.1",
            "127.1.2.3:80",
            "[::1]:9797",
            "[::1]",
        ] {
            assert!(loopback(ok), "{ok}");
        }
        for bad in [
            "evil.example",
            "evil.example:9797",
            "localhost.evil.example",
            "127.0.0.1.evil.example",
            "10.0.0.1:9797",
            "[::2]:1",
            "",
        ] {
            assert!(!loopback(bad), "{bad}");
        }
    }

    /// The report role: its own token, or the ingest or admin token; without a token
    /// of its own, the ingest token's; and the report token opens nothing else.
    #[test]
    fn reports_take_their_own_token_or_the_ingest_one() {
        let all = |report: Option<&str>| {
            Tokens::new(Some("in".into()), Some("ad".into()), Some("rd".into()))
                .with_report(report.map(Into::into))
        };
        let t = all(Some("rp"));
        for ok in ["rp", "in", "ad"] {
            assert!(t.check(Role::Report, &bearer(ok)).is_ok(), "{ok}");
        }
        assert!(t.check(Role::Report, &bearer("rd")).is_err());
        assert!(t.check(Role::Report, &HeaderMap::new()).is_err());
        for role in [Role::Ingest, Role::Admin, Role::Read] {
            assert!(
                t.check(role, &bearer("rp")).is_err(),
                "the report token is no {role:?} token"
            );
        }
        assert!(t.open_roles().is_empty());

        let t = all(None);
        assert!(t.check(Role::Report, &bearer("in")).is_ok());
        assert!(t.check(Role::Report, &bearer("rp")).is_err());
        assert!(
            t.open_roles().is_empty(),
            "without its own token, report is as closed as ingest"
        );
        let open = Tokens::new(None, Some("ad".into()), Some("rd".into()));
        assert_eq!(open.open_roles(), [Role::Ingest, Role::Report]);
    }

    #[test]
    fn roles_and_admin_fallback() {
        let t = Tokens::new(Some("in".into()), Some("ad".into()), None);
        assert!(t.check(Role::Ingest, &bearer("in")).is_ok());
        assert!(
            t.check(Role::Ingest, &bearer("ad")).is_ok(),
            "admin works everywhere"
        );
        assert!(
            t.check(Role::Admin, &bearer("in")).is_err(),
            "ingest is not admin"
        );
        assert!(t.check(Role::Ingest, &HeaderMap::new()).is_err());
        assert!(t.check(Role::Ingest, &bearer("inx")).is_err());
        assert!(
            t.check(Role::Read, &HeaderMap::new()).is_ok(),
            "read has no token: open"
        );
        assert_eq!(t.open_roles(), vec![Role::Read]);
    }

    #[test]
    fn debug_never_shows_tokens() {
        let t = Tokens::new(Some("s3cret".into()), None, None);
        let shown = format!("{t:?}");
        assert!(
            !shown.contains("s3cret") && shown.contains("set"),
            "{shown}"
        );
    }
}
