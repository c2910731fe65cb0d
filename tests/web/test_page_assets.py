"""web/page_assets.py: the one fixed file of Gradio's page, served in front of Gradio's own.

A real browser counts the frames of an idle tab in tests/web/test_browser.py; these check the file
and the route without one.
"""

from __future__ import annotations

import logging

from starlette.applications import Starlette
from starlette.testclient import TestClient

from llmweb.web import page_assets


def test_the_installed_gradio_has_the_loop_once_and_the_route_serves_its_file_with_only_the_fix():
    [original] = sorted(page_assets.assets_dir().glob(page_assets.TRACKER_GLOB))
    text = original.read_text(encoding="utf-8")
    assert text.count(page_assets.LOOP) == 1, "Gradio's tracker changed: does its timer loop still outlive it?"

    client = TestClient(Starlette(routes=page_assets.page_asset_routes()))
    r = client.get(f"/assets/{original.name}")

    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/javascript")
    assert r.text == text.replace(page_assets.LOOP, page_assets.FIXED)
    assert r.text.count("o.status===`pending`&&ze()") == 1 and len(r.text) == len(text) + len("o.status===`pending`&&")
    assert client.get("/assets/index.js").status_code == 404  # nothing else is routed


def test_a_gradio_without_the_known_loop_gets_no_route_and_a_warning(tmp_path, caplog):
    (tmp_path / "statustracker-NEW.js").write_text("function ze(){requestAnimationFrame(()=>{W&&ze()})}")
    (tmp_path / "other.js").write_text(page_assets.LOOP)  # the code, but not in a tracker's file

    with caplog.at_level(logging.WARNING, logger=page_assets.__name__):
        routes = page_assets.page_asset_routes(tmp_path)

    assert routes == []
    assert "Gradio's own is served" in caplog.text


def test_a_tracker_file_with_the_loop_twice_is_left_as_it_is(tmp_path):
    (tmp_path / "statustracker-TWICE.js").write_text(page_assets.LOOP + ";" + page_assets.LOOP)

    assert page_assets.patched(tmp_path) == {}
