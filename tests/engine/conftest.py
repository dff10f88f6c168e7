"""Server fixtures shared by the server and hostile-input tests: a stories260K model with a
ChatML-like template (``chatml``), a server on 127.0.0.1 with small limits and an API key
(``guarded``) and its base URL (``url``). Module-scoped: each test module gets its own."""

from __future__ import annotations

import pytest
from serving import KEY, TEMPLATE, running_server, stories_native_model, with_chat_template

from verispec.server.guard import Limits


@pytest.fixture(scope="module")
def chatml():
    return with_chat_template(stories_native_model(), TEMPLATE)


@pytest.fixture(scope="module")
def guarded(chatml):
    limits = Limits(max_body_bytes=32_768, header_timeout_s=0.5, body_timeout_s=0.5, api_key=KEY)
    with running_server(chatml, max_queue=3, limits=limits) as s:
        yield s


@pytest.fixture(scope="module")
def url(guarded) -> str:
    return guarded[0]
