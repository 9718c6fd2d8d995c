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
