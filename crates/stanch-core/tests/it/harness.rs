//! A tiny scenario language for the engine, and fixture builders with fixed times.
//!
//! A scenario file is an optional YAML configuration, a line `---`, then one input per
//! line, each at an absolute offset from a fixed t0:
//!
//! ```text
//! at 0s    fire HighErrors action=trigger-failover target_model=qwen-72b pool=dc-a
//! at 20s   resolve HighErrors          (fire takes started=OFFSET for a fixed startsAt)
//! at 20s   define Missed labels...     (an alert whose notification was lost)
//! at 20s   resolve NAME ended=OFFSET   (a resolution with its endsAt; started= too)
//! at 20s   push KV ends=+30s action=trigger-model-degradation target_model=qwen-72b
//! at 30s   force qwen-72b static ttl=5m reason=drill
//! at 40s   release qwen-72b | freeze [model] | thaw [model] | block EP [model] | unblock EP [model]
//! at 40s   failback qwen-72b skip|abort reason=...
//! at 40s   unblock-all | dry-run on|off | reconcile NAME... | tick
//! at 50s   report GATEWAY ENDPOINT model=M ok=N fail=N streak=N
//! at 60s   configure YAML...           (the whole configuration from now on, in flow style)
//! run until 10m        (ticks at every wake-up the engine asks for, as the server does)
//! show                 (the route table as it is now)
//! ```
//!
//! The output lists every decision (lease renewals left out) with its offset, then the
//! final route table per model.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::time::Duration;

use stanch_api::alerts::{AlertSource, AlertStatus, IncomingAlert};
use stanch_api::{Fingerprint, HumanDuration, Labels, Timestamp};
use stanch_core::{Command, Config, Decision, Engine, Input};

/// 2026-11-30T00:00:00Z: every scenario starts here.
pub const T0: Timestamp = Timestamp::from_millis(1_796_083_200_000 - 86_400_000);

/// The default configuration with jitter off, so block times are exact.
pub fn base_config() -> Config {
    let mut config = Config::default_config();
    config.blocking.jitter = 0.0;
    config
}

/// A fresh engine at T0.
pub fn engine(config: Config) -> Engine {
    let mut e = Engine::new(config, Engine::fresh_state("test-epoch".into(), T0), T0);
    e.step(Input::Tick, T0);
    e
}

/// Builds alerts with fixed times.
#[derive(Debug, Clone)]
pub struct AlertBuilder {
    labels: Labels,
    annotations: Labels,
    starts_at: Timestamp,
    ends_at: Option<Timestamp>,
    status: AlertStatus,
    source: AlertSource,
}

impl AlertBuilder {
    /// An Alertmanager alert named `name`, firing.
    pub fn firing(name: &str) -> AlertBuilder {
        let mut labels = Labels::new();
        labels.insert("alertname".into(), name.into());
        AlertBuilder {
            labels,
            annotations: Labels::new(),
            starts_at: T0,
            ends_at: None,
            status: AlertStatus::Firing,
            source: AlertSource::Alertmanager,
        }
    }

    /// Adds a label.
    pub fn label(mut self, k: &str, v: &str) -> Self {
        self.labels.insert(k.into(), v.into());
        self
    }

    /// Adds an annotation.
    pub fn annotation(mut self, k: &str, v: &str) -> Self {
        self.annotations.insert(k.into(), v.into());
        self
    }

    /// Sets the start.
    pub fn at(mut self, t: Timestamp) -> Self {
        self.starts_at = t;
        self
    }

    /// Makes it a Prometheus push ending at `t`.
    pub fn pushed_until(mut self, t: Timestamp) -> Self {
        self.source = AlertSource::Prometheus;
        self.ends_at = Some(t);
        self
    }

    /// Sets the end.
    pub fn ended(mut self, t: Timestamp) -> Self {
        self.ends_at = Some(t);
        self
    }

    /// Makes it a resolved notification.
    pub fn resolved(mut self) -> Self {
        self.status = AlertStatus::Resolved;
        self
    }

    /// The alert.
    pub fn build(self) -> IncomingAlert {
        IncomingAlert {
            fingerprint: Fingerprint::of(&self.labels),
            status: self.status,
            labels: self.labels,
            annotations: self.annotations,
            starts_at: self.starts_at,
            ends_at: self.ends_at,
            source: self.source,
        }
    }
}

fn offset(raw: &str) -> Duration {
    raw.parse::<HumanDuration>()
        .unwrap_or_else(|e| panic!("{raw}: {e}"))
        .0
}

fn rel(now: Timestamp) -> String {
    let d = now.since(T0);
    if d.subsec_millis() == 0 {
        format!("{}s", d.as_secs())
    } else {
        format!("{}ms", d.as_millis())
    }
}

/// Runs a scenario and renders what happened.
pub fn run(text: &str) -> String {
    let (config_text, script) = text.split_once("---\n").unwrap_or(("", text));
    let mut config = base_config();
    let has_config = config_text
        .lines()
        .any(|l| !l.trim().is_empty() && !l.trim_start().starts_with('#'));
    if has_config {
        config = Config::from_yaml(config_text).unwrap_or_else(|e| panic!("scenario config: {e}"));
    }
    let mut engine = engine(config);
    let mut now = T0;
    let mut out = String::new();
    let mut fired: BTreeMap<String, AlertBuilder> = BTreeMap::new();
    let record = |out: &mut String, at: Timestamp, decisions: Vec<Decision>| {
        for d in decisions {
            if matches!(
                d,
                Decision::Published {
                    lease_renewal: true,
                    ..
                }
            ) {
                continue;
            }
            writeln!(out, "{:>6}  {}", rel(at), d).unwrap();
        }
    };
    for line in script
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
    {
        let words: Vec<&str> = line.split_whitespace().collect();
        if words == ["show"] {
            writeln!(out, "-- routes (version {})", engine.route_table().version).unwrap();
            routes(&mut out, &engine);
            continue;
        }
        if let ["run", "until", t] = words.as_slice() {
            let end = T0 + offset(t);
            while let Some(wake) = engine.next_wakeup().filter(|w| *w <= end) {
                now = wake.max(now);
                let step = engine.step(Input::Tick, now);
                record(&mut out, now, step.decisions);
            }
            now = end;
            let step = engine.step(Input::Tick, now);
            record(&mut out, now, step.decisions);
            continue;
        }
        let ["at", t, verb, rest @ ..] = words.as_slice() else {
            panic!("bad line: {line}")
        };
        now = T0 + offset(t);
        let kv = |w: &str| w.split_once('=').map(|(k, v)| (k.to_owned(), v.to_owned()));
        let named: BTreeMap<String, String> = rest.iter().filter_map(|w| kv(w)).collect();
        let positional: Vec<&str> = rest.iter().copied().filter(|w| !w.contains('=')).collect();
        let reason = named
            .get("reason")
            .cloned()
            .unwrap_or_else(|| "scenario".into());
        let ttl = named.get("ttl").map(|t| HumanDuration(offset(t)));
        let model = positional.get(1).map(|m| m.to_string());
        let input = match *verb {
            "fire" | "push" | "define" => {
                let started = named.get("started").map_or(now, |s| T0 + offset(s));
                let mut b = AlertBuilder::firing(positional[0]).at(started);
                for (k, v) in named
                    .iter()
                    .filter(|(k, _)| *k != "ends" && *k != "started")
                {
                    b = b.label(k, v);
                }
                if *verb == "push" {
                    b = b.pushed_until(now + offset(named["ends"].trim_start_matches('+')));
                }
                fired.insert(positional[0].to_owned(), b.clone());
                if *verb == "define" {
                    // Known to Alertmanager, but its notification never reached us.
                    continue;
                }
                Input::Alerts {
                    alerts: vec![b.build()],
                }
            }
            "resolve" => {
                let b = fired
                    .get(positional[0])
                    .unwrap_or_else(|| panic!("{} never fired", positional[0]));
                let mut b = b.clone().resolved();
                if let Some(start) = named.get("started") {
                    b = b.at(T0 + offset(start));
                }
                if let Some(end) = named.get("ended") {
                    b = b.ended(T0 + offset(end));
                }
                Input::Alerts {
                    alerts: vec![b.build()],
                }
            }
            "reconcile" => Input::Reconcile {
                alerts: positional
                    .iter()
                    .map(|n| fired[*n].clone().build())
                    .collect(),
                as_of: now,
            },
            "tick" => Input::Tick,
            "configure" => Input::Configure {
                config: Box::new(
                    Config::from_yaml(&rest.join(" ")).unwrap_or_else(|e| panic!("configure: {e}")),
                ),
            },
            "report" => {
                let num = |k: &str| named.get(k).map_or(0, |v| v.parse::<u64>().unwrap());
                Input::Reports {
                    gateway: positional[0].into(),
                    endpoints: vec![stanch_api::reports::EndpointReport {
                        endpoint: positional[1].into(),
                        model: named["model"].clone(),
                        successes: num("ok"),
                        failures: num("fail"),
                        consecutive_failures: num("streak") as u32,
                    }],
                }
            }
            "force" => Input::Command {
                command: Command::Force {
                    model: positional[0].into(),
                    rung: positional[1].parse().unwrap(),
                    ttl,
                    reason,
                },
            },
            "release" => Input::Command {
                command: Command::Release {
                    model: positional[0].into(),
                    reason,
                },
            },
            "failback" => Input::Command {
                command: Command::Failback {
                    model: positional[0].into(),
                    order: match positional[1] {
                        "skip" => stanch_api::admin::FailbackAction::Skip,
                        "abort" => stanch_api::admin::FailbackAction::Abort,
                        other => panic!("failback {other}: skip or abort"),
                    },
                    reason,
                },
            },
            "freeze" => Input::Command {
                command: Command::Freeze {
                    model: positional.first().map(|m| m.to_string()),
                    ttl,
                    reason,
                },
            },
            "thaw" => Input::Command {
                command: Command::Thaw {
                    model: positional.first().map(|m| m.to_string()),
                    reason,
                },
            },
            "block" => Input::Command {
                command: Command::Block {
                    endpoint: positional[0].into(),
                    model,
                    ttl,
                    reason,
                },
            },
            "unblock" => Input::Command {
                command: Command::Unblock {
                    endpoint: positional[0].into(),
                    model,
                    reason,
                },
            },
            "unblock-all" => Input::Command {
                command: Command::UnblockAll { reason },
            },
            "dry-run" => Input::Command {
                command: Command::DryRun {
                    enabled: positional[0] == "on",
                    reason,
                },
            },
            other => panic!("unknown verb {other}"),
        };
        if let Input::Command { command } = &input
            && let Err(e) = engine.check_command(command)
        {
            writeln!(out, "{:>6}  refused: {e}", rel(now)).unwrap();
            continue;
        }
        let step = engine.step(input, now);
        record(&mut out, now, step.decisions);
    }
    writeln!(
        out,
        "-- final routes (version {})",
        engine.route_table().version
    )
    .unwrap();
    routes(&mut out, &engine);
    out
}

/// The route table as the output shows it: a line per model, then per block.
fn routes(out: &mut String, engine: &Engine) {
    let table = engine.route_table();
    for (name, m) in &table.models {
        writeln!(
            out,
            "{name}: {} pool={}{} alias={} faq={} since={}{}",
            m.rung,
            m.pool,
            if m.shares.is_empty() {
                String::new()
            } else {
                let shares: Vec<_> = m
                    .shares
                    .iter()
                    .map(|s| format!("{}:{}%", s.pool, s.percent))
                    .collect();
                format!(" shares={}", shares.join(","))
            },
            match (m.alias.as_deref(), m.alias_percent) {
                (Some(a), Some(p)) => format!("{a}:{p}%"),
                (a, _) => a.unwrap_or("-").to_owned(),
            },
            m.faq.as_deref().unwrap_or("-"),
            rel(m.since),
            if m.overridden { " overridden" } else { "" }
        )
        .unwrap();
    }
    for b in &table.blocked {
        writeln!(
            out,
            "blocked {} for {} until {}",
            b.endpoint,
            b.model.as_deref().unwrap_or("all"),
            rel(b.until)
        )
        .unwrap();
    }
}
