"""What OpenAI clients send beyond one prompt and one choice, through the real `openai` client against a server over
a scripted front (nothing compiles): lists of prompts on /v1/completions, `n` choices per prompt (their order, their
seeds, usage counting each prompt once, streamed chunks by index), and the README's table of request fields checked
against the server's request models and their refusals. The shipped pair's n choices are in test_server.py."""
from __future__ import annotations

import json
import os

import httpx
import pytest
from test_agent_api import MODEL, ScriptedFront, _client, tokenizer  # noqa: F401 (a fixture)
from test_server import serve_in_thread

from kdtree_jax.server import ServerSettings, build_app
from kdtree_jax.server.protocol import ChatCompletionRequest, CompletionRequest, ResponsesRequest
from kdtree_jax.server.serving_common import choice_seed
from kdtree_jax.serving import ServeConfig

PROMPTS = ["def alpha():", "class Beta:"]
MAX_QUEUE = 16


@pytest.fixture(scope="module")
def echo(tokenizer):
    """(front, base URL, tokenizer): every request's reply is `<prompt> #<seed>`, so a choice says which prompt and
    which seed it came from."""
    front = ScriptedFront(tokenizer, ServeConfig(num_pages=4, max_queue=MAX_QUEUE))
    front.script = lambda ids, params: f"{tokenizer.decode(ids)} #{params.seed}"
    app = build_app(front, tokenizer, ServerSettings(model_names=(MODEL,)))
    with serve_in_thread(app) as url:
        yield front, url, tokenizer


def _prompt_and_seed(text: str) -> tuple[str, int]:
    prompt, seed = text.rsplit(" #", 1)
    return prompt, int(seed)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("as_ids", [False, True])
def test_a_list_of_prompts_gives_n_choices_each_in_openais_order(echo, as_ids):
    """Choice i * n + j is sample j of prompt i, text or token-id prompts alike; usage counts each prompt once."""
    front, url, tok = echo
    n, seed = 3, 1234
    prompt = [tok.encode(p) for p in PROMPTS] if as_ids else PROMPTS
    r = _client(url).completions.create(model=MODEL, prompt=prompt, n=n, seed=seed, max_tokens=32)
    assert [c.index for c in r.choices] == list(range(len(PROMPTS) * n))
    got = [_prompt_and_seed(c.text) for c in r.choices]
    assert got == [(p, choice_seed(seed, j)) for p in PROMPTS for j in range(n)]
    prompt_tokens = sum(len(tok.encode(p)) for p in PROMPTS)
    completion_tokens = sum(len(tok.encode(c.text)) for c in r.choices)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (prompt_tokens, completion_tokens)
    assert r.usage.total_tokens == prompt_tokens + completion_tokens
    streamed = {}
    for chunk in _client(url).completions.create(model=MODEL, prompt=prompt, n=n, seed=seed, max_tokens=32,
                                                 stream=True, stream_options={"include_usage": True}):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert chunk.usage.prompt_tokens == prompt_tokens and chunk.usage.completion_tokens == completion_tokens
    assert [streamed[i] for i in range(len(r.choices))] == [c.text for c in r.choices]


@pytest.mark.timeout(60)
def test_n_choices_draw_seeds_of_their_own(echo):
    """With a seed: sample 0 uses it (as the same request with n = 1 does), the others seeds derived from it and their
    index, the same on every request, all different; without one, each draws its own. Sample 0 of every prompt is
    submitted before any sibling (the siblings then find its pages in the prefix cache)."""
    front, url, _ = echo
    client = _client(url)
    n = 8

    def seeds(**kw) -> list[int]:
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=n, **kw)
        assert [c.index for c in r.choices] == list(range(n))
        return [_prompt_and_seed(c.message.content)[1] for c in r.choices]

    seeded = seeds(seed=77)
    assert seeded == seeds(seed=77) and seeded[0] == 77 and len(set(seeded)) == n
    assert seeded[1:] != seeds(seed=78)[1:]
    assert len(set(seeds())) == n
    front.params.clear()
    client.completions.create(model=MODEL, prompt=PROMPTS, n=3, seed=5)
    assert [p.seed for p in front.params] == [5, 5] + [choice_seed(5, j) for j in (1, 2)] * 2


@pytest.mark.timeout(60)
def test_streamed_chat_choices_carry_their_index(echo):
    _, url, _ = echo
    texts, roles = {}, {}
    for chunk in _client(url).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                      n=3, seed=9, stream=True):
        (c,) = chunk.choices
        roles[c.index] = roles.get(c.index) or c.delta.role
        texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert roles == {0: "assistant", 1: "assistant", 2: "assistant"}
    assert [_prompt_and_seed(texts[j])[1] for j in range(3)] == [choice_seed(9, j) for j in range(3)]


BAD = {  # name: (path, body fields, the field the 400 names)
    "n_above_16": ("/v1/completions", {"prompt": "x", "n": 17}, "n"),
    "n_zero": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
    "n_string": ("/v1/completions", {"prompt": "x", "n": "2"}, "n"),
    "mixed_prompt_list": ("/v1/completions", {"prompt": ["x", [1, 2]]}, "prompt"),
    "empty_prompt_list": ("/v1/completions", {"prompt": []}, "prompt"),
    "more_choices_than_the_queue": ("/v1/completions", {"prompt": ["a", "b"], "n": MAX_QUEUE // 2 + 1}, "prompt"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_n_or_prompt_list_is_a_400_naming_the_field(echo, case):
    front, url, _ = echo
    path, fields, param = BAD[case]
    before = len(front.params)
    r = httpx.post(url + path, json={"model": MODEL, "max_tokens": 4, **fields}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert len(front.params) == before  # refused before anything reached the engine


# ---- the README's table of request fields ----------------------------------------------------------------------
README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
ENDPOINTS = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
             "/v1/responses": ResponsesRequest}
TREATMENTS = ("supported", "accepted", "refused")


def readme_fields() -> tuple[list[str], dict[str, list[str]]]:
    """(the endpoints, in column order; field -> its cells) of the README's "Request fields" table."""
    text = open(README).read()
    section = text[text.index("### Request fields"):]
    section = section[:section.index("\n#", 1)]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in section.splitlines()
            if line.startswith("|")]
    header, rows = rows[0], rows[2:]
    return header[1:], {row[0].strip("`"): row[1:] for row in rows}


@pytest.mark.timeout(30)
def test_the_readme_lists_every_request_field_as_the_models_treat_it():
    """Each field of each endpoint's request model has a row; a field is "refused [off value]" exactly where the
    model refuses it but at that value, "supported" or "accepted" where it takes it, "-" where it is no field."""
    endpoints, table = readme_fields()
    assert set(endpoints) == set(ENDPOINTS)
    assert set(table) == {f for model in ENDPOINTS.values() for f in model.model_fields}
    for field, cells in table.items():
        assert len(cells) == len(endpoints), field
        for endpoint, cell in zip(endpoints, cells):
            model = ENDPOINTS[endpoint]
            if field not in model.model_fields:
                assert cell == "-", (endpoint, field, cell)
                continue
            treatment = cell.split()[0].rstrip(":")
            assert treatment in TREATMENTS, (endpoint, field, cell)
            off = model.UNSUPPORTED.get(field)
            assert (treatment == "refused") == (off is not None), (endpoint, field, cell)
            if off is not None:
                assert cell.startswith(f"refused [{json.dumps(off[-1])}]"), (endpoint, field, cell)


REFUSED = [(endpoint, field) for endpoint, model in ENDPOINTS.items() for field in model.UNSUPPORTED]
MINIMAL = {"/v1/completions": {"prompt": "x"}, "/v1/chat/completions": {"messages": [{"role": "user",
                                                                                        "content": "x"}]},
           "/v1/responses": {"input": "x"}}


@pytest.mark.timeout(60)
def test_every_refused_field_is_a_400_naming_it_unless_off(echo):
    front, url, _ = echo
    with httpx.Client(base_url=url, timeout=30) as http:
        for endpoint, field in REFUSED:
            before = len(front.params)
            r = http.post(endpoint, json={"model": MODEL, **MINIMAL[endpoint], field: "on"})
            assert r.status_code == 400 and r.json()["error"]["param"] == field, (endpoint, field, r.text)
            off = ENDPOINTS[endpoint].UNSUPPORTED[field][-1]
            r = http.post(endpoint, json={"model": MODEL, **MINIMAL[endpoint], field: off, "max_tokens": 2})
            assert r.status_code == 200, (endpoint, field, r.text)
            assert len(front.params) == before + 1
