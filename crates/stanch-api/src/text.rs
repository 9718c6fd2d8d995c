//! Text from outside kept within a size: reasons and names that end up in tables,
//! status and logs.

/// `text` with control characters as spaces, at most `max_chars` characters; one cut
/// short ends with `…` (within the `max_chars`).
pub fn printable(text: &str, max_chars: usize) -> String {
    let mut out: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .take(max_chars.saturating_add(1))
        .collect();
    if out.chars().count() > max_chars {
        out = out.chars().take(max_chars.saturating_sub(1)).collect();
        out.push('…');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_become_spaces_and_long_text_is_cut_with_a_marker() {
        assert_eq!(printable("a\nb\u{1b}[0m", 16), "a b [0m");
        assert_eq!(printable("abcdef", 6), "abcdef");
        assert_eq!(printable("abcdefg", 6), "abcde…");
        assert_eq!(printable("集集集集", 3).chars().count(), 3);
        assert_eq!(printable("", 3), "");
    }
}
