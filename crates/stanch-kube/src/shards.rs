//! State too large for one Kubernetes object, kept in several.
//!
//! An object's data is capped (a ConfigMap's at 1 MiB; etcd refuses a request over
//! 1.5 MiB by default), and a large incident's state (ten thousand alerts with their
//! labels) is several megabytes. A snapshot is therefore cut into shards of at most
//! [`MAX_SHARD_BYTES`], each a UTF-8 string cut at a character boundary, and a
//! [`Manifest`] lists them with their lengths and hashes. Writing is three steps, each
//! safe to crash after: write the new shards under the snapshot's sequence number (no
//! one reads them yet), switch the manifest to them with a `resourceVersion`
//! precondition (the one atomic step, and the fence a deposed leader fails), then
//! delete the shards no manifest names. Reading checks every shard against the
//! manifest: a missing or altered shard is corruption, never a silently partial
//! state. [`MAX_SHARDS`] caps the whole; a state larger than that is refused before
//! anything is written, so the last good snapshot stays.

use serde::{Deserialize, Serialize};
use stanch_api::hash::Fnv64;

/// The most bytes of state in one shard: under a ConfigMap's 1 MiB with room for its
/// metadata.
pub const MAX_SHARD_BYTES: usize = 900 * 1024;

/// The most shards one snapshot may take (about 28 MiB of state).
pub const MAX_SHARDS: usize = 32;

/// One shard's entry in the manifest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ShardRef {
    /// The object holding it.
    pub name: String,
    /// Its length in bytes.
    pub bytes: usize,
    /// FNV-1a of its bytes, as 16 hex digits.
    pub hash: String,
}

/// Which shards make up the snapshot in force.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Manifest {
    /// The journal sequence number the snapshot covers.
    pub seq: u64,
    /// Its shards, in order.
    pub shards: Vec<ShardRef>,
}

/// Why a snapshot cannot be cut or read back.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShardError {
    /// The state needs more than [`MAX_SHARDS`] shards.
    #[error("the state is {bytes} bytes: more than {MAX_SHARDS} shards of {MAX_SHARD_BYTES} bytes")]
    TooLarge {
        /// The state's size.
        bytes: usize,
    },
    /// A shard the manifest names is missing.
    #[error("shard {0} is missing")]
    Missing(String),
    /// A shard's content is not what the manifest says.
    #[error("shard {0} does not match the manifest")]
    Altered(String),
}

fn hash(text: &str) -> String {
    let mut h = Fnv64::default();
    h.write(text.as_bytes());
    format!("{:016x}", h.finish())
}

/// Cuts `state` into shards of at most `max` bytes (at character boundaries), named
/// `{prefix}-{seq}-{i}`: the shards to write, and the manifest that names them.
pub fn split(
    state: &str,
    seq: u64,
    prefix: &str,
    max: usize,
) -> Result<(Vec<(String, String)>, Manifest), ShardError> {
    let max = max.max(4);
    let mut shards = Vec::new();
    let mut rest = state;
    while !rest.is_empty() {
        let mut end = rest.len().min(max);
        while !rest.is_char_boundary(end) {
            end -= 1;
        }
        let (piece, after) = rest.split_at(end);
        shards.push(piece);
        rest = after;
    }
    if shards.len() > MAX_SHARDS {
        return Err(ShardError::TooLarge { bytes: state.len() });
    }
    let named: Vec<(String, String)> = shards
        .iter()
        .enumerate()
        .map(|(i, s)| (format!("{prefix}-{seq}-{i}"), (*s).to_owned()))
        .collect();
    let manifest = Manifest {
        seq,
        shards: named
            .iter()
            .map(|(name, s)| ShardRef {
                name: name.clone(),
                bytes: s.len(),
                hash: hash(s),
            })
            .collect(),
    };
    Ok((named, manifest))
}

/// The state `manifest` names, from the shards `get` finds by name, each checked.
pub fn join<'a>(
    manifest: &Manifest,
    get: impl Fn(&str) -> Option<&'a str>,
) -> Result<String, ShardError> {
    let mut state = String::with_capacity(manifest.shards.iter().map(|s| s.bytes).sum());
    for shard in &manifest.shards {
        let text = get(&shard.name).ok_or_else(|| ShardError::Missing(shard.name.clone()))?;
        if text.len() != shard.bytes || hash(text) != shard.hash {
            return Err(ShardError::Altered(shard.name.clone()));
        }
        state.push_str(text);
    }
    Ok(state)
}

/// The shards among `existing` that `manifest` does not name: left by a snapshot that
/// was replaced, or by one that crashed before its manifest was switched, and safe to
/// delete.
pub fn orphans<'a>(manifest: &Manifest, existing: &'a [String]) -> Vec<&'a str> {
    existing
        .iter()
        .filter(|name| !manifest.shards.iter().any(|s| s.name == **name))
        .map(String::as_str)
        .collect()
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// Any state, cut at any size, reads back the same; every shard is within the
        /// size, whole characters.
        #[test]
        fn any_state_reads_back_from_its_shards(state in "\\PC{0,100}", max in 16usize..64) {
            let (shards, manifest) = split(&state, 7, "stanch-state", max).unwrap();
            prop_assert!(shards.iter().all(|(_, s)| s.len() <= max && !s.is_empty()));
            let by_name: BTreeMap<&str, &str> =
                shards.iter().map(|(n, s)| (n.as_str(), s.as_str())).collect();
            let back = join(&manifest, |n| by_name.get(n).copied()).unwrap();
            prop_assert_eq!(back, state);
        }

        /// A shard altered in any way, or missing, is found: never a partial state.
        #[test]
        fn an_altered_or_missing_shard_is_found(state in "[a-z集]{20,200}", victim in 0usize..8, byte in any::<u8>()) {
            let (shards, manifest) = split(&state, 1, "s", 16).unwrap();
            let victim = victim % shards.len();
            let mut altered: BTreeMap<String, String> = shards.iter().cloned().collect();
            let name = shards[victim].0.clone();
            let mut text = altered[&name].clone().into_bytes();
            let at = usize::from(byte) % text.len();
            text[at] = text[at].wrapping_add(1) | 1;
            match String::from_utf8(text) {
                Ok(t) if t != altered[&name] => {
                    altered.insert(name.clone(), t);
                    let result = join(&manifest, |n| altered.get(n).map(String::as_str));
                    prop_assert_eq!(result, Err(ShardError::Altered(name.clone())));
                }
                _ => {}
            }
            let mut missing: BTreeMap<String, String> = shards.iter().cloned().collect();
            missing.remove(&name);
            let result = join(&manifest, |n| missing.get(n).map(String::as_str));
            prop_assert_eq!(result, Err(ShardError::Missing(name)));
        }
    }

    #[test]
    fn a_state_past_the_cap_is_refused_before_anything_is_written() {
        let state = "x".repeat(MAX_SHARDS * 10 + 1);
        assert_eq!(
            split(&state, 1, "s", 10),
            Err(ShardError::TooLarge { bytes: state.len() })
        );
        assert!(split(&"x".repeat(MAX_SHARDS * 10), 1, "s", 10).is_ok());
    }

    #[test]
    fn shards_no_manifest_names_are_orphans() {
        let (_, manifest) = split("abcdefgh", 9, "s", 4).unwrap();
        let existing = ["s-8-0", "s-9-0", "s-9-1", "s-10-0"].map(String::from);
        assert_eq!(orphans(&manifest, &existing), ["s-8-0", "s-10-0"]);
    }
}
