//! Reading JSON without building it: one pass that checks a document is well-formed
//! (RFC 8259, what serde_json accepts) and shows the caller every object key on the
//! way, for the few facts the gateway needs from bodies it otherwise passes on as
//! they are: a request's `model` and `stream`, a stream chunk's `finish_reason` and
//! `error`. Does not own: building values (serde_json does that, where one is needed).

use std::borrow::Cow;

/// The nesting of the containers a walk is inside: a bit per level, `true` for an
/// object; deeper than 64 levels, a vector takes over (never, in a real chunk).
#[derive(Default)]
struct Nesting {
    bits: u64,
    depth: usize,
    deeper: Vec<bool>,
}

impl Nesting {
    fn push(&mut self, object: bool) {
        if self.depth < 64 {
            self.bits = (self.bits & !(1 << self.depth)) | (u64::from(object) << self.depth);
        } else {
            self.deeper.push(object);
        }
        self.depth += 1;
    }

    /// Whether the innermost container is an object; `None` at the top level.
    fn top(&self) -> Option<bool> {
        match self.depth {
            0 => None,
            d if d <= 64 => Some(self.bits & (1 << (d - 1)) != 0),
            _ => self.deeper.last().copied(),
        }
    }

    fn pop(&mut self) {
        if self.depth > 64 {
            self.deeper.pop();
        }
        self.depth -= 1;
    }
}

// The walker's helpers below are inlined into its loop by force: they run for every
// key and string of every event and body, and as calls they cost 4 % of a streamed
// answer's instructions (callgrind, `STREAM=1 scripts/bench-instructions.sh`).

/// JSON's insignificant whitespace.
#[inline(always)]
fn skip_ws(s: &[u8], mut i: usize) -> usize {
    while let Some(b' ' | b'\n' | b'\t' | b'\r') = s.get(i) {
        i += 1;
    }
    i
}

/// The end of the string whose opening quote is before `i`.
#[inline(always)]
pub(crate) fn string_end(s: &[u8], mut i: usize) -> Option<usize> {
    loop {
        i = next_special(s, i);
        match *s.get(i)? {
            b'"' => return Some(i + 1),
            b'\\' => {
                i += match *s.get(i + 1)? {
                    b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => 2,
                    b'u' if s.get(i + 2..i + 6)?.iter().all(u8::is_ascii_hexdigit) => 6,
                    _ => return None,
                };
            }
            // A control character, which must be escaped.
            _ => return None,
        }
    }
}

/// The first byte from `i` on that ends a string's plain run: a quote, a backslash
/// or a control character (`s.len()` if none). Eight bytes at a time: a byte below
/// 0x20, or equal to one of the two after an XOR, leaves a borrow in its top bit when
/// 0x01 is subtracted from every byte, and the lowest flagged byte is exact.
#[inline(always)]
fn next_special(s: &[u8], mut i: usize) -> usize {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const TOPS: u64 = 0x8080_8080_8080_8080;
    let below = |w: u64, n: u8| w.wrapping_sub(ONES * u64::from(n)) & !w & TOPS;
    while let Some(word) = s.get(i..i + 8) {
        let w = u64::from_le_bytes(word.try_into().expect("eight bytes"));
        let found = below(w ^ (ONES * u64::from(b'"')), 1)
            | below(w ^ (ONES * u64::from(b'\\')), 1)
            | below(w, 0x20);
        if found != 0 {
            return i + (found.trailing_zeros() / 8) as usize;
        }
        i += 8;
    }
    while s
        .get(i)
        .is_some_and(|&b| b != b'"' && b != b'\\' && b >= 0x20)
    {
        i += 1;
    }
    i
}

/// The end of the number that starts at `i`: `-?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?`.
fn number_end(s: &[u8], mut i: usize) -> Option<usize> {
    let digits = |mut i: usize| {
        let start = i;
        while s.get(i).is_some_and(u8::is_ascii_digit) {
            i += 1;
        }
        (i > start).then_some(i)
    };
    if s.get(i) == Some(&b'-') {
        i += 1;
    }
    i = match *s.get(i)? {
        b'0' => i + 1,
        b'1'..=b'9' => digits(i)?,
        _ => return None,
    };
    if s.get(i) == Some(&b'.') {
        i = digits(i + 1)?;
    }
    if let Some(b'e' | b'E') = s.get(i) {
        i += 1;
        if let Some(b'+' | b'-') = s.get(i) {
            i += 1;
        }
        i = digits(i)?;
    }
    Some(i)
}

/// Reads an object key at `i` and its colon; returns where its value starts, after
/// showing the key to `on_key`.
#[inline(always)]
fn key(
    s: &[u8],
    i: usize,
    depth: usize,
    on_key: &mut impl FnMut(usize, &[u8], usize),
) -> Option<usize> {
    if s.get(i) != Some(&b'"') {
        return None;
    }
    let end = string_end(s, i + 1)?;
    let colon = skip_ws(s, end);
    if s.get(colon) != Some(&b':') {
        return None;
    }
    let value = skip_ws(s, colon + 1);
    on_key(depth, &s[i + 1..end - 1], value);
    Some(value)
}

/// Checks that `s` is one well-formed JSON value (RFC 8259: what serde_json accepts,
/// at any depth), without building anything; false when it is not. Every object key
/// is shown to `on_key` as it is met: the depth of its object (1 at the top level),
/// the key as written between its quotes (escapes not decoded), and where its value
/// starts in `s` (a value that may yet turn out malformed).
#[inline(always)]
pub(crate) fn walk(s: &[u8], mut on_key: impl FnMut(usize, &[u8], usize)) -> bool {
    walk_values(s, &mut on_key).is_some()
}

/// [`walk`], with `None` for a document that is not JSON.
#[inline(always)]
fn walk_values(s: &[u8], on_key: &mut impl FnMut(usize, &[u8], usize)) -> Option<()> {
    let mut nesting = Nesting::default();
    let mut i = skip_ws(s, 0);
    loop {
        // A value starts at `i`.
        i = match *s.get(i)? {
            b'{' => {
                let inner = skip_ws(s, i + 1);
                if s.get(inner) == Some(&b'}') {
                    inner + 1
                } else {
                    nesting.push(true);
                    i = key(s, inner, nesting.depth, on_key)?;
                    continue;
                }
            }
            b'[' => {
                let inner = skip_ws(s, i + 1);
                if s.get(inner) == Some(&b']') {
                    inner + 1
                } else {
                    nesting.push(false);
                    i = inner;
                    continue;
                }
            }
            b'"' => string_end(s, i + 1)?,
            b't' if s[i..].starts_with(b"true") => i + 4,
            b'f' if s[i..].starts_with(b"false") => i + 5,
            b'n' if s[i..].starts_with(b"null") => i + 4,
            b'-' | b'0'..=b'9' => number_end(s, i)?,
            _ => return None,
        };
        // After a value: containers close, or a comma leads to the next value.
        loop {
            i = skip_ws(s, i);
            let Some(object) = nesting.top() else {
                return (i == s.len()).then_some(());
            };
            match *s.get(i)? {
                b',' => {
                    i = skip_ws(s, i + 1);
                    if object {
                        i = key(s, i, nesting.depth, on_key)?;
                    }
                    break;
                }
                b'}' if object => {}
                b']' if !object => {}
                _ => return None,
            }
            nesting.pop();
            i += 1;
        }
    }
}

/// What routing reads of a request body. The rest of the body is not parsed, and the
/// body goes upstream as the caller sent it.
#[derive(Debug, PartialEq, Eq, serde::Deserialize)]
pub(crate) struct Peek<'a> {
    /// The requested model; `None` when absent or `null`.
    #[serde(borrow)]
    pub model: Option<Cow<'a, str>>,
    /// Whether the caller asked for a stream; `None` when absent or `null`.
    #[serde(default)]
    pub stream: Option<bool>,
}

/// A request body that is not one JSON object, or whose `model` or `stream` has the
/// wrong type or appears twice.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct NotARequest;

/// Reads `model` and `stream` from a request body, checking on the way that it is one
/// well-formed JSON object in UTF-8 whose `model` (a string or `null`) and `stream` (a
/// boolean or `null`) each appear at most once, as serde_json reading them into a
/// struct would. A key or a `model` written with escapes (`"mod\u0065l"`) is left to
/// serde_json to decode, so the gateway never routes by a different reading of the
/// body than the upstream's.
///
/// One pass over the body, borrowing the model's name: serde_json skipping the
/// messages costs about twice as many instructions per request.
pub(crate) fn peek(body: &[u8]) -> Result<Peek<'_>, NotARequest> {
    // JSON exchanged between systems is UTF-8 (RFC 8259 §8.1).
    let text = std::str::from_utf8(body).map_err(|_| NotARequest)?;
    if !text.trim_start().starts_with('{') {
        return Err(NotARequest);
    }
    let (mut model, mut stream) = (None, None);
    let (mut twice, mut escaped) = (false, false);
    let well_formed = walk(body, |depth, name, value| {
        if depth != 1 {
            return;
        }
        match name {
            b"model" => twice |= model.replace(value).is_some(),
            b"stream" => twice |= stream.replace(value).is_some(),
            _ => escaped |= name.contains(&b'\\'),
        }
    });
    if !well_formed || twice {
        return Err(NotARequest);
    }
    if escaped {
        return serde_json::from_str(text).map_err(|_| NotARequest);
    }
    let model = match model.map(|at| (at, body[at])) {
        None | Some((_, b'n')) => None,
        Some((at, b'"')) => {
            let end = string_end(body, at + 1).ok_or(NotARequest)?;
            let name = &text[at + 1..end - 1];
            if name.contains('\\') {
                Some(Cow::Owned(
                    serde_json::from_str(&text[at..end]).map_err(|_| NotARequest)?,
                ))
            } else {
                Some(Cow::Borrowed(name))
            }
        }
        Some(_) => return Err(NotARequest),
    };
    let stream = match stream.map(|at| body[at]) {
        None | Some(b'n') => None,
        Some(b't') => Some(true),
        Some(b'f') => Some(false),
        Some(_) => return Err(NotARequest),
    };
    Ok(Peek { model, stream })
}

#[cfg(test)]
pub(crate) mod tests {
    use serde_json::Value;

    use super::*;

    /// A small deterministic random source for comparisons with serde_json.
    pub(crate) struct Rng(pub u64);

    impl Rng {
        pub fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }

        pub fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }

    /// Strings that matter to JSON's string grammar, and some that do not.
    pub(crate) const TEXT: [&str; 10] = [
        "",
        "hi",
        "tab\there",
        "\u{1}",
        "quote\"",
        "back\\slash",
        "日本",
        "😀/",
        "a longer run of plain text, then \"a quote\" and a \\ backslash",
        "Σ long enough to be read eight bytes at a time, and then some more",
    ];

    /// Characters that matter to JSON's grammar, and some that do not, for mutations.
    pub(crate) const NOISE: &[char] = &[
        '{', '}', '[', ']', '"', ',', ':', '\\', '/', ' ', '\n', '\t', '\r', '\u{1}', '0', '1',
        '9', '-', '+', '.', 'e', 'E', 't', 'f', 'n', 'u', 'l', 'x', 'é', '\u{a0}',
    ];

    /// A random JSON value whose objects take their keys from `keys`.
    pub(crate) fn value(rng: &mut Rng, depth: usize, keys: &[&str]) -> Value {
        match rng.below(if depth > 4 { 5 } else { 8 }) {
            0 => Value::Null,
            1 => Value::Bool(rng.below(2) == 0),
            2 => serde_json::json!(rng.next() as i64 >> rng.below(64)),
            3 => serde_json::json!(
                (rng.next() as f64) / 3.7e9 * if rng.below(2) == 0 { -1.0 } else { 1e-7 }
            ),
            4 => Value::String(TEXT[rng.below(TEXT.len())].to_owned()),
            5 => Value::Array(
                (0..rng.below(4))
                    .map(|_| value(rng, depth + 1, keys))
                    .collect(),
            ),
            _ => Value::Object(
                (0..rng.below(5))
                    .map(|_| {
                        let key = keys[rng.below(keys.len())].to_owned();
                        (key, value(rng, depth + 1, keys))
                    })
                    .collect(),
            ),
        }
    }

    /// One random change to `text`: a character removed, replaced or inserted, or the
    /// rest cut off.
    pub(crate) fn mutate(rng: &mut Rng, text: &str) -> String {
        let mut m: Vec<char> = text.chars().collect();
        let at = rng.below(m.len() + 1);
        match rng.below(4) {
            0 if at < m.len() => {
                m.remove(at);
            }
            1 if at < m.len() => m[at] = NOISE[rng.below(NOISE.len())],
            2 => m.truncate(at),
            _ => m.insert(at, NOISE[rng.below(NOISE.len())]),
        }
        m.into_iter().collect()
    }

    /// The reading the gateway must agree with: serde_json into the same struct, for a
    /// body that is a JSON object.
    fn serde_peek(body: &str) -> Result<Peek<'_>, NotARequest> {
        if !body.trim_start().starts_with('{') {
            return Err(NotARequest);
        }
        serde_json::from_str(body).map_err(|_| NotARequest)
    }

    /// A random request body: an object with `model`, `stream` and other keys (some
    /// written with escapes, some twice), values of every type.
    fn body(rng: &mut Rng) -> String {
        const KEYS: [&str; 6] = ["messages", "max_tokens", "model", "stream", "", "é"];
        let mut fields: Vec<String> = Vec::new();
        for _ in 0..rng.below(6) {
            let key = match rng.below(10) {
                0 => "\"mod\\u0065l\"".to_owned(),
                1 => "\"str\\u0065am\"".to_owned(),
                2 => "\"a\\nb\"".to_owned(),
                _ => serde_json::to_string(KEYS[rng.below(KEYS.len())]).unwrap(),
            };
            let value = match rng.below(6) {
                0 => serde_json::to_string(TEXT[rng.below(TEXT.len())]).unwrap(),
                1 => "\"qwen-72b\"".to_owned(),
                2 => ["true", "false", "null"][rng.below(3)].to_owned(),
                _ => value(rng, 1, &KEYS).to_string(),
            };
            fields.push(format!("{key}:{value}"));
        }
        let spaced = rng.below(2) == 0;
        let body = fields.join(if spaced { " ,\n " } else { "," });
        if spaced {
            format!(" {{ {body} }}\n")
        } else {
            format!("{{{body}}}")
        }
    }

    #[test]
    fn peek_reads_a_body_as_serde_json_does() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let (mut read, mut refused) = (0, 0);
        for _ in 0..4000 {
            let original = body(&mut rng);
            let mut texts = vec![original.clone()];
            texts.extend((0..8).map(|_| mutate(&mut rng, &original)));
            for text in texts {
                let expected = serde_peek(&text);
                assert_eq!(peek(text.as_bytes()), expected, "{text:?}");
                if expected.is_ok() {
                    read += 1;
                } else {
                    refused += 1;
                }
            }
        }
        assert!(
            read > 5000 && refused > 5000,
            "{read} read, {refused} refused"
        );
    }

    #[test]
    fn peek_cases() {
        let ok = |body: &str, model: Option<&str>, stream: Option<bool>| {
            let p = peek(body.as_bytes()).unwrap_or_else(|_| panic!("{body}"));
            assert_eq!((p.model.as_deref(), p.stream), (model, stream), "{body}");
        };
        ok(
            r#"{"model":"qwen-72b","messages":[{"role":"user","content":"hi"}]}"#,
            Some("qwen-72b"),
            None,
        );
        ok(
            r#" {"stream": true, "model": "日本"} "#,
            Some("日本"),
            Some(true),
        );
        ok(r#"{"model":null,"stream":null}"#, None, None);
        ok(r#"{}"#, None, None);
        ok(r#"{"a":{"model":1,"model":2}}"#, None, None);
        // Escapes are decoded as serde_json decodes them.
        ok(r#"{"mod\u0065l":"x"}"#, Some("x"), None);
        ok(r#"{"model":"a\/b\u00e9"}"#, Some("a/bé"), None);
        // The name is borrowed from the body unless it had to be decoded.
        let p = peek(br#"{"model":"plain"}"#).unwrap();
        assert!(matches!(p.model, Some(Cow::Borrowed("plain"))));

        for bad in [
            &b"[\"qwen-72b\"]"[..],
            b"\"model\"",
            b"",
            b"{\"model\":\"a\",\"model\":\"b\"}",
            b"{\"model\":\"a\",\"mod\\u0065l\":\"b\"}",
            b"{\"stream\":true,\"stream\":false}",
            b"{\"model\":1}",
            b"{\"model\":\"a\",\"stream\":\"true\"}",
            b"{\"model\":\"a\",\"stream\":1}",
            b"{\"model\":\"a\"} x",
            b"{\"model\":\"\xff\"}",
            b"{\"model\":\"a\",\"messages\":[\"\xc3\"]}",
        ] {
            assert_eq!(
                peek(bad),
                Err(NotARequest),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }
}

/// How much work a whole answer was, for comparing endpoints per unit of it: its
/// `usage.completion_tokens` (output tokens), else `usage.prompt_tokens` (an embeddings
/// answer has only those), else 1. Read from the end, where OpenAI-shaped answers put
/// `usage`; a key inside a string value cannot match, as its quotes would be escaped.
pub(crate) fn work_units(answer: &[u8]) -> u32 {
    let count = |key: &[u8]| -> Option<u32> {
        let at = memchr::memmem::rfind(answer, key)? + key.len();
        let rest = answer[at..]
            .trim_ascii_start()
            .strip_prefix(b":")?
            .trim_ascii_start();
        let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
        std::str::from_utf8(&rest[..digits]).ok()?.parse().ok()
    };
    count(b"\"completion_tokens\"")
        .filter(|&n| n > 0)
        .or_else(|| count(b"\"prompt_tokens\"").filter(|&n| n > 0))
        .unwrap_or(1)
}

#[cfg(test)]
mod work_tests {
    use super::work_units;

    #[test]
    fn work_is_output_tokens_else_input_tokens_else_one() {
        let chat = br#"{"choices":[{"message":{"content":"say \"completion_tokens\": 9"}}],
            "usage": {"prompt_tokens": 12, "completion_tokens" : 240, "total_tokens": 252}}"#;
        assert_eq!(work_units(chat), 240);
        let embeddings =
            br#"{"data":[{"embedding":[0.1]}],"usage":{"prompt_tokens":8,"total_tokens":8}}"#;
        assert_eq!(work_units(embeddings), 8);
        assert_eq!(work_units(br#"{"choices":[]}"#), 1);
        assert_eq!(
            work_units(br#"{"usage":{"completion_tokens":0,"prompt_tokens":0}}"#),
            1
        );
        assert_eq!(
            work_units(br#"{"usage":{"completion_tokens":99999999999}}"#),
            1
        );
        assert_eq!(
            work_units(b"\"completion_tokens\""),
            1,
            "a key at the very end"
        );
    }
}
