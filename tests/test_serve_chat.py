"""``/v1/chat/completions`` and API keys, on a real ``serve`` process driven by the official
``openai`` client, against Hugging Face's own chat rendering and greedy generate on the
original checkpoint (cpu, fp32, the compiled demo release)."""

from __future__ import annotations

import pytest

from pipeline.server.protocol import ApiError
from tests.serve_helpers import ServerProcess, get, post

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

MODEL = "tiny-llama"
KEY = "sk-test-0123456789"
CHAT = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Batch?"}]


@pytest.fixture(scope="module")
def server(installed, tmp_path_factory):
    """The key comes from the environment, as a Kubernetes secret gives it."""
    log = tmp_path_factory.mktemp("serve-chat") / "serve.log"
    with ServerProcess(installed[1], log, env={"INF2_SERVE_API_KEY": KEY}) as s:
        s.wait_ready()
        yield s


@pytest.fixture(scope="module")
def hf(tiny_checkpoint):
    """The original checkpoint in transformers: its chat rendering and greedy generate."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_checkpoint))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_checkpoint), dtype=torch.float32)

    def chat(messages, max_new_tokens):
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0
        )
        new = out[0, len(ids) :].tolist()
        return ids, new, tok.decode(new, skip_special_tokens=True)

    chat.tokenizer = tok  # type: ignore[attr-defined]
    return chat


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def test_greedy_chat_equals_hugging_face_apply_chat_template_and_generate(client, hf):
    prompt, new, text = hf(CHAT, 10)
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10)
    (choice,) = r.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == text
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    # usage counts are the tokenizer's: the rendered prompt, the generated tokens
    assert r.usage.prompt_tokens == len(prompt)
    assert r.usage.completion_tokens == len(new)
    assert r.usage.total_tokens == len(prompt) + len(new)
    assert choice.finish_reason == ("stop" if len(new) < 10 else "length")
    # max_completion_tokens is the same limit under its newer name
    again = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=10)
    assert again.choices[0].message.content == text


def test_a_conversation_can_send_back_an_answers_message_as_it_came(client):
    first = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4)
    echoed = first.choices[0].message.model_dump()  # with refusal, tool_calls ... as None
    turns = [*CHAT, echoed, {"role": "user", "content": "More?"}]
    r = client.chat.completions.create(model=MODEL, messages=turns, max_tokens=4)
    assert r.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens


def test_streamed_chat_is_the_whole_answer_in_deltas_with_usage_last(client):
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(deltas) == whole.choices[0].message.content
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == whole.choices[0].finish_reason and not any(reasons[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_ends_the_chat_answer_before_it(client, stream):
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12)
    text = full.choices[0].message.content
    stop = text.strip()[len(text.strip()) // 2 :][:3]
    assert stop, text
    kwargs = {"model": MODEL, "messages": CHAT, "max_tokens": 12, "stop": [stop]}
    if stream:
        got = "".join(
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(stream=True, **kwargs)
            if c.choices
        )
    else:
        r = client.chat.completions.create(**kwargs)
        got = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop"
    assert got == text[: text.index(stop)]


def test_without_max_tokens_the_answer_may_fill_the_largest_bucket(client, hf):
    r = client.chat.completions.create(model=MODEL, messages=CHAT)
    prompt, _, _ = hf(CHAT, 1)
    largest = 64  # the demo release's buckets are b1/b2 × s32/s64
    room = largest - len(prompt)  # cpu keeps every token but the last in the cache
    assert r.usage.completion_tokens <= room + 1
    if r.choices[0].finish_reason == "length":
        assert r.usage.completion_tokens == room + 1


def test_seeded_sampling_is_reproducible_and_seeds_differ(client):
    def chat(seed, **kw):
        r = client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=12, temperature=0.9, seed=seed, **kw
        )
        return r.choices[0].message.content

    assert chat(1) == chat(1)
    assert len({chat(s) for s in range(4)}) > 1
    assert chat(3, top_p=0.8) == chat(3, top_p=0.8)
    assert chat(3, extra_body={"top_k": 5}) == chat(3, extra_body={"top_k": 5})

    # completions sample the same way, token ids included
    def complete(seed):
        r = client.completions.create(
            model=MODEL, prompt=[1, 17, 42], max_tokens=10, temperature=1.2, seed=seed
        )
        return r.choices[0].model_extra["token_ids"]

    assert complete(7) == complete(7) and complete(7) != complete(8)
    # temperature 0 is greedy, whatever the seed
    greedy = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12)
    zero = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=12, temperature=0, seed=5
    )
    assert zero.choices[0].message.content == greedy.choices[0].message.content


def test_sampling_a_release_cannot_honour_is_a_400():
    """Neuron exports that sample on the device: no per-request seed, top_k ≤ max_topk."""
    import asyncio
    from types import SimpleNamespace

    from pipeline.server.admission import _sampling
    from pipeline.server.protocol import parse_request

    device = SimpleNamespace(seeded=False, max_topk=256)

    def params(**kw):
        req = parse_request({"model": MODEL, "prompt": [1], **kw})
        return _sampling(device, req)

    assert params(temperature=0.7).temperature == 0.7  # a fresh seed, not the client's
    assert params(temperature=0, seed=3).greedy  # greedy needs no seed
    with pytest.raises(ApiError, match="seed cannot be honoured") as e:
        params(temperature=0.7, seed=3)
    assert e.value.param == "seed"
    assert params(temperature=0.7, top_k=256).top_k == 256
    with pytest.raises(ApiError, match="above 256") as e:
        params(temperature=0.7, top_k=257)
    assert asyncio.iscoroutinefunction(_sampling) is False


@pytest.mark.parametrize(
    ("change", "status", "param"),
    [
        ({"model": "gpt-4o"}, 404, "model"),
        ({"messages": []}, 400, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
        ({"messages": [{"role": "tool", "content": "42"}]}, 400, "messages.0.role"),
        ({"messages": [{"role": "user"}]}, 400, "messages.0.content"),
        (
            {"messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "x"}]}]},
            400,
            "messages.0.tool_calls",
        ),
        ({"messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content.str"),
        ({"temperature": -0.5}, 400, "temperature"),
        ({"temperature": float("nan")}, 400, "temperature"),
        ({"top_p": float("inf")}, 400, "top_p"),
        ({"top_p": 0}, 400, "top_p"),
        ({"top_p": 1.5}, 400, "top_p"),
        ({"logprobs": True}, 400, "logprobs"),
        ({"n": 2}, 400, "n"),
        ({"top_k": -2}, 400, "top_k"),
        ({"presence_penalty": 0.5}, 400, "presence_penalty"),
        ({"max_tokens": 0}, 400, "max_tokens"),
        ({"max_tokens": 4, "max_completion_tokens": 5}, 400, "max_completion_tokens"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
        ({"response_format": {"type": "json_object"}}, 400, "response_format"),
        ({"frobnicate": 1}, 400, "frobnicate"),
    ],
)
def test_every_bad_field_is_an_openai_error(server, change, status, param):
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 4, **change}
    got, answer, _ = post(
        server.url + "/v1/chat/completions", body, headers={"Authorization": f"Bearer {KEY}"}
    )
    assert got == status, answer
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param, error


def test_the_openai_client_raises_its_own_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=CHAT)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=MODEL, messages=CHAT, temperature=-1)


def test_the_api_key_guards_v1_and_leaves_the_probes_open(server, client):
    for key in ("sk-wrong", KEY + "x", KEY[:-1]):
        bad = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            bad.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
        assert e.value.status_code == 401
        assert e.value.body["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model=MODEL, prompt=[1, 2], max_tokens=2)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    # no key at all (the openai client always sends one)
    status, body, headers = post(
        server.url + "/v1/completions", {"model": MODEL, "prompt": [1, 2], "max_tokens": 2}
    )
    assert status == 401 and set(body["error"]) == {"message", "type", "param", "code"}
    assert "missing API key" in body["error"]["message"]
    assert headers["WWW-Authenticate"] == "Bearer"
    # the right key works on every /v1 route
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.completions.create(model=MODEL, prompt=[1, 2], max_tokens=2).choices
    # probes and scraping need no key
    for path in ("/health", "/ready", "/metrics"):
        assert get(server.url + path)[0] == 200, path
    status, text = get(server.url + "/metrics")
    assert 'inf2_serve_requests_total{outcome="unauthorized"}' in text


def test_check_key_takes_the_bearer_scheme_in_any_case_and_nothing_else():
    from pipeline.server.auth import check_key

    check_key(None, None)  # no key configured: open
    check_key(KEY, f"Bearer {KEY}")
    check_key(KEY, f"bearer  {KEY} ")
    for header in (None, "", "Bearer", f"Basic {KEY}", f"Bearer {KEY}0", f"{KEY}"):
        with pytest.raises(ApiError) as e:
            check_key(KEY, header)
        assert e.value.status == 401 and e.value.headers == {"WWW-Authenticate": "Bearer"}


def test_a_release_without_a_chat_template_is_a_400_naming_the_fix():
    from pipeline.server.chat import render

    class NoTemplate:
        chat_template = None

    with pytest.raises(ApiError, match="no chat template") as e:
        render(NoTemplate(), [{"role": "user", "content": "hi"}])
    assert e.value.status == 400 and "/v1/completions" in e.value.message
    with pytest.raises(ApiError, match="no tokenizer"):
        render(None, [{"role": "user", "content": "hi"}])


def test_a_template_that_refuses_the_messages_is_a_400():
    from pipeline.server.chat import render

    class Strict:
        chat_template = "{{ raise_exception('roles must alternate') }}"

        def apply_chat_template(self, *a, **k):
            raise ValueError("roles must alternate user/assistant")

    with pytest.raises(ApiError, match="roles must alternate") as e:
        render(Strict(), [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    assert e.value.status == 400


def test_the_demo_release_carries_the_chat_template(installed):
    from transformers import AutoTokenizer

    from pipeline.tiny_model import CHAT_TEMPLATE

    tok = AutoTokenizer.from_pretrained(str(installed[1] / "current"), local_files_only=True)
    assert tok.chat_template == CHAT_TEMPLATE


def test_chat_max_tokens_sets_the_answer_length_a_chat_names_none_of(installed, tmp_path):
    log = tmp_path / "serve.log"
    with ServerProcess(installed[1], log, "--chat-max-tokens", "3") as s:
        s.wait_ready()
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        r = c.chat.completions.create(model=MODEL, messages=CHAT)
        assert r.usage.completion_tokens <= 3
        if r.choices[0].finish_reason == "length":
            assert r.usage.completion_tokens == 3
        # a request's own max_tokens still wins
        r = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6)
        assert r.usage.completion_tokens == 6 or r.choices[0].finish_reason == "stop"


def test_messages_too_long_for_any_bucket_are_refused_before_rendering(server):
    huge = [{"role": "user", "content": "x" * (64 * 64 + 1)}]  # the largest bucket is s64
    status, body, _ = post(
        server.url + "/v1/chat/completions",
        {"model": MODEL, "messages": huge},
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    assert body["error"]["param"] == "messages"
