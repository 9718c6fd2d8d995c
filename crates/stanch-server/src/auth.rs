//! Bearer tokens per role, compared in constant time.
//!
//! Three roles: `ingest` (alerts and gateway reports), `admin` (overrides) and `read`
//! (routes, status, history). The admin token is accepted for every role. A role
//! without a token is open, which `serve` allows only on a loopback listener.

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
    /// Overrides.
    Admin,
    /// Routes, status, history.
    Read,
}

impl Role {
    /// Every role.
    pub const ALL: [Role; 3] = [Role::Ingest, Role::Admin, Role::Read];

    /// The role's name, as in `STANCH_<NAME>_TOKEN`.
    pub const fn name(self) -> &'static str {
        match self {
            Role::Ingest => "ingest",
            Role::Admin => "admin",
            Role::Read => "read",
        }
    }
}

/// The tokens in force. `Debug` never shows them.
#[derive(Clone, Default)]
pub struct Tokens {
    ingest: Option<SecretString>,
    admin: Option<SecretString>,
    read: Option<SecretString>,
}

impl fmt::Debug for Tokens {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let set = |t: &Option<SecretString>| if t.is_some() { "set" } else { "unset" };
        f.debug_struct("Tokens")
            .field("ingest", &set(&self.ingest))
            .field("admin", &set(&self.admin))
            .field("read", &set(&self.read))
            .finish()
    }
}

impl Tokens {
    /// Tokens from values; empty strings count as unset.
    pub fn new(ingest: Option<String>, admin: Option<String>, read: Option<String>) -> Tokens {
        let secret = |v: Option<String>| {
            v.map(|s| s.trim().to_owned())
                .filter(|s| !s.is_empty())
                .map(SecretString::from)
        };
        Tokens {
            ingest: secret(ingest),
            admin: secret(admin),
            read: secret(read),
        }
    }

    fn own(&self, role: Role) -> Option<&SecretString> {
        match role {
            Role::Ingest => self.ingest.as_ref(),
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
        if matches(own) || self.admin.as_ref().is_some_and(matches) {
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
