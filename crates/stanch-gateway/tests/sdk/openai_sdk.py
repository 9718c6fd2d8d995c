"""The OpenAI Python SDK against stanch-gateway, as an application uses it.

Run by crates/stanch-gateway/tests/it/sdk.rs, which starts a gateway in front of a
stanch-mock and passes their addresses: GATEWAY (tenants optional), STRICT (tenant
keys required), MOCK (the mock, for injecting faults) and RESUMING (a gateway whose
first pool breaks every stream after two tokens, and whose second continues it). Prints one line per check
and a closing "N passed, N failed"; exits non-zero if any failed.
"""

import json
import os
import sys
import time
import traceback
import urllib.request

import openai

GATEWAY = os.environ["GATEWAY"]
STRICT = os.environ["STRICT"]
MOCK = os.environ["MOCK"]
RESUMING = os.environ["RESUMING"]


def client(base=GATEWAY, key="acme-key", retries=0):
    return openai.OpenAI(api_key=key, base_url=base + "/v1", max_retries=retries, timeout=10)


def fault(spec):
    method = "DELETE" if spec is None else "PUT"
    data = None if spec is None else json.dumps(spec).encode()
    request = urllib.request.Request(MOCK + "/admin/fault", data=data, method=method)
    request.add_header("content-type", "application/json")
    urllib.request.urlopen(request).read()


def chat(c, **extra):
    return c.chat.completions.create(
        model="qwen-72b",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=4,
        **extra,
    )


def test_chat():
    completion = chat(client())
    assert completion.choices[0].message.content, completion
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage.completion_tokens == 4, completion.usage
    assert completion._request_id and len(completion._request_id) == 32, completion._request_id


def test_request_id_is_the_callers():
    raw = client().chat.completions.with_raw_response.create(
        model="qwen-72b",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=2,
        extra_headers={"x-request-id": "app-req-42"},
    )
    assert raw.headers["x-request-id"] == "app-req-42", dict(raw.headers)
    assert raw.headers.get("x-ratelimit-remaining-requests") == "9999"
    assert raw.parse().choices[0].message.content


def test_streaming_with_usage():
    stream = chat(client(), stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip(), chunks
    last = chunks[-1]
    assert last.choices == [], last
    assert last.usage is not None and last.usage.completion_tokens == 4, last
    assert all(c.usage is None for c in chunks[:-1])


def test_streaming_without_usage():
    chunks = list(chat(client(), stream=True))
    assert chunks and all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_stream_broken_midway_reads_as_one_whole_stream():
    def text(chunks):
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    usage = {"include_usage": True}
    whole = list(chat(client(), stream=True, stream_options=usage))
    # An error event would raise openai.APIError here.
    resumed = list(chat(client(RESUMING), stream=True, stream_options=usage))
    assert text(resumed) == text(whole), (text(resumed), text(whole))
    assert len({c.id for c in resumed}) == 1, [c.id for c in resumed]
    assert resumed[-2].choices[0].finish_reason == "stop", resumed[-2]
    assert resumed[-1].usage.completion_tokens == whole[-1].usage.completion_tokens
    assert resumed[-1].usage.prompt_tokens == whole[-1].usage.prompt_tokens


def test_embeddings():
    result = client().embeddings.create(model="qwen-72b", input=["one two", "three"])
    assert len(result.data) == 2 and len(result.data[0].embedding) == 8, result
    assert result.usage.prompt_tokens == 3


def test_models():
    models = client().models.list()
    assert any(m.id == "qwen-72b" for m in models.data), models


def test_bad_request_is_the_sdks_bad_request_error():
    try:
        client().chat.completions.create(
            model="qwen-72b",
            messages=[{"role": "user", "content": "word " * 5000}],
            max_tokens=2,
        )
    except openai.BadRequestError as e:
        assert e.status_code == 400
        assert e.code == "context_length_exceeded", e.body
        assert e.request_id, "the error carries the request id"
        return
    raise AssertionError("no BadRequestError")


def test_unknown_key_is_an_authentication_error():
    try:
        chat(client(STRICT, key="not-a-tenant"))
    except openai.AuthenticationError as e:
        assert e.status_code == 401
        assert e.code == "invalid_api_key", e.body
        return
    raise AssertionError("no AuthenticationError")


def test_unknown_model_is_not_found():
    try:
        client().chat.completions.create(
            model="gpt-nonexistent", messages=[{"role": "user", "content": "x"}]
        )
    except openai.NotFoundError as e:
        assert e.status_code == 404, e
        return
    except openai.BadRequestError as e:
        assert e.status_code == 400, e
        return
    raise AssertionError("no error for an unknown model")


def test_the_sdk_retries_a_gateway_503_after_its_retry_after():
    fault({"kind": "status", "status": 500})
    try:
        started = time.monotonic()
        try:
            client(retries=1).embeddings.create(model="qwen-72b", input="x")
        except openai.InternalServerError as e:
            took = time.monotonic() - started
            assert e.status_code == 503, e
            assert e.response.headers["retry-after"] == "1"
            assert took >= 0.9, f"retried after {took:.2f} s, not after Retry-After"
            return
        raise AssertionError("no InternalServerError")
    finally:
        fault(None)


def test_a_recovered_upstream_answers_after_a_retry():
    fault({"kind": "status", "status": 500, "count": 100})
    stats = []

    def clear_soon():
        time.sleep(0.5)
        fault(None)

    import threading

    threading.Thread(target=clear_soon).start()
    result = client(retries=3).embeddings.create(model="qwen-72b", input="x")
    assert len(result.data) == 1
    stats.append(result)


def main():
    tests = [(name, f) for name, f in globals().items() if name.startswith("test_")]
    failed = 0
    for name, f in tests:
        try:
            f()
            print(f"ok      {name}")
        except Exception:
            failed += 1
            print(f"FAILED  {name}")
            traceback.print_exc(file=sys.stdout)
    print(f"openai {openai.__version__}: {len(tests) - failed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
