//! Tables for humans. Every value from outside (an alert's label, a reason, a
//! gateway's name) is printed as text: a control character in it is written as an
//! escape, so it cannot drive the terminal or start a line of its own.

use std::borrow::Cow;
use std::fmt::Write as _;

use serde::Serialize;
use stanch_api::status::{HistoryEntry, StatusReport};
use stanch_api::{ModelRoute, RouteTable, Timestamp};

/// `s` with every control character written as an escape (`\n`, `\u{1b}`): a value
/// from outside (an alert's label, a reason, a gateway's name) stays on its own line
/// of the output, as text.
pub(crate) fn printable(s: &str) -> Cow<'_, str> {
    if !s.chars().any(char::is_control) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

pub(crate) fn json<T: Serialize>(value: &T) -> String {
    serde_json::to_string_pretty(value).unwrap_or_default() + "\n"
}

/// Renders rows as aligned columns, each cell on its row whatever it holds.
pub(crate) fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let rows: Vec<Vec<Cow<'_, str>>> = rows
        .iter()
        .map(|row| row.iter().map(|cell| printable(cell)).collect())
        .collect();
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in &rows {
        for (i, cell) in row.iter().enumerate() {
            widths[i] = widths[i].max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let line = |out: &mut String, cells: Vec<&str>| {
        let last = cells.len() - 1;
        for (i, cell) in cells.iter().enumerate() {
            if i == last {
                out.push_str(cell);
            } else {
                write!(out, "{cell:<w$}  ", w = widths[i]).ok();
            }
        }
        out.push('\n');
    };
    line(&mut out, header.to_vec());
    for row in &rows {
        line(&mut out, row.iter().map(|c| c.as_ref()).collect());
    }
    out
}

fn ago(now: Timestamp, t: Timestamp) -> String {
    format!("{} ago", duration(now.since(t).as_secs()))
}

fn duration(secs: u64) -> String {
    match secs {
        0..60 => format!("{secs}s"),
        60..3600 => format!("{}m{}s", secs / 60, secs % 60),
        _ => format!("{}h{}m", secs / 3600, (secs % 3600) / 60),
    }
}

/// `stanch ctl status`: the header, then a table of models, of the alerts behind
/// them, of blocks and of gateways, each left out when empty.
pub(crate) fn render_status(s: &StatusReport) -> String {
    let mut out = status_header(s);
    out.push('\n');
    out.push_str(&models_table(s));
    for part in [conditions_table(s), blocks_table(s), gateways_table(s)]
        .into_iter()
        .flatten()
    {
        out.push('\n');
        out.push_str(&part);
    }
    writeln!(
        out,
        "\n{} active alert(s), {} unmapped",
        s.alerts.active, s.alerts.unmapped
    )
    .ok();
    out
}

fn status_header(s: &StatusReport) -> String {
    let mut out = String::new();
    writeln!(
        out,
        "route version {} (epoch {}), store {}{}",
        s.version,
        s.epoch,
        s.store.kind,
        if s.store.healthy { "" } else { " FAILING" }
    )
    .ok();
    if let Some(why) = &s.store.recovered_from_corruption {
        writeln!(
            out,
            "WARNING: state was unreadable at start and began anew: {why}"
        )
        .ok();
    }
    if let Some(d) = &s.dry_run {
        let reason = printable(&d.reason);
        writeln!(out, "DRY-RUN since {}: {reason}", ago(s.now, d.since)).ok();
    }
    if let Some(f) = &s.global_freeze {
        writeln!(
            out,
            "FROZEN (all models) since {}: {}",
            ago(s.now, f.since),
            printable(&f.reason)
        )
        .ok();
    }
    out
}

fn models_table(s: &StatusReport) -> String {
    let rows: Vec<Vec<String>> = s
        .models
        .iter()
        .map(|(name, m)| {
            let mut flags = Vec::new();
            if let Some(f) = &m.force {
                flags.push(format!("forced({})", f.info.reason));
            }
            if m.freeze.is_some() {
                flags.push("frozen".to_owned());
            }
            if let Some(p) = &m.pinned {
                flags.push(format!("flap-pinned≥{}", p.rung));
            }
            if m.decided_rung != m.rung {
                flags.push(format!("would be {}", m.decided_rung));
            }
            vec![
                name.clone(),
                m.rung.to_string(),
                m.pool.clone(),
                m.alias.clone().unwrap_or_else(|| "-".into()),
                ago(s.now, m.since),
                if flags.is_empty() {
                    "-".into()
                } else {
                    flags.join(" ")
                },
                m.step_down.map_or("-".into(), |d| {
                    format!("{} in {}", d.to, duration(d.at.since(s.now).as_secs()))
                }),
                m.reason.clone(),
            ]
        })
        .collect();
    table(
        &[
            "MODEL",
            "RUNG",
            "POOL",
            "ALIAS",
            "SINCE",
            "OVERRIDES",
            "STEPS DOWN",
            "REASON",
        ],
        &rows,
    )
}

fn conditions_table(s: &StatusReport) -> Option<String> {
    let conditions: Vec<Vec<String>> = s
        .models
        .iter()
        .flat_map(|(name, m)| {
            m.conditions.iter().map(move |c| {
                let labels: Vec<String> = c
                    .labels
                    .iter()
                    .filter(|(k, _)| k.as_str() != "alertname")
                    .map(|(k, v)| format!("{k}={v:?}"))
                    .collect();
                vec![
                    name.clone(),
                    c.alertname
                        .clone()
                        .unwrap_or_else(|| c.fingerprint.to_string()),
                    ago(s.now, c.starts_at),
                    c.effect.clone(),
                    labels.join(","),
                ]
            })
        })
        .collect();
    (!conditions.is_empty()).then(|| {
        table(
            &["MODEL", "ALERT", "STARTED", "MEANS", "LABELS"],
            &conditions,
        )
    })
}

fn blocks_table(s: &StatusReport) -> Option<String> {
    if s.blocked.is_empty() {
        return None;
    }
    let rows: Vec<Vec<String>> = s
        .blocked
        .iter()
        .map(|b| {
            vec![
                b.endpoint.clone(),
                b.model.clone().unwrap_or_else(|| "(all)".into()),
                b.source.as_str().to_owned(),
                format!("{}s", b.seconds_left),
                b.strikes.to_string(),
                b.reason.clone(),
            ]
        })
        .collect();
    Some(table(
        &[
            "BLOCKED ENDPOINT",
            "MODEL",
            "SOURCE",
            "LEFT",
            "STRIKES",
            "REASON",
        ],
        &rows,
    ))
}

fn gateways_table(s: &StatusReport) -> Option<String> {
    if s.gateways.is_empty() {
        return None;
    }
    let rows: Vec<Vec<String>> = s
        .gateways
        .iter()
        .map(|g| {
            let state = if g.stale {
                "STALE"
            } else if g.converged {
                "converged"
            } else {
                "BEHIND"
            };
            vec![
                g.id.clone(),
                g.transport.as_str().to_owned(),
                g.applied_version.map_or("-".into(), |v| v.to_string()),
                g.lag.map_or("-".into(), |l| l.to_string()),
                state.to_owned(),
                if g.connected {
                    "connected".into()
                } else {
                    format!("{}s ago", g.age_seconds)
                },
                g.rejected
                    .as_ref()
                    .map_or("-".into(), |(v, why)| format!("v{v}: {why}")),
            ]
        })
        .collect();
    Some(table(
        &[
            "GATEWAY",
            "TRANSPORT",
            "APPLIED",
            "LAG",
            "STATE",
            "LAST SEEN",
            "LAST NACK",
        ],
        &rows,
    ))
}

pub(crate) fn render_history(entries: &[HistoryEntry]) -> String {
    let rows: Vec<Vec<String>> = entries
        .iter()
        .map(|e| {
            vec![
                e.seq.to_string(),
                e.at.to_string(),
                e.kind.clone(),
                if e.dry_run {
                    format!("(dry-run) {}", e.summary)
                } else {
                    e.summary.clone()
                },
            ]
        })
        .collect();
    table(&["SEQ", "AT", "KIND", "WHAT"], &rows)
}

pub(crate) fn render_routes(t: &RouteTable) -> String {
    let mut out = format!(
        "version {} epoch {} hash {} generated {}\n\n",
        t.version, t.epoch, t.hash, t.generated_at
    );
    let rows: Vec<Vec<String>> = t
        .models
        .iter()
        .map(|(name, m)| {
            vec![
                name.clone(),
                m.rung.to_string(),
                pools_cell(m),
                alias_cell(m),
                m.faq.clone().unwrap_or_else(|| "-".into()),
                m.lease_until.to_string(),
            ]
        })
        .collect();
    out.push_str(&table(
        &["MODEL", "RUNG", "POOL", "ALIAS", "FAQ", "LEASE UNTIL"],
        &rows,
    ));
    for b in &t.blocked {
        writeln!(
            out,
            "blocked {} ({}) until {}: {}",
            printable(&b.endpoint),
            b.model.as_deref().unwrap_or("all"),
            b.until,
            printable(&b.reason)
        )
        .ok();
    }
    out
}

/// Where a model's own traffic goes: its pool, or each pool's share while it is split
/// (`dc-a 25% dc-b 75%`).
fn pools_cell(m: &ModelRoute) -> String {
    if m.shares.is_empty() {
        return m.pool.clone();
    }
    m.shares
        .iter()
        .map(|s| format!("{} {}%", s.pool, s.percent))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Where non-VIP traffic goes: the alias, with its percentage while it moves in steps.
fn alias_cell(m: &ModelRoute) -> String {
    match (&m.alias, m.alias_percent) {
        (None, _) => "-".into(),
        (Some(alias), None) => alias.clone(),
        (Some(alias), Some(p)) => format!("{alias} {p}%"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_split_shows_each_pool_s_share_and_the_alias_s_percentage() {
        let route = |split: serde_json::Value| -> ModelRoute {
            let mut entry = serde_json::json!({"rung": "degraded", "pool": "dc-b",
                "alias": "qwen-14b", "faq": null, "since": "2026-12-07T00:00:00Z",
                "lease_until": "2026-12-07T00:02:00Z", "reason": "", "overridden": false});
            entry
                .as_object_mut()
                .unwrap()
                .extend(split.as_object().unwrap().clone());
            serde_json::from_value(entry).unwrap()
        };
        let whole = route(serde_json::json!({}));
        assert_eq!(
            (pools_cell(&whole), alias_cell(&whole)),
            ("dc-b".into(), "qwen-14b".into())
        );
        let split = route(serde_json::json!({"alias_percent": 50,
            "shares": [{"pool": "dc-a", "percent": 25}, {"pool": "dc-b", "percent": 75}]}));
        assert_eq!(pools_cell(&split), "dc-a 25% dc-b 75%");
        assert_eq!(alias_cell(&split), "qwen-14b 50%");
        let none = route(serde_json::json!({"alias": null}));
        assert_eq!(alias_cell(&none), "-");
    }
}
