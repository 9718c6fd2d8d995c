//! The real OpenAI Python SDK (PyPI `openai`, pinned in `scripts/install-test-deps.sh`)
//! against the gateway: chat, streaming with usage, embeddings, models, errors as the
//! SDK's error classes, its retries after `Retry-After`, and `x-request-id`.

use std::path::PathBuf;

use crate::support::*;

/// The Python with the SDK: `STANCH_TEST_PYTHON` (which `scripts/test.sh` sets), else
/// the virtual environment `scripts/install-test-deps.sh` makes under `target/`.
fn python() -> PathBuf {
    let venv = PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../target/test-venv/bin/python"
    ));
    match std::env::var_os("STANCH_TEST_PYTHON") {
        Some(p) => PathBuf::from(p),
        None if venv.exists() => venv,
        None => panic!(
            "STANCH_TEST_PYTHON is not set: run scripts/test.sh (it installs the OpenAI SDK \
             in a virtual environment), or point it at a Python with `openai` installed"
        ),
    }
}

#[tokio::test]
async fn the_openai_python_sdk_works_against_the_gateway() {
    let a = Upstream::start("qwen-72b", "a").await;
    let open = format!(
        "models:\n  qwen-72b:\n    pools:\n      - name: dc-a\n        endpoints: [{{url: '{{a}}'}}]\n{POLICY}"
    );
    let gw = gateway(&open, &[("a", &a)]).await;
    let strict = gateway(&format!("{open}require_tenant: true\n"), &[("a", &a)]).await;
    // Breaks every stream after two tokens; the second pool continues it.
    let broken = Upstream::start("qwen-72b", "broken").await;
    broken.fault(serde_json::json!({"kind": "break", "after_tokens": 2}));
    let mut continues = stanch_mock::MockConfig::new("qwen-72b", "continues");
    continues.prefill = stanch_mock::Prefill::Continue;
    let continues = Upstream::with(continues).await;
    let resuming = gateway(
        &format!(
            "models:\n  qwen-72b:\n    pools:\n      - {{name: dc-a, endpoints: [{{url: '{{a}}'}}]}}\n      - {{name: dc-b, prefill: vllm, endpoints: [{{url: '{{b}}'}}]}}\n{POLICY}"
        ),
        &[("a", &broken), ("b", &continues)],
    )
    .await;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/sdk/openai_sdk.py");
    let mut command = std::process::Command::new(python());
    command
        .arg(script)
        .env("GATEWAY", &gw.base)
        .env("STRICT", &strict.base)
        .env("RESUMING", &resuming.base)
        .env("MOCK", &a.base);
    // On the blocking pool, so the gateway and the mock keep being served meanwhile.
    let out = tokio::task::spawn_blocking(move || command.output())
        .await
        .unwrap()
        .expect("the SDK script runs");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains(" passed, 0 failed"), "{text}");
}
