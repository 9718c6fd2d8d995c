//! `*` and `?` globs, for never-block patterns and model names.

/// True when `text` matches `pattern`, where `*` matches any run of characters
/// (including none) and `?` exactly one.
pub fn matches(pattern: &str, text: &str) -> bool {
    let (p, t): (Vec<char>, Vec<char>) = (pattern.chars().collect(), text.chars().collect());
    let (mut pi, mut ti) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while ti < t.len() {
        if pi < p.len() && (p[pi] == '?' || p[pi] == t[ti]) {
            pi += 1;
            ti += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some((pi, ti));
            pi += 1;
        } else if let Some((sp, st)) = star {
            pi = sp + 1;
            ti = st + 1;
            star = Some((sp, st + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|c| *c == '*')
}

#[cfg(test)]
mod tests {
    use super::matches;

    #[test]
    fn globs() {
        assert!(matches("*.internal:8000", "gpu-1.internal:8000"));
        assert!(matches("gpu-?", "gpu-7"));
        assert!(!matches("gpu-?", "gpu-17"));
        assert!(matches("*", ""));
        assert!(!matches("a*b", "acd"));
        assert!(matches("a*b*c", "aXbYbZc"));
        assert!(matches("fb-*", "fb-anything"));
    }
}
