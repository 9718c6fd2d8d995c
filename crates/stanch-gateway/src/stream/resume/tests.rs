//! The tests of `resume`.

use super::*;

fn chunk(id: &str, content: &str, finish: Option<&str>) -> String {
    serde_json::json!({"id": id, "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": finish}]})
    .to_string()
}

/// Notes `payload` as the caller got it: through the stream's parser.
fn note(t: &mut Transcript, payload: &str) {
    let mut events = Vec::new();
    super::super::sse::Parser::default()
        .push(Bytes::from(format!("data: {payload}\n\n")), &mut events);
    for e in events {
        if let super::super::sse::Event::Chunk { raw, text, .. } = e {
            t.note(&raw, text);
        }
    }
}

fn transcript_of(parts: &[&str]) -> Transcript {
    let mut t = Transcript::new(1 << 20);
    note(
            &mut t,
            &serde_json::json!({"id": "first", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
                .to_string(),
        );
    for p in parts {
        note(&mut t, &chunk("first", p, None));
    }
    t
}

fn splice(how: How, t: &Transcript) -> Splice {
    Splice::new(how, t.id(), &t.text().unwrap(), t.tokens())
}

fn passed(s: Spliced) -> Value {
    let Spliced::Pass(b) = s else { panic!("{s:?}") };
    let text = std::str::from_utf8(&b).unwrap();
    serde_json::from_str(text.strip_prefix("data: ").unwrap().trim_end()).unwrap()
}

#[test]
fn a_transcript_keeps_only_an_answer_that_can_be_continued() {
    let t = transcript_of(&["Hello", " wor"]);
    assert!(t.plain);
    assert_eq!((t.text().as_deref(), t.tokens()), (Some("Hello wor"), 2));
    assert_eq!(t.id().as_deref(), Some("first"));
    // Kept as sent, decoded as one: quotes, line ends, escaped and raw non-ASCII.
    let mut escaped = transcript_of(&["say \"hi\"\n", "caf\u{e9} "]);
    note(
        &mut escaped,
        r#"{"choices":[{"index":0,"delta":{"content":"\u00e9\ud83d\ude00\t"}}]}"#,
    );
    assert_eq!(escaped.text().as_deref(), Some("say \"hi\"\ncafé é😀\t"));
    let mut completion = Transcript::new(1 << 20);
    note(
        &mut completion,
        r#"{"id":"cmpl-1","choices":[{"index":0,"text":"Once","logprobs":{"content":[{"token":"x"}]}}]}"#,
    );
    assert_eq!(completion.text().as_deref(), Some("Once"));

    let mut tools = transcript_of(&["Hi"]);
    note(
        &mut tools,
        r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0}]}}]}"#,
    );
    assert!(
        !tools.plain,
        "a tool call cannot be regenerated into a prefix"
    );
    let mut two = transcript_of(&["Hi"]);
    note(
        &mut two,
        r#"{"choices":[{"index":1,"delta":{"content":"x"}}]}"#,
    );
    assert!(!two.plain, "a second choice cannot be continued");
    let mut nulls = transcript_of(&["Hi"]);
    note(
        &mut nulls,
        r#"{"choices":[{"index":0,"delta":{"content":"!","tool_calls":null,"reasoning_content":null}}]}"#,
    );
    assert!(nulls.plain, "null fields are absent fields");
    assert_eq!(nulls.text().as_deref(), Some("Hi!"));
    let mut long = Transcript::new(4);
    note(&mut long, &chunk("x", "12345", None));
    assert!(
        !long.plain && long.text().is_none(),
        "past the limit, nothing is kept"
    );
}

#[test]
fn a_regenerated_answer_is_spliced_after_exactly_what_the_caller_has() {
    let mut t = transcript_of(&["Hel", "lo w"]);
    let mut s = splice(How::Regenerate, &t);
    let role = serde_json::json!({"id": "second", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}).to_string();
    assert_eq!(s.chunk(&role, false, &mut t), Spliced::Skip);
    assert_eq!(
        s.chunk(&chunk("second", "Hello", None), false, &mut t),
        Spliced::Skip
    );
    assert!(!s.caught_up());
    // Split differently from the caller's chunks: the rest of this one is new.
    let v = passed(s.chunk(&chunk("second", " world", None), false, &mut t));
    assert_eq!(v["id"], "first", "one id for the whole stream");
    assert_eq!(v["choices"][0]["delta"]["content"], "orld");
    assert!(s.caught_up() && s.spliced);
    let v = passed(s.chunk(&chunk("second", "!", Some("stop")), true, &mut t));
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(t.text().as_deref(), Some("Hello world!"));
}

#[test]
fn a_regenerated_answer_that_differs_is_not_spliced() {
    for (parts, last) in [
        (&["Hellp"][..], false),
        (&["He", "y"][..], false),
        (&["Hel"][..], true),
    ] {
        let mut t = transcript_of(&["Hello"]);
        let mut s = splice(How::Regenerate, &t);
        let mut results = Vec::new();
        for (i, p) in parts.iter().enumerate() {
            let end = last && i + 1 == parts.len();
            results.push(s.chunk(&chunk("x", p, end.then_some("stop")), end, &mut t));
        }
        assert_eq!(results.last(), Some(&Spliced::Diverged), "{parts:?}");
        assert!(!s.spliced);
        assert_eq!(
            t.text().as_deref(),
            Some("Hello"),
            "what the caller has is unchanged"
        );
    }
    // The same answer, ending where the caller's did: only the end is passed on.
    let mut t = transcript_of(&["Hello"]);
    let mut s = splice(How::Regenerate, &t);
    let v = passed(s.chunk(&chunk("x", "Hello", Some("length")), true, &mut t));
    assert_eq!(v["choices"][0]["delta"]["content"], "");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
}

#[test]
fn a_prefilled_continuation_follows_the_caller_with_its_usage_moved() {
    let mut t = transcript_of(&["Hello", " wor"]);
    let mut s = splice(How::Prefill, &t);
    let first = serde_json::json!({"id": "second", "choices": [{"index": 0, "delta": {"role": "assistant", "content": "ld"}}], "usage": null}).to_string();
    let v = passed(s.chunk(&first, false, &mut t));
    assert_eq!(v["id"], "first");
    assert!(
        v["choices"][0]["delta"].get("role").is_none(),
        "one role per stream"
    );
    assert_eq!(v["choices"][0]["delta"]["content"], "ld");
    let usage = serde_json::json!({"id": "second", "choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13}}).to_string();
    let v = passed(s.chunk(&usage, false, &mut t));
    assert_eq!(v["usage"]["prompt_tokens"], 10);
    assert_eq!(v["usage"]["completion_tokens"], 3);
    assert_eq!(v["usage"]["total_tokens"], 13);
    assert_eq!(t.text().as_deref(), Some("Hello world"));
    // What a continuation adds is kept as escaped as what came first, and decodes
    // with it for a second resume.
    let _ = passed(s.chunk(&chunk("second", " \"q\"\n😀\\", None), false, &mut t));
    assert_eq!(t.text().as_deref(), Some("Hello world \"q\"\n😀\\"));
    assert_eq!(t.tokens(), 4);
}

#[test]
fn a_prefill_request_carries_the_partial_answer() {
    let raw = br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":10,"stream":true}"#;
    let b = prefilled(raw, Api::Chat, Prefill::Vllm, "Hel", 2, Some("up")).unwrap();
    let v: Value = serde_json::from_slice(&b).unwrap();
    assert_eq!(
        v["messages"][1],
        serde_json::json!({"role": "assistant", "content": "Hel"})
    );
    assert_eq!(v["continue_final_message"], true);
    assert_eq!(v["add_generation_prompt"], false);
    assert_eq!(v["max_tokens"], 8, "what was generated comes off the limit");
    assert_eq!(v["model"], "up");
    let b = prefilled(raw, Api::Chat, Prefill::Assistant, "Hel", 20, None).unwrap();
    let v: Value = serde_json::from_slice(&b).unwrap();
    assert!(v.get("continue_final_message").is_none());
    assert_eq!(v["max_tokens"], 1);
    assert_eq!(v["model"], "m");
    let completion = br#"{"model":"m","prompt":"Once","stream":true}"#;
    let b = prefilled(
        completion,
        Api::Completions,
        Prefill::Assistant,
        " upon",
        1,
        None,
    )
    .unwrap();
    let v: Value = serde_json::from_slice(&b).unwrap();
    assert_eq!(v["prompt"], "Once upon");
    assert!(prefilled(raw, Api::Chat, Prefill::None, "x", 1, None).is_none());
    let prompts = br#"{"model":"m","prompt":["a","b"]}"#;
    assert!(prefilled(prompts, Api::Completions, Prefill::Assistant, "x", 1, None).is_none());
}
