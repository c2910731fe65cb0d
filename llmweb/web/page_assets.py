"""Gradio's page with one bug of its frontend fixed: the file that has it is served patched, by a
route in front of Gradio's own (cli/main.py), and every other file as Gradio serves it.

The bug (Gradio 6.31's `assets/statustracker-*.js`): a status tracker counts an event's pending
seconds in a `requestAnimationFrame` loop that asks for its next frame while a flag is set, and an
effect clears the flag when the tracker's status leaves "pending". A tracker unmounted while
pending (one is, as every visit's page loads) never runs that effect, so its loop asks for a frame
at the screen's rate for as long as the tab is open: 60 empty frames a second, each waking the
browser's renderer, compositor and display threads. On the 2-core machine an idle llmweb tab
took 60 frames a second and 0.078 of a core in headless Chromium; with the fix, none and 0.004
(`python -m llmweb bench busy`'s idle line; tests/web/test_browser.py counts the frames).

The fix: the loop asks for its next frame only while the status is still "pending", which is what
the effect already ensures for a mounted tracker, so nothing a visitor sees changes.

Must not: change any other file or byte of Gradio's frontend; route anything when the installed
Gradio's file lacks the exact code (another version: its own file is served, and a warning says so).
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)

TRACKER_GLOB = "statustracker-*.js"
LOOP = "F(Pe,(performance.now()-w(de))/1e3),W&&ze()"  # the loop's next frame, as Gradio 6.31 ships it
FIXED = "F(Pe,(performance.now()-w(de))/1e3),W&&o.status===`pending`&&ze()"


def assets_dir() -> Path:
    import gradio

    return Path(gradio.__file__).parent / "templates" / "frontend" / "assets"


def patched(assets: Path) -> dict[str, bytes]:
    """{file name: the fixed text} for each tracker file in `assets` that has the loop exactly once."""
    out: dict[str, bytes] = {}
    for path in sorted(assets.glob(TRACKER_GLOB)):
        text = path.read_text(encoding="utf-8")
        if text.count(LOOP) == 1:
            out[path.name] = text.replace(LOOP, FIXED).encode("utf-8")
    if not out:
        log.warning("page assets: no %s in %s has the known timer loop; Gradio's own is served", TRACKER_GLOB, assets)
    return out


def page_asset_routes(assets: Path | None = None) -> list:
    """The routes that serve the fixed files at Gradio's own paths (/assets/NAME); to go in front of Gradio's."""
    from starlette.responses import Response
    from starlette.routing import Route

    def serve(body: bytes):
        async def endpoint(request) -> Response:
            return Response(body, media_type="text/javascript", headers={"Cache-Control": "no-cache"})

        return endpoint

    fixed = patched(assets or assets_dir())
    return [Route(f"/assets/{name}", serve(body), methods=["GET"]) for name, body in fixed.items()]
