//! `docs/ARCHITECTURE.md` cannot drift from the code: every crate, file path, module
//! and type it names in backticks exists.
//!
//! What counts as a name:
//! - `stanch-…`: a crate (`crates/stanch-…`, or the root package `stanch`);
//! - a path with a `/` (`crates/stanch-core/tests/it/purity.rs`, `tests/wire/`,
//!   `charts/stanch/crds/*.yaml`): a file or directory, from the repository's root, or
//!   from the crate the section is about (`### \`crates/…\``) or its `src/`; with a
//!   `*`, its folder;
//! - a type, or anything qualified with `::` (`Engine::step`, `store::fs::Fs`,
//!   `stanch_ports::control::Control`): every segment is defined in the workspace's
//!   Rust (a crate, module, type, trait, function, constant, field or variant, a
//!   resource kind a derive names, or a name the code spells as a string: an Event's
//!   reason, a condition's type), or is one of the standard traits it implements;
//! - a lowercase word opening a list item (`` - `store`: …``): a module of the
//!   section's crate.
//!
//! Anything else in backticks (HTTP paths, flags, headers, values, config keys) is
//! prose, not checked.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use regex::Regex;
use stanch_testkit::files::rust_sources;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// Standard traits the map says a type implements.
const STD: &[&str] = &["Display", "Debug", "Error", "Future", "Default", "From"];

/// The names the workspace's Rust defines, and its module files.
struct Index {
    defined: BTreeSet<String>,
    /// `(crate dir, module name)` for every `name.rs` and `name/` under a `src/`.
    modules: BTreeSet<(PathBuf, String)>,
}

impl Index {
    fn build() -> Index {
        let mut index = Index {
            defined: BTreeSet::new(),
            modules: BTreeSet::new(),
        };
        let item = Regex::new(
            r"\b(?:fn|struct|enum|trait|type|mod|const|static|macro_rules!)\s+([A-Za-z_][A-Za-z0-9_]*)",
        )
        .unwrap();
        // Fields and variants: a name at the start of a line, then `:`, `(`, `{` or `,`.
        let member =
            Regex::new(r"(?m)^\s*(?:pub(?:\([a-z]+\))?\s+)?([A-Za-z_][A-Za-z0-9_]*)\s*[:({,]")
                .unwrap();
        // Kubernetes kinds (`#[kube(kind = "StanchPolicy")]`) and names spelled as
        // strings (`"SpecRefused"`, `"Degraded"`).
        let spelled = Regex::new(r#"(?:kind = )?"([A-Z][A-Za-z0-9]+)""#).unwrap();
        index.defined.extend(STD.iter().map(|s| (*s).to_owned()));
        let mut crates = vec![PathBuf::from(ROOT)];
        for entry in std::fs::read_dir(Path::new(ROOT).join("crates")).unwrap() {
            let dir = entry.unwrap().path();
            let name = dir.file_name().unwrap().to_string_lossy().replace('-', "_");
            index.defined.insert(name);
            crates.push(dir);
        }
        index.defined.insert("stanch".into());
        for krate in crates {
            for sub in ["src", "tests"] {
                for file in rust_sources(&krate.join(sub), true) {
                    let text = std::fs::read_to_string(&file).unwrap();
                    let names = item
                        .captures_iter(&text)
                        .chain(member.captures_iter(&text))
                        .chain(spelled.captures_iter(&text));
                    for c in names {
                        index.defined.insert(c[1].to_owned());
                    }
                    let stem = file.file_stem().unwrap().to_string_lossy().into_owned();
                    index.defined.insert(stem.clone());
                    if sub == "src" {
                        index.modules.insert((krate.clone(), stem));
                        if let Some(parent) = file.parent() {
                            let dir = parent.file_name().unwrap().to_string_lossy();
                            index.modules.insert((krate.clone(), dir.into_owned()));
                        }
                    }
                }
            }
        }
        index
    }
}

/// Whether `path` names a file or folder from one of `bases`; a `*` stands for any
/// name, so its folder must exist.
fn path_exists(path: &str, bases: &[PathBuf]) -> bool {
    let path = path.trim_end_matches('/');
    let checked = match path.find('*') {
        Some(star) => path[..star].rsplit_once('/').map_or("", |(dir, _)| dir),
        None => path,
    };
    bases.iter().any(|base| base.join(checked).exists())
}

/// What is wrong with each name the document gives, if anything.
fn problems(doc: &str, index: &Index) -> Vec<String> {
    let span = Regex::new(r"`([^`\n]+)`").unwrap();
    let section = Regex::new(r"^#{2,3} `(crates/[a-z-]+|src/)`").unwrap();
    let type_like = Regex::new(r"^[A-Za-z_][A-Za-z0-9_]*(::[A-Za-z_][A-Za-z0-9_]*)*$").unwrap();
    let root = PathBuf::from(ROOT);
    let mut crate_dir = root.clone();
    let mut problems = Vec::new();
    let mut checked = 0;
    for (n, line) in doc.lines().enumerate() {
        if let Some(c) = section.captures(line) {
            crate_dir = root.join(c[1].trim_end_matches('/'));
            if c[1].starts_with("src") {
                crate_dir = root.clone();
            }
        }
        let list_item = line.trim_start().starts_with("- `");
        for (i, c) in span.captures_iter(line).enumerate() {
            // `Engine::step(input, now)`, `matches!`: the name before the arguments.
            let name = c[1]
                .split('(')
                .next()
                .unwrap_or_default()
                .trim_end_matches('!');
            let at = format!("line {}: `{}`", n + 1, &c[1]);
            let ok = if name.starts_with("stanch-") && !name.contains([' ', '/']) {
                root.join("crates").join(name).is_dir()
            } else if name.contains('/')
                && !name.starts_with('/')
                && !name.contains([' ', ':', '?'])
                // `coordination.k8s.io/v1` is an API group, not a path.
                && !name.split('/').next().unwrap_or_default().chars().skip(1).any(|c| c == '.')
            {
                path_exists(
                    name,
                    &[root.clone(), crate_dir.clone(), crate_dir.join("src")],
                )
            } else if type_like.is_match(name)
                && (name.contains("::") || name.starts_with(|c: char| c.is_ascii_uppercase()))
                && name.chars().any(|c| c.is_ascii_lowercase())
            {
                name.split("::")
                    .filter(|s| !matches!(*s, "crate" | "self" | "super" | "std"))
                    .all(|s| index.defined.contains(s))
            } else if list_item && i == 0 && type_like.is_match(name) && !name.contains("::") {
                index
                    .modules
                    .contains(&(crate_dir.clone(), name.to_owned()))
                    || index.defined.contains(name)
            } else {
                continue;
            };
            checked += 1;
            if !ok {
                problems.push(at);
            }
        }
    }
    assert!(
        checked > 150,
        "only {checked} names checked: is the matching broken?"
    );
    problems
}

#[test]
fn every_name_the_architecture_map_gives_exists() {
    let doc = std::fs::read_to_string(Path::new(ROOT).join("docs/ARCHITECTURE.md")).unwrap();
    let index = Index::build();
    let problems = problems(&doc, &index);
    assert!(
        problems.is_empty(),
        "docs/ARCHITECTURE.md names what does not exist:\n{}",
        problems.join("\n")
    );
}

/// The check fails where it should: a crate, a path, a type and a module that are not.
#[test]
fn a_name_that_does_not_exist_is_found() {
    let index = Index::build();
    let mut doc = std::fs::read_to_string(Path::new(ROOT).join("docs/ARCHITECTURE.md")).unwrap();
    doc.push_str(
        "\n### `crates/stanch-core` — again\n\
         - `ladder_v2`: gone.\n\
         `stanch-oracle`, `crates/stanch-core/src/oracle.rs`, `Engine::prophesy`, `Soothsayer`.\n",
    );
    let found = problems(&doc, &index);
    for expected in [
        "`ladder_v2`",
        "`stanch-oracle`",
        "`crates/stanch-core/src/oracle.rs`",
        "`Engine::prophesy`",
        "`Soothsayer`",
    ] {
        assert!(
            found.iter().any(|p| p.ends_with(expected)),
            "{expected} in {found:#?}"
        );
    }
}
