"""The API's whole-document option (issue 27): `x_llmweb: {"whole_document": true}` parsed and
checked field by field (web/api_wire.py); the figures come back in the response's `x_llmweb.document`
(the real-model test is tests/chat/test_document_model.py)."""

from __future__ import annotations

import pytest

from llmweb.web.api_wire import ApiError, parse_request


def body(**kw) -> dict:
    return {"model": "llmweb", "messages": [{"role": "user", "content": "Summarise guide.md"}], **kw}


def test_whole_document_is_off_unless_asked():
    assert parse_request(body(), ["llmweb"], 1000).whole_document is False
    assert parse_request(body(x_llmweb={}), ["llmweb"], 1000).whole_document is False
    assert parse_request(body(x_llmweb={"whole_document": True}), ["llmweb"], 1000).whole_document is True


@pytest.mark.parametrize(
    "ours, param",
    [
        ({"whole_document": "yes"}, "x_llmweb.whole_document"),
        ({"whole_doc": True}, "x_llmweb"),
        ({"<img src=x>": True}, "x_llmweb"),
        ("whole_document", "x_llmweb"),
    ],
)
def test_a_bad_x_llmweb_is_a_400_naming_the_field(ours, param):
    with pytest.raises(ApiError) as e:
        parse_request(body(x_llmweb=ours), ["llmweb"], 1000)
    assert e.value.status == 400 and e.value.param == param
