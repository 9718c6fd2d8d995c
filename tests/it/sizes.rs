//! Sizes a reader can hold: no source file over 600 lines of code besides its tests,
//! and no function over 80 lines, unless a `// Size:` comment at its top (for a
//! function, just above it or on the first line of its body; for a file, anywhere in
//! its module documentation's lines) says why. Test modules (`tests.rs`, `tests/`,
//! `#[cfg(test)] mod tests`) are not counted.

use std::path::Path;

use regex::Regex;
use stanch_testkit::files::rust_sources;

const MAX_FILE_LINES: usize = 600;
const MAX_FN_LINES: usize = 80;
const REASON: &str = "// Size:";

/// The lines of `text` before its test module, if it has one inline.
fn without_tests(text: &str) -> Vec<&str> {
    let lines: Vec<&str> = text.lines().collect();
    let end = lines
        .windows(2)
        .position(|w| w[0].starts_with("#[cfg(test)]") && w[1].starts_with("mod tests"))
        .unwrap_or(lines.len());
    lines[..end].to_vec()
}

/// Every function longer than the limit without a reason: `file:line name (n lines)`.
fn long_functions(file: &Path, lines: &[&str]) -> Vec<String> {
    let start = Regex::new(
        r"^(\s*)(?:pub(?:\([a-z]+\))?\s+)?(?:async\s+)?(?:const\s+)?fn\s+([A-Za-z_][A-Za-z0-9_]*)",
    )
    .unwrap();
    let mut found = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let Some(c) = start.captures(line) else {
            continue;
        };
        let indent = &c[1];
        // The body opens at the first line that ends with `{`; a declaration without
        // a body ends with `;`.
        let Some(open) = (i..lines.len()).find(|&j| {
            let l = lines[j].trim_end();
            l.ends_with('{') || l.ends_with(';')
        }) else {
            continue;
        };
        if lines[open].trim_end().ends_with(';') {
            continue;
        }
        let close = format!("{indent}}}");
        let Some(end) = (open + 1..lines.len()).find(|&j| lines[j] == close) else {
            continue;
        };
        let length = end - i + 1;
        if length <= MAX_FN_LINES {
            continue;
        }
        let above = lines[..i]
            .iter()
            .rev()
            .take_while(|l| {
                let t = l.trim_start();
                t.starts_with("//") || t.starts_with("#[") || t.starts_with(')') || t.is_empty()
            })
            .any(|l| l.trim_start().starts_with(REASON));
        let first = lines
            .get(open + 1)
            .is_some_and(|l| l.trim_start().starts_with(REASON));
        if !above && !first {
            found.push(format!(
                "{}:{} {} ({length} lines)",
                file.display(),
                i + 1,
                &c[2]
            ));
        }
    }
    found
}

fn problems(root: &Path) -> Vec<String> {
    let mut files = rust_sources(&root.join("src"), false);
    for entry in std::fs::read_dir(root.join("crates")).unwrap() {
        files.extend(rust_sources(&entry.unwrap().path().join("src"), false));
    }
    let mut problems = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        let lines = without_tests(&text);
        let code = lines
            .iter()
            .filter(|l| {
                let t = l.trim();
                !t.is_empty() && !t.starts_with("//")
            })
            .count();
        let file_reason = lines
            .iter()
            .take_while(|l| l.starts_with("//!") || l.trim().is_empty() || l.starts_with("#!"))
            .any(|l| l.contains(REASON.trim_start_matches("// ")));
        if code > MAX_FILE_LINES && !file_reason {
            problems.push(format!("{} ({code} lines of code)", file.display()));
        }
        problems.extend(long_functions(&file, &lines));
    }
    problems
}

#[test]
fn files_and_functions_are_short_or_say_why() {
    let problems = problems(Path::new(env!("CARGO_MANIFEST_DIR")));
    assert!(
        problems.is_empty(),
        "longer than {MAX_FILE_LINES} lines a file or {MAX_FN_LINES} a function, with no `{REASON}` line saying why:\n{}",
        problems.join("\n")
    );
}

/// The check finds a long function and a long file, and takes a reason for either.
#[test]
fn a_long_function_without_a_reason_is_found() {
    let body = "    let x = 1;\n".repeat(MAX_FN_LINES);
    let long = format!("fn long() {{\n{body}}}\n");
    let lines: Vec<&str> = long.lines().collect();
    let found = long_functions(Path::new("x.rs"), &lines);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].contains("long"), "{found:?}");
    let reasoned = format!("// Size: a table, one row a line.\n{long}");
    let lines: Vec<&str> = reasoned.lines().collect();
    assert!(long_functions(Path::new("x.rs"), &lines).is_empty());
    let short = "fn short() {\n    let x = 1;\n}\n";
    let lines: Vec<&str> = short.lines().collect();
    assert!(long_functions(Path::new("x.rs"), &lines).is_empty());
}
