//! The applied route table, with its blocks indexed by the endpoint they name, so that
//! checking whether a candidate is blocked costs two lookups, whatever the number of
//! blocks in the table.

use std::collections::HashMap;
use std::ops::Deref;
use std::sync::Arc;

use stanch_api::{RouteTable, Timestamp};

/// A route table as the gateway applies it. Derefs to the table.
#[derive(Debug)]
pub struct Applied {
    table: Arc<RouteTable>,
    /// Per endpoint named by a block: (the model, or every model; until).
    blocks: HashMap<String, Vec<(Option<String>, Timestamp)>>,
}

impl Applied {
    /// Indexes `table`'s blocks: once per table, on its first use.
    pub fn new(table: Arc<RouteTable>) -> Applied {
        let mut blocks: HashMap<String, Vec<(Option<String>, Timestamp)>> = HashMap::new();
        for b in &table.blocked {
            blocks
                .entry(b.endpoint.clone())
                .or_default()
                .push((b.model.clone(), b.until));
        }
        Applied { table, blocks }
    }

    /// The table as received.
    pub fn table(&self) -> &Arc<RouteTable> {
        &self.table
    }

    /// When the table's block on the endpoint at `url` serving `model` ends, if one
    /// holds at `now`. A block names the endpoint by any of its
    /// [`endpoint_names`](stanch_api::routes::endpoint_names).
    pub fn block_on(&self, url: &str, model: &str, now: Timestamp) -> Option<Timestamp> {
        stanch_api::routes::endpoint_names(url)
            .filter_map(|name| self.blocks.get(name))
            .flatten()
            .filter(|(m, until)| *until > now && m.as_deref().is_none_or(|m| m == model))
            .map(|(_, until)| *until)
            .min()
    }
}

impl Deref for Applied {
    type Target = RouteTable;

    fn deref(&self) -> &RouteTable {
        &self.table
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use stanch_api::BlockedEndpoint;

    use super::*;

    /// The scan the index replaces: every block of the table, against the endpoint.
    fn scanned(table: &RouteTable, url: &str, model: &str, now: Timestamp) -> Option<Timestamp> {
        table
            .blocked
            .iter()
            .filter(|b| b.until > now && b.model.as_deref().is_none_or(|m| m == model))
            .filter(|b| {
                url == b.endpoint
                    || url
                        .strip_suffix(b.endpoint.as_str())
                        .is_some_and(|scheme| scheme.ends_with("//"))
            })
            .map(|b| b.until)
            .min()
    }

    fn name() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("http://a:1".to_owned()),
            Just("a:1".to_owned()),
            Just("https://a:1".to_owned()),
            Just("http://b:1//a:1".to_owned()),
            Just("b:1//a:1".to_owned()),
            Just(":1".to_owned()),
            Just("//a:1".to_owned()),
            "[ab:/]{0,8}",
        ]
    }

    proptest! {
        /// The index answers as the scan does, for any table and endpoint.
        #[test]
        fn the_index_answers_as_a_scan_of_the_blocks(
            blocks in prop::collection::vec(
                (name(), prop::option::of(prop_oneof![Just("m"), Just("n")]), 0i64..10),
                0..12,
            ),
            url in name(),
            model in prop_oneof![Just("m"), Just("n")],
            now in 0i64..10,
        ) {
            let table = RouteTable {
                version: 1,
                epoch: "e".into(),
                hash: String::new(),
                generated_at: Timestamp::from_millis(0),
                models: Default::default(),
                blocked: blocks
                    .into_iter()
                    .map(|(endpoint, model, until)| BlockedEndpoint {
                        endpoint,
                        model: model.map(str::to_owned),
                        until: Timestamp::from_millis(until),
                        reason: String::new(),
                    })
                    .collect(),
            };
            let now = Timestamp::from_millis(now);
            let expected = scanned(&table, &url, model, now);
            let applied = Applied::new(Arc::new(table));
            prop_assert_eq!(applied.block_on(&url, model, now), expected);
        }
    }
}
