//! The gateway's modules use one another without a circle. A request's way through
//! them runs one way (front, admit, serving, stream, attempt, route, respond, request),
//! so each module reads knowing only those below it, and a change to one cannot come
//! back to it through the others. Read from the sources: every `crate::<module>` path
//! outside a `#[cfg(test)]` module and the `tests.rs` files that hold some. The crate
//! root (`lib.rs`) is the one exception, and is left out as a user: it declares the
//! modules and hands some of their names on (`Gateway`, which `gateway` holds and every
//! module serves with, among them).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Module → the modules it uses.
type Graph = BTreeMap<String, BTreeSet<String>>;

/// The crate root's own name in the graph.
const ROOT: &str = "lib";

#[test]
fn the_gateway_modules_use_one_another_without_a_circle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    collect(&src, &src, &mut files);
    let graph = graph(&files);
    assert_eq!(circle(&graph), None, "the modules' uses: {graph:#?}");
    // The request's way, top to bottom, as the module docs describe it.
    let way = [
        "front", "admit", "serving", "stream", "attempt", "route", "respond", "request",
    ];
    for module in way {
        assert!(graph.contains_key(module), "no module {module} read");
    }
    for (i, lower) in way.iter().enumerate() {
        for upper in &way[..i] {
            assert!(
                !graph[*lower].contains(*upper),
                "{lower} uses {upper}, which comes before it on a request's way"
            );
        }
    }
}

/// The check itself sees a circle, through `crate::` paths and grouped imports, and
/// passes over test modules and comments.
#[test]
fn a_circle_of_modules_is_found() {
    let files = |b: &str| {
        vec![
            (
                "a".to_owned(),
                "use crate::{b::Thing, Gateway};\n".to_owned(),
            ),
            ("b".to_owned(), b.to_owned()),
            (
                "lib".to_owned(),
                "mod a;\nmod b;\npub struct Gateway;\n".to_owned(),
            ),
        ]
    };
    let fine =
        "// crate::a::Thing\nfn f() {}\n#[cfg(test)]\nmod tests {\n    use crate::a::X;\n}\n";
    assert_eq!(
        circle(&graph(&files(fine))),
        None,
        "{:?}",
        graph(&files(fine))
    );
    let back = "fn f() { crate::a::go(); }\n";
    assert_eq!(
        circle(&graph(&files(back))),
        Some(vec!["a".to_owned(), "b".to_owned(), "a".to_owned()])
    );
}

/// Every `.rs` file under `dir`, as (its top-level module, its text).
fn collect(src: &Path, dir: &Path, out: &mut Vec<(String, String)>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            collect(src, &path, out);
        } else if path.file_name().is_some_and(|n| n == "tests.rs") {
            // A module's tests in a file of their own (`#[cfg(test)] mod tests;`) are
            // test code, as an inline `#[cfg(test)]` module is.
        } else if path.extension().is_some_and(|e| e == "rs") {
            let relative = path.strip_prefix(src).unwrap();
            let first = relative.components().next().unwrap().as_os_str();
            let module = first.to_string_lossy().trim_end_matches(".rs").to_owned();
            // The binary is a crate of its own.
            if module != "main" {
                out.push((module, std::fs::read_to_string(&path).unwrap()));
            }
        }
    }
}

fn graph(files: &[(String, String)]) -> Graph {
    let modules: BTreeSet<String> = files.iter().map(|(m, _)| m.clone()).collect();
    let mut graph = Graph::new();
    for (module, text) in files {
        let used = graph.entry(module.clone()).or_default();
        if module == ROOT {
            continue;
        }
        let code = without_tests_and_comments(text);
        for path in paths_after(&code, "crate::") {
            let first = path.split("::").next().unwrap_or_default();
            let target = if modules.contains(first) { first } else { ROOT };
            if target != module {
                used.insert(target.to_owned());
            }
        }
    }
    graph
}

/// `text` without its `#[cfg(test)]` modules (to their end: they come last) and line
/// comments.
fn without_tests_and_comments(text: &str) -> String {
    let text = text.split("#[cfg(test)]\nmod ").next().unwrap_or_default();
    text.lines()
        .map(|l| {
            let code = l.trim_start();
            if code.starts_with("//") { "" } else { l }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The paths that follow each `prefix`: `crate::a::B` gives `a::B`, and
/// `crate::{a::B, c}` gives `a::B` and `c`.
fn paths_after(code: &str, prefix: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (at, _) in code.match_indices(prefix) {
        let rest = &code[at + prefix.len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let inner = group.split('}').next().unwrap_or_default();
            out.extend(inner.split(',').map(|p| p.trim().to_owned()));
        } else {
            let end = rest
                .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
                .unwrap_or(rest.len());
            out.push(rest[..end].to_owned());
        }
    }
    out
}

/// A circle in `graph`, as the modules around it (the first again at the end).
fn circle(graph: &Graph) -> Option<Vec<String>> {
    fn visit(
        graph: &Graph,
        module: &str,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|m| m == module) {
            let mut found = path[at..].to_vec();
            found.push(module.to_owned());
            return Some(found);
        }
        if done.contains(module) {
            return None;
        }
        path.push(module.to_owned());
        for next in graph.get(module).into_iter().flatten() {
            if let Some(found) = visit(graph, next, path, done) {
                return Some(found);
            }
        }
        path.pop();
        done.insert(module.to_owned());
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|m| visit(graph, m, &mut Vec::new(), &mut done))
}
