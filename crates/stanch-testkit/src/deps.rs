//! The dependency graph as `cargo metadata` resolves it, for tests that hold the
//! crates to their layers: what the pure core, an adapter or a shipped binary is
//! built with, followed through every crate, not only its own manifest.
//!
//! The walk follows the workspace's resolved graph, whose features are unified across
//! every member: it may see an edge that one package alone would not build, never
//! miss one it would.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use serde_json::Value;

/// The workspace's resolved dependency graph, as `cargo metadata` prints it.
pub struct Graph {
    packages: BTreeMap<String, Value>,
    nodes: BTreeMap<String, Value>,
}

impl Graph {
    /// The graph of the workspace, resolved for Linux on x86-64 with the workspace's
    /// default features and `features` (`stanch/demo`).
    pub fn load(features: &[&str]) -> Graph {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let features = features.join(",");
        let out = Command::new(cargo)
            .current_dir(&root)
            .args(["metadata", "--format-version", "1", "--locked", "--offline"])
            .args(["--filter-platform", "x86_64-unknown-linux-gnu"])
            .args(if features.is_empty() {
                vec![]
            } else {
                vec!["--features", &features]
            })
            .output()
            .expect("cargo runs");
        assert!(
            out.status.success(),
            "cargo metadata: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let metadata: Value = serde_json::from_slice(&out.stdout).expect("metadata is JSON");
        let by_id = |list: &Value| -> BTreeMap<String, Value> {
            list.as_array()
                .expect("a list")
                .iter()
                .map(|v| (v["id"].as_str().expect("an id").to_owned(), v.clone()))
                .collect()
        };
        Graph {
            packages: by_id(&metadata["packages"]),
            nodes: by_id(&metadata["resolve"]["nodes"]),
        }
    }

    /// The name of the package `id`.
    pub fn name(&self, id: &str) -> &str {
        self.packages[id]["name"].as_str().expect("a name")
    }

    fn id_of(&self, name: &str) -> &str {
        self.packages
            .iter()
            .find(|(_, p)| p["name"] == name)
            .map(|(id, _)| id.as_str())
            .unwrap_or_else(|| panic!("{name} is in the workspace"))
    }

    /// Every package `root` is built with, by normal dependencies, keyed by package
    /// id, with the path by which it is reached (for failure messages).
    pub fn normal_closure(&self, root: &str) -> BTreeMap<String, Vec<String>> {
        let root = self.id_of(root).to_owned();
        let mut seen = BTreeMap::from([(root.clone(), vec![self.name(&root).to_owned()])]);
        let mut queue = vec![root];
        while let Some(id) = queue.pop() {
            let path = seen[&id].clone();
            for dep in self.nodes[&id]["deps"].as_array().expect("deps") {
                let normal = dep["dep_kinds"]
                    .as_array()
                    .expect("dep kinds")
                    .iter()
                    .any(|k| k["kind"].is_null());
                let to = dep["pkg"].as_str().expect("a package id").to_owned();
                if normal && !seen.contains_key(&to) {
                    let mut via = path.clone();
                    via.push(self.name(&to).to_owned());
                    seen.insert(to.clone(), via);
                    queue.push(to);
                }
            }
        }
        seen
    }

    /// The paths to packages in `closure` that ask for chrono's clock: by the feature, by
    /// chrono's default features (which include it), or through a feature of their own.
    pub fn chrono_clock_askers(&self, closure: &BTreeMap<String, Vec<String>>) -> Vec<String> {
        let mut askers = Vec::new();
        for id in closure.keys() {
            let package = &self.packages[id];
            let declared = package["dependencies"].as_array().expect("dependencies");
            let asks_directly = declared.iter().any(|d| {
                d["name"] == "chrono"
                    && d["kind"].is_null()
                    && (d["uses_default_features"] == true
                        || d["features"]
                            .as_array()
                            .expect("features")
                            .iter()
                            .any(|f| f == "clock" || f == "now"))
            });
            let asks_by_feature = package["features"]
                .as_object()
                .expect("features")
                .values()
                .flat_map(|enables| enables.as_array().expect("a list"))
                .filter_map(Value::as_str)
                .any(|f| matches!(f, "chrono/clock" | "chrono?/clock" | "chrono/now"));
            if asks_directly || asks_by_feature {
                askers.push(closure[id].join(" → "));
            }
        }
        askers
    }

    /// The names of the packages in `closure`.
    pub fn names<'a>(&'a self, closure: &BTreeMap<String, Vec<String>>) -> Vec<&'a str> {
        closure.keys().map(|id| self.name(id)).collect()
    }

    /// The paths in `closure` to a package named one of `names`, or whose name starts
    /// with one of them and a dash (`tokio` finds `tokio-util`).
    pub fn paths_to(&self, closure: &BTreeMap<String, Vec<String>>, names: &[&str]) -> Vec<String> {
        closure
            .iter()
            .filter(|(id, _)| {
                let name = self.name(id);
                names
                    .iter()
                    .any(|b| name == *b || name.starts_with(&format!("{b}-")))
            })
            .map(|(_, path)| path.join(" → "))
            .collect()
    }
}
