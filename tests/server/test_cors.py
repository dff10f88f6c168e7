"""CORS for browser clients (``guard.Cors``, ``--allowed-origins``): by default no origin may
read answers (no CORS headers; a preflight is refused); with origins allowed, a preflight is
answered without the API key (browsers never send it on one), allowed origins read answers
(errors included) and other origins get no grant. A real server on the stories model
(``serving.running_server``)."""

from __future__ import annotations

import httpx
import pytest
from serving import AUTH, KEY, MODEL, one_line_exit_2, running_server, stories_native_model

from verispec.server.guard import Cors, Limits, parse_list_option

PAGE = "http://localhost:3000"
PREFLIGHT = {"origin": PAGE, "access-control-request-method": "POST",
             "access-control-request-headers": "authorization, content-type"}


def _post(url: str, headers: dict[str, str]) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "Once", "max_tokens": 2},
                      headers=headers, timeout=60)


@pytest.fixture(scope="module")
def cors_server():
    with running_server(stories_native_model(), limits=Limits(api_key=KEY), cors=Cors((PAGE,))) as s:
        yield s[0]


def test_preflight_is_answered_without_the_api_key(cors_server) -> None:
    r = httpx.options(f"{cors_server}/v1/completions", headers=PREFLIGHT, timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == PAGE
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    assert "access-control-allow-credentials" not in r.headers  # the key is a header, never cookies


def test_allowed_origin_reads_answers_and_errors(cors_server) -> None:
    r = _post(cors_server, AUTH | {"origin": PAGE})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == PAGE
    assert r.json()["choices"][0]["text"]
    r = _post(cors_server, {"origin": PAGE})  # no key: the 401 is readable by the page, so it can say why
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == PAGE


def test_other_origins_get_no_grant(cors_server) -> None:
    r = httpx.options(f"{cors_server}/v1/completions", headers=PREFLIGHT | {"origin": "http://evil.example"},
                      timeout=30)
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = _post(cors_server, AUTH | {"origin": "http://evil.example"})
    assert "access-control-allow-origin" not in r.headers
    r = httpx.options(f"{cors_server}/v1/completions", timeout=30)  # not a preflight: the key is still needed
    assert r.status_code == 401


def test_no_origin_is_allowed_by_default() -> None:
    with running_server(stories_native_model()) as (url, _, _):
        r = httpx.options(f"{url}/v1/completions", headers=PREFLIGHT, timeout=30)
        assert r.status_code >= 400 and "access-control-allow-origin" not in r.headers
        r = _post(url, {"origin": PAGE})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_any_origin_with_star() -> None:
    with running_server(stories_native_model(), cors=Cors(("*",))) as (url, _, _):
        r = httpx.options(f"{url}/v1/chat/completions", headers=PREFLIGHT | {"origin": "http://a.example:8080"},
                          timeout=30)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] in ("*", "http://a.example:8080")


def test_cors_options_are_checked() -> None:
    assert parse_list_option(['["http://a:1", "http://b"]', "http://c,http://d"]) == (
        "http://a:1", "http://b", "http://c", "http://d")
    for bad in (("http://localhost:3000/",), ("localhost:3000",), ("http://a/path",)):
        with pytest.raises(ValueError, match="allowed-origins"):
            Cors(bad)
    with pytest.raises(ValueError, match="allowed-methods"):
        Cors(("*",), ("GET POST",))
    with pytest.raises(ValueError, match="JSON list"):
        parse_list_option(['["a", 1]'])
    assert Cors().middleware_options() is None
    line = one_line_exit_2("serve", "--model", MODEL, "--allowed-origins", "http://localhost:3000/",
                           needle="allowed-origins")
    assert "trailing" in line
