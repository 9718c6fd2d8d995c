//! `Input::Configure`: a new policy put in force, the state fitted to it.

use stanch_api::Timestamp;

use super::{Engine, fleet};
use crate::config::Config;
use crate::decision::Decision;
use crate::mapping::Mapper;
use crate::state::{EngineState, ModelState};

impl Engine {
    /// Puts `config` in force. Models it no longer has leave the table; new ones start
    /// on the normal rung; a model whose active pool is gone starts over on the normal
    /// rung in its new primary (and the evaluation that follows escalates it at once
    /// if its alerts say so); every other model keeps its place, and moves by its new
    /// timings from now. Alerts are mapped again under the new rules.
    pub(super) fn configure(&mut self, config: Config, now: Timestamp, out: &mut Vec<Decision>) {
        let mapper = Mapper::new(&config);
        let fitted = fit(&mut self.state, &config, &mapper, now);
        self.state.config = Some(Box::new(config.clone()));
        self.topology = fleet::Topology::of(&config);
        self.config = config;
        self.mapper = mapper;
        out.push(Decision::Configured {
            added: fitted.added,
            removed: fitted.removed,
            reset: fitted.reset,
        });
    }
}

/// What fitting the state to a configuration changed.
pub(super) struct Fitted {
    added: Vec<String>,
    removed: Vec<String>,
    reset: Vec<String>,
}

/// Fits `state` to `config`: models it no longer has are dropped, new ones start
/// healthy, one whose active pool is gone starts over in its primary; alerts are
/// mapped again under `mapper`.
pub(super) fn fit(
    state: &mut EngineState,
    config: &Config,
    mapper: &Mapper,
    now: Timestamp,
) -> Fitted {
    let mut fitted = Fitted {
        added: Vec::new(),
        removed: Vec::new(),
        reset: Vec::new(),
    };
    state.models.retain(|name, _| {
        let kept = config.models.contains_key(name);
        if !kept {
            fitted.removed.push(name.clone());
        }
        kept
    });
    for (name, model) in &config.models {
        let primary = model.pools.first().map(|p| p.name()).unwrap_or_default();
        match state.models.get_mut(name) {
            None => {
                state
                    .models
                    .insert(name.clone(), ModelState::new(primary, now));
                fitted.added.push(name.clone());
            }
            // A model whose pool, or a pool of its split, is gone starts over.
            Some(st)
                if !model.pools.iter().any(|p| p.name() == st.pool)
                    || st
                        .shares
                        .iter()
                        .any(|s| !model.pools.iter().any(|p| p.name() == s.pool)) =>
            {
                *st = ModelState::new(primary, now);
                fitted.reset.push(name.clone());
            }
            Some(_) => {}
        }
    }
    for record in state.alerts.values_mut() {
        let mapped = mapper.map(&record.alert.labels);
        record.unmapped = mapped.as_ref().err().map(|u| u.0.clone());
        record.condition = mapped.ok();
    }
    fitted
}
