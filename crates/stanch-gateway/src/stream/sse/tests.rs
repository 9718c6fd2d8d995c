//! The tests of `sse`.

use super::*;
use crate::json::tests::{Rng, mutate, value};

/// The events `data` completes, as one frame.
fn push(p: &mut Parser, data: &[u8]) -> Vec<Event> {
    let mut events = Vec::new();
    p.push(Bytes::copy_from_slice(data), &mut events);
    events
}

#[test]
fn events_across_chunk_boundaries() {
    let mut p = Parser::default();
    assert!(
        push(
            &mut p,
            b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"},\"finish_reason\":null}]}\n"
        )
        .is_empty()
    );
    let ev = push(
        &mut p,
        b"\ndata: {\"choices\":[{\"delta\":{},\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n",
    );
    assert!(matches!(ev[0], Event::Chunk { last: false, .. }));
    assert!(matches!(ev[1], Event::Chunk { last: true, .. }));
    assert_eq!(ev[2], Event::Done);
}

#[test]
fn whole_events_are_taken_from_the_frame_without_a_copy() {
    let mut p = Parser::default();
    let frame = Bytes::from_static(b"data: {\"a\":1}\n\ndata: {\"b\":2}\n\ndata: {\"c\"");
    let mut events = Vec::new();
    p.push(frame.clone(), &mut events);
    let Event::Chunk { raw, .. } = &events[1] else {
        panic!("{events:?}")
    };
    assert_eq!(raw.as_ptr(), frame[15..].as_ptr(), "a slice of the frame");
    assert_eq!(events.len(), 2, "the third is not complete");
    // The third ends with the next frame; the blank line may be split too.
    let mut events = Vec::new();
    p.push(Bytes::from_static(b":3}\n"), &mut events);
    assert!(events.is_empty());
    p.push(Bytes::from_static(b"\ndata: [DONE]\n\n"), &mut events);
    assert_eq!(
        events,
        [
            Event::Chunk {
                raw: Bytes::from_static(b"data: {\"c\":3}\n\n"),
                last: false,
                text: Text::NONE,
            },
            Event::Done
        ]
    );
}

#[test]
fn chunks_pass_on_as_sent_or_normalized() {
    let mut p = Parser::default();
    let sent = b"data: {\"choices\":[{\"delta\":{\"content\":\"a\"},\"finish_reason\":null}]}\n\n";
    let ev = push(&mut p, sent);
    assert_eq!(
        ev[0],
        Event::Chunk {
            raw: Bytes::from_static(sent),
            last: false,
            text: Text {
                at: Some((39, 40)),
                id: None,
                plain: true
            },
        }
    );
    let ev = push(
        &mut p,
        b"data:{\"choices\":[]}\r\n\r\ndata: {\"a\":\ndata: 1}\n\n",
    );
    assert_eq!(
        ev[0],
        Event::Chunk {
            raw: Bytes::from_static(b"data: {\"choices\":[]}\n\n"),
            last: false,
            text: Text::NONE,
        },
        "no space after the colon, CRLF: normalized"
    );
    assert_eq!(
        ev[1],
        Event::Chunk {
            raw: Bytes::from_static(b"data: {\"a\":\n1}\n\n"),
            last: false,
            text: Text::NONE,
        },
        "a payload over two data lines is one chunk"
    );
    for bad in [
        &b"data: [1, 2]\n\n"[..],
        b"data: \"text\"\n\n",
        b"data: {\"x\": \xff}\n\n",
    ] {
        assert_eq!(push(&mut p, bad), vec![Event::Malformed], "{bad:?}");
    }
    let ev = push(
        &mut p,
        b"data: {\"error\": null, \"choices\": [{\"finish_reason\": \"length\"}]}\n\n",
    );
    assert!(
        matches!(ev[0], Event::Chunk { last: true, .. }),
        "a null error is no error"
    );
}

#[test]
fn the_final_chunk_is_found_by_its_finish_reason() {
    for (payload, last) in [
        (r#"{"choices":[{"finish_reason":null}]}"#, false),
        (r#"{"choices":[{"finish_reason" : null}]}"#, false),
        (r#"{"choices":[{"finish_reason":"stop"}]}"#, true),
        (r#"{"choices":[{"finish_reason": "length"}]}"#, true),
        (
            r#"{"choices":[{"delta":{"content":"\"finish_reason\": \"stop\""}}]}"#,
            false,
        ),
        (r#"{"choices":[{"delta":{}}]}"#, false),
    ] {
        assert_eq!(scan(payload).map(|s| s.finished), Some(last), "{payload}");
    }
    let mut p = Parser::default();
    let ev = push(
        &mut p,
        br#"data: {"choices":[{"delta":{"content":"error"},"error_rate":1}]}

"#,
    );
    assert!(
        matches!(ev[0], Event::Chunk { last: false, .. }),
        "a chunk is an error only when its top level says so: {ev:?}"
    );
}

/// The keys a [`Scan`] looks for, among others.
const KEYS: [&str; 12] = [
    "finish_reason",
    "error",
    "choices",
    "delta",
    "content",
    "text",
    "id",
    "index",
    "tool_calls",
    "",
    "a\"b",
    "é",
];

/// What a scan says, its ranges decoded.
#[derive(Debug, PartialEq)]
struct Seen {
    finished: bool,
    error: bool,
    text: Option<String>,
    id: Option<String>,
    plain: bool,
}

fn scanned(json: &str) -> Option<Seen> {
    let decode = |r: Option<(u32, u32)>| {
        r.map(|(a, b)| {
            serde_json::from_str::<String>(&format!("\"{}\"", &json[a as usize..b as usize]))
                .unwrap()
        })
    };
    scan(json).map(|s| Seen {
        finished: s.finished,
        error: s.error,
        text: decode(s.text.at),
        id: decode(s.text.id),
        plain: s.text.plain,
    })
}

/// The keys of every object in a tree.
fn keys(v: &Value) -> usize {
    match v {
        Value::Object(m) => m.len() + m.values().map(keys).sum::<usize>(),
        Value::Array(a) => a.iter().map(keys).sum(),
        _ => 0,
    }
}

/// The keys a walk of `json` meets.
fn walked_keys(json: &str) -> usize {
    let mut n = 0;
    crate::json::walk(json.as_bytes(), |_, _, _| n += 1);
    n
}

/// What the scanner should report of a well-formed value, read from its tree.
fn expected(v: &Value) -> Seen {
    fn finished(v: &Value) -> bool {
        match v {
            Value::Object(m) => m
                .iter()
                .any(|(k, v)| (k == "finish_reason" && !v.is_null()) || finished(v)),
            Value::Array(a) => a.iter().any(finished),
            _ => false,
        }
    }
    /// The text, id and plainness, by the depth of each key's object (arrays
    /// count: a choice's keys are at 3, its delta's at 4).
    fn text(v: &Value, depth: usize, out: &mut Seen) {
        match v {
            Value::Object(m) => {
                for (k, x) in m {
                    match (depth, k.as_str(), x) {
                        (1, "id", Value::String(id)) => out.id = Some(id.clone()),
                        (1, "id", _) => out.id = None,
                        (3, "index", x) if !(x.is_u64() && x.as_u64() == Some(0)) => {
                            out.plain = false
                        }
                        (3, "text", Value::String(t)) | (4, "content", Value::String(t)) => {
                            out.plain &= out.text.is_none();
                            out.text = Some(t.clone());
                        }
                        (
                            4,
                            "tool_calls" | "function_call" | "reasoning_content" | "reasoning",
                            x,
                        ) if !x.is_null() => out.plain = false,
                        _ => {}
                    }
                    text(x, depth + 1, out);
                }
            }
            Value::Array(a) => a.iter().for_each(|x| text(x, depth + 1, out)),
            _ => {}
        }
    }
    let mut out = Seen {
        finished: finished(v),
        error: v.as_object().is_some_and(|m| m.contains_key("error")),
        text: None,
        id: None,
        plain: true,
    };
    text(v, 1, &mut out);
    out
}

/// Chunks as upstreams send them, with every field the text depends on present or
/// not, null or not, and noise beside them: the scan reads the text, the id and
/// whether it is plain as a tree of the chunk says.
#[test]
fn the_scan_reads_a_chunks_text_as_its_tree_says() {
    use crate::json::tests::TEXT;
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut plain_text = 0;
    for round in 0..4000 {
        let mut pick = |n: usize| rng.below(n);
        let text = |i: usize| Value::String(TEXT[i % TEXT.len()].to_owned());
        let mut delta = serde_json::Map::new();
        match pick(4) {
            0 => {}
            1 => drop(delta.insert("content".into(), Value::Null)),
            _ => drop(delta.insert("content".into(), text(pick(10)))),
        }
        if pick(3) == 0 {
            delta.insert("role".into(), "assistant".into());
        }
        for key in ["tool_calls", "reasoning_content"] {
            match pick(6) {
                0 => drop(delta.insert(key.into(), Value::Null)),
                1 => drop(delta.insert(key.into(), serde_json::json!([{"index": 0}]))),
                _ => {}
            }
        }
        let mut choice = serde_json::Map::new();
        choice.insert("index".into(), [0, 0, 0, 1][pick(4)].into());
        if pick(5) == 0 {
            choice.insert("text".into(), text(pick(10)));
        } else {
            choice.insert("delta".into(), Value::Object(delta));
        }
        if pick(3) == 0 {
            choice.insert(
                "logprobs".into(),
                serde_json::json!({"content": [{"token": "x"}]}),
            );
        }
        choice.insert(
            "finish_reason".into(),
            [Value::Null, "stop".into()][pick(2)].clone(),
        );
        let mut chunk = serde_json::json!({"object": "chat.completion.chunk", "choices": [choice]});
        if pick(4) != 0 {
            chunk["id"] = text(pick(10));
        }
        if pick(4) == 0 {
            chunk["usage"] = serde_json::json!({"prompt_tokens": 3, "completion_tokens": 0});
        }
        let json = if round % 2 == 0 {
            serde_json::to_string(&chunk).unwrap()
        } else {
            serde_json::to_string_pretty(&chunk).unwrap()
        };
        let seen = scanned(&json).unwrap();
        assert_eq!(seen, expected(&chunk), "{json}");
        plain_text += usize::from(seen.plain && seen.text.is_some());
    }
    assert!(plain_text > 1000, "{plain_text} plain texts");
}

#[test]
fn the_scanner_accepts_what_serde_json_accepts_and_nothing_else() {
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    let (mut valid, mut invalid) = (0, 0);
    for round in 0..3000 {
        let v = value(&mut rng, 0, &KEYS);
        let text = if round % 2 == 0 {
            serde_json::to_string(&v).unwrap()
        } else {
            serde_json::to_string_pretty(&v).unwrap()
        };
        assert_eq!(scanned(&text), Some(expected(&v)), "{text}");
        valid += 1;
        for _ in 0..12 {
            let mutant = mutate(&mut rng, &text);
            let serde = serde_json::from_str::<serde::de::IgnoredAny>(&mutant).is_ok();
            assert_eq!(scan(&mutant).is_some(), serde, "{mutant:?}");
            if serde {
                // A tree of it, unless a number is beyond f64 (valid JSON all the
                // same), or a key is repeated (a tree keeps one of them).
                if let Ok(tree) = serde_json::from_str::<Value>(&mutant)
                    && keys(&tree) == walked_keys(&mutant)
                {
                    assert_eq!(scanned(&mutant), Some(expected(&tree)), "{mutant:?}");
                }
                valid += 1;
            } else {
                invalid += 1;
            }
        }
    }
    assert!(
        valid > 5000 && invalid > 20_000,
        "{valid} valid, {invalid} not"
    );
}

#[test]
fn the_scanner_takes_any_depth() {
    let deep = format!("{}1{}", "[{\"a\":".repeat(200), "}]".repeat(200));
    assert_eq!(scan(&deep), Some(Scan::default()));
    let unclosed = format!("{}{}", "[".repeat(100), "]".repeat(99));
    assert_eq!(scan(&unclosed), None);
    assert_eq!(scan(" {} "), Some(Scan::default()));
    for bad in [
        "", " ", "{} {}", "01", "1.", "-", "1e", "nul", "[1,]", "{\"a\"}", "\"\\x\"",
    ] {
        assert_eq!(scan(bad), None, "{bad:?}");
    }
}

#[test]
fn an_event_too_large_is_dropped_whole() {
    let mut p = Parser::default();
    let huge = vec![b'x'; 64 * 1024];
    let mut events = push(&mut p, b"data: {\"content\": \"");
    for _ in 0..20 {
        events.extend(push(&mut p, &huge));
    }
    assert_eq!(events, vec![Event::Malformed], "counted once");
    assert!(p.buf.len() < 64, "and not held: {}", p.buf.len());
    let ev = push(&mut p, b"xx\"}\n\ndata: {\"choices\":[]}\n\n");
    assert_eq!(ev.len(), 1, "its tail is dropped too: {ev:?}");
    assert!(matches!(ev[0], Event::Chunk { .. }));
    // A blank line split across pushes still ends an event.
    assert!(push(&mut p, b"data: {}\r\n\r").is_empty());
    assert_eq!(push(&mut p, b"\n").len(), 1);
}

#[test]
fn malformed_errors_comments_and_crlf() {
    let mut p = Parser::default();
    let ev = push(&mut p, b"data: {\"choices\": [{\"delta\n\n: heartbeat\n\ndata: {\"error\":{\"message\":\"overloaded\"}}\r\n\r\n");
    assert_eq!(ev[0], Event::Malformed);
    assert!(matches!(ev[1], Event::Other(_)));
    assert_eq!(ev[2], Event::Error("overloaded".into()));
}
