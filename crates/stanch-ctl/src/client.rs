//! The controller's HTTP API: status, history, routes, and the overrides.

use std::fmt::Write as _;

use serde::Serialize;
use serde::de::DeserializeOwned;
use stanch_api::admin::{
    AdminResponse, BlockRequest, DryRunRequest, FailbackRequest, ForceRequest, FreezeRequest,
    ReleaseRequest, ThawRequest, UnblockAllRequest, UnblockRequest,
};
use stanch_api::status::{HistoryEntry, StatusReport};
use stanch_api::{ErrorBody, RouteTable};

use crate::render::{json, printable, render_history, render_routes, render_status};
use crate::{CtlError, Output, OverrideCmd, ReadCmd, Toggle};

/// A blocking client of one controller.
pub(crate) struct Client {
    http: reqwest::blocking::Client,
    base: String,
    token: Option<String>,
}

/// An override, as the admin API takes it: the command's name, its path, its body.
struct Override {
    name: &'static str,
    path: String,
    body: serde_json::Value,
}

impl Client {
    pub(crate) fn new(server: &str, token: Option<String>) -> Result<Client, CtlError> {
        let http = reqwest::blocking::Client::builder()
            .timeout(std::time::Duration::from_secs(15))
            .build()
            .map_err(CtlError::Client)?;
        Ok(Client {
            http,
            base: server.trim_end_matches('/').to_owned(),
            token,
        })
    }

    /// Reads what `command` asks for; what to print.
    pub(crate) fn read(&self, command: ReadCmd, output: Output) -> Result<String, CtlError> {
        Ok(match command {
            ReadCmd::Status => {
                let status: StatusReport = self.get("/v1/status", &[])?;
                shown(output, &status, render_status)
            }
            ReadCmd::History { limit, model } => {
                let mut query = vec![("limit", limit.to_string())];
                query.extend(model.map(|m| ("model", m)));
                let entries: Vec<HistoryEntry> = self.get("/v1/history", &query)?;
                shown(output, &entries, |e| render_history(e))
            }
            ReadCmd::Routes => {
                let table: RouteTable = self.get("/v1/routes", &[])?;
                shown(output, &table, render_routes)
            }
        })
    }

    /// Asks for the override `command`; what it did, to print.
    pub(crate) fn apply(&self, command: OverrideCmd, output: Output) -> Result<String, CtlError> {
        let request = override_of(command);
        let response = self.post(&request.path, &request.body)?;
        Ok(shown(output, &response, |r| said(request.name, r)))
    }

    fn request(
        &self,
        req: reqwest::blocking::RequestBuilder,
    ) -> Result<reqwest::blocking::Response, CtlError> {
        let req = match &self.token {
            Some(t) => req.bearer_auth(t),
            None => req,
        };
        let response = req.send().map_err(|source| CtlError::Unreachable {
            base: self.base.clone(),
            source,
        })?;
        let status = response.status();
        if status.is_success() {
            return Ok(response);
        }
        Err(match response.json::<ErrorBody>() {
            Ok(body) => CtlError::Refused { status, body },
            Err(_) => CtlError::Status { status },
        })
    }

    fn get<T: DeserializeOwned>(
        &self,
        path: &str,
        query: &[(&str, String)],
    ) -> Result<T, CtlError> {
        let url = format!("{}{path}", self.base);
        self.request(self.http.get(url).query(query))?
            .json()
            .map_err(CtlError::UnexpectedAnswer)
    }

    fn post<B: Serialize>(&self, path: &str, body: &B) -> Result<AdminResponse, CtlError> {
        let url = format!("{}{path}", self.base);
        self.request(self.http.post(url).json(body))?
            .json()
            .map_err(CtlError::UnexpectedAnswer)
    }
}

/// The request for the override `command`: its name (the last part of its path under
/// `/v1/admin/`) and its body.
fn override_of(command: OverrideCmd) -> Override {
    let (name, body) = match command {
        OverrideCmd::Force {
            model,
            rung,
            ttl,
            reason,
        } => (
            "force",
            to_json(ForceRequest {
                model,
                rung,
                ttl,
                reason,
            }),
        ),
        OverrideCmd::Release { model, reason } => {
            ("release", to_json(ReleaseRequest { model, reason }))
        }
        OverrideCmd::Freeze { model, ttl, reason } => {
            ("freeze", to_json(FreezeRequest { model, ttl, reason }))
        }
        OverrideCmd::Thaw { model, reason } => ("thaw", to_json(ThawRequest { model, reason })),
        OverrideCmd::Failback {
            model,
            action,
            reason,
        } => (
            "failback",
            to_json(FailbackRequest {
                model,
                action,
                reason,
            }),
        ),
        OverrideCmd::Block {
            endpoint,
            model,
            ttl,
            reason,
        } => (
            "block",
            to_json(BlockRequest {
                endpoint,
                model,
                ttl,
                reason,
            }),
        ),
        OverrideCmd::Unblock {
            endpoint,
            model,
            reason,
        } => (
            "unblock",
            to_json(UnblockRequest {
                endpoint,
                model,
                reason,
            }),
        ),
        OverrideCmd::UnblockAll { reason } => {
            ("unblock-all", to_json(UnblockAllRequest { reason }))
        }
        OverrideCmd::DryRun { state, reason } => {
            let enabled = state == Toggle::On;
            ("dry-run", to_json(DryRunRequest { enabled, reason }))
        }
    };
    Override {
        name,
        path: format!("/v1/admin/{name}"),
        body,
    }
}

fn to_json(request: impl Serialize) -> serde_json::Value {
    serde_json::to_value(request).expect("request bodies are plain structs")
}

/// What an override did, for humans.
fn said(name: &str, r: &AdminResponse) -> String {
    let mut out = String::new();
    if !r.changed {
        writeln!(out, "{name}: nothing changed (already so)").ok();
    }
    for effect in &r.effects {
        writeln!(out, "{}", printable(effect)).ok();
    }
    writeln!(out, "route version {}", r.version).ok();
    out
}

/// `value` as the API's JSON, or as `table` renders it for humans.
fn shown<T: Serialize>(output: Output, value: &T, table: impl FnOnce(&T) -> String) -> String {
    match output {
        Output::Json => json(value),
        Output::Table => table(value),
    }
}
