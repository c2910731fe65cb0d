"""Fetching a model from the Hub (engine/hub.py) against a local stand-in for the Hub's endpoints
(tests/fake_hub.py): the plan before any download, GGUF and transformers repos, a cut download resumed,
offline and unreachable said at once, hostile names, the size cap. Real huggingface_hub code paths."""

from __future__ import annotations

import random
import socket
import time

import pytest

from llmweb.engine import hub
from llmweb.errors import DownloadError, InputError
from tests.fake_hub import FakeHub

GGUF_REPO = "someone/tiny-GGUF"
Q4 = random.Random(4).randbytes(200_000)
Q8 = random.Random(8).randbytes(300_000)
MAX = 10**9


@pytest.fixture
def fake():
    import huggingface_hub.constants as hf

    old = hf.HF_HUB_OFFLINE
    hf.HF_HUB_OFFLINE = False  # these tests are online (against the stand-in) whatever the environment says
    with FakeHub() as h:
        h.add(GGUF_REPO, {"README.md": b"# tiny", "tiny-Q4_K_M.gguf": Q4, "sub/tiny-Q8_0.gguf": Q8})
        yield h
    hf.HF_HUB_OFFLINE = old


def downloads(h: FakeHub) -> list[str]:
    """Requests that moved file bytes (GET of a file), not metadata."""
    return [p for m, p, _ in h.requests if m == "GET" and not p.startswith("/api/")]


def test_the_plan_gives_files_and_size_before_anything_downloads(fake):
    p = hub.plan(GGUF_REPO, "sub/tiny-Q8_0.gguf", endpoint=fake.url)
    assert (p.kind, p.target, p.total_bytes) == ("gguf", "tiny-Q8_0.gguf", len(Q8))
    assert [f.name for f in p.files] == ["sub/tiny-Q8_0.gguf"] and p.commit == fake.repos[GGUF_REPO].commit
    assert p.summary() == f"{GGUF_REPO} at main (commit {p.commit[:10]}): 1 file, 300 kB"
    assert downloads(fake) == [] and fake.count("HEAD", f"/{GGUF_REPO}/resolve/{p.commit}/") == 1


def test_a_gguf_repo_without_a_file_lists_its_gguf_files_with_sizes(fake):
    with pytest.raises(DownloadError) as e:
        hub.plan(GGUF_REPO, endpoint=fake.url)
    assert str(e.value) == (
        f"{GGUF_REPO} is a GGUF repo: name one of its .gguf files after the id: "
        "sub/tiny-Q8_0.gguf (300 kB), tiny-Q4_K_M.gguf (200 kB)."
    )
    assert e.value.choices == (("sub/tiny-Q8_0.gguf", 300_000), ("tiny-Q4_K_M.gguf", 200_000))
    with pytest.raises(DownloadError, match=r"has no file tiny-Q2\.gguf; its \.gguf files: sub/tiny-Q8_0"):
        hub.plan(GGUF_REPO, "tiny-Q2.gguf", endpoint=fake.url)


def test_a_gguf_file_lands_complete_with_its_bytes(fake, tmp_path):
    p = hub.plan(GGUF_REPO, "tiny-Q4_K_M.gguf", endpoint=fake.url)
    seen: list[tuple[int, int, str]] = []
    path = hub.fetch(p, tmp_path / "models", lambda *a: seen.append(a), max_bytes=MAX)
    assert path == tmp_path / "models" / "tiny-Q4_K_M.gguf" and path.read_bytes() == Q4
    assert seen[-1] == (len(Q4), len(Q4), "checking tiny-Q4_K_M.gguf")
    assert [d for d, _, _ in seen] == sorted(d for d, _, _ in seen) and {t for _, t, _ in seen} == {len(Q4)}
    assert fake.served == len(Q4)
    left = sorted(str(x.relative_to(tmp_path / "models")) for x in (tmp_path / "models").rglob("*") if x.is_file())
    assert left == [".downloads/tiny-Q4_K_M.gguf.lock", "tiny-Q4_K_M.gguf"], "no partial file stays"
    again = len(fake.requests)
    assert hub.fetch(p, tmp_path / "models", max_bytes=MAX) == path and len(fake.requests) == again, "already there"


def test_a_transformers_repo_fetches_config_tokenizer_and_safetensors_never_pickles(fake, tmp_path):
    files = {
        name: random.Random(name).randbytes(1000)
        for name in (
            "config.json",
            "generation_config.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "model.safetensors.index.json",
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "consolidated.safetensors",  # the original copy of the same weights
            "pytorch_model.bin",
            "training_args.bin",
            "README.md",
            "onnx/model.onnx",
        )
    }
    fake.add("org/Small-LM", files)
    p = hub.plan("org/Small-LM", endpoint=fake.url)
    wanted = [
        "config.json",
        "generation_config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert (p.kind, p.target, [f.name for f in p.files]) == ("transformers", "org--Small-LM", wanted)
    path = hub.fetch(p, tmp_path, max_bytes=MAX)
    assert path == tmp_path / "org--Small-LM"
    assert sorted(x.name for x in path.iterdir()) == wanted
    assert all((path / n).read_bytes() == files[n] for n in wanted)
    asked = {p.rsplit("/", 1)[-1] for m, p, _ in fake.requests if "/resolve/" in p}
    assert not asked & {"pytorch_model.bin", "training_args.bin", "consolidated.safetensors", "model.onnx"}


def test_a_repo_with_pickle_weights_only_is_refused(fake):
    fake.add("old/pickled", {"config.json": b"{}", "pytorch_model.bin": b"\x80\x04pickle"})
    with pytest.raises(DownloadError) as e:
        hub.plan("old/pickled", endpoint=fake.url)
    assert str(e.value) == (
        "old/pickled publishes its weights only as pickle files (pytorch_model.bin), which can run code when "
        "loaded: llmweb fetches safetensors or GGUF weights only."
    )


BIG = random.Random(24).randbytes(24_000_000)  # more than huggingface_hub's 10 MB write chunk


def test_a_download_cut_midway_resumes_on_the_next_fetch_with_only_the_rest(fake, tmp_path):
    fake.add("someone/big-GGUF", {"big.gguf": BIG})
    p = hub.plan("someone/big-GGUF", "big.gguf", endpoint=fake.url)
    fake.cut_after, fake.then_down = 15_000_000, True  # the connection drops, then the Hub is down a while
    with pytest.raises(DownloadError, match=r"The download of big\.gguf stopped at .* of 24 MB \(HTTP 503\); fetch"):
        hub.fetch(p, tmp_path, max_bytes=MAX)
    assert not (tmp_path / "big.gguf").exists(), "a half download never looks like a model"
    [partial] = (tmp_path / ".downloads").rglob("*.incomplete")
    kept = partial.stat().st_size
    assert 0 < kept < 15_000_000 and partial.read_bytes() == BIG[:kept]
    fake.down, before = False, fake.served
    seen: list[int] = []
    path = hub.fetch(p, tmp_path, lambda done, total, what: seen.append(done), max_bytes=MAX)
    assert path.read_bytes() == BIG
    assert fake.served - before == len(BIG) - kept, "only the rest moved"
    assert [h.get("Range") for m, q, h in fake.requests if m == "GET" and q.startswith("/cdn/")][-1] == f"bytes={kept}-"
    assert seen[0] == kept and seen[-1] == len(BIG)
    assert not list((tmp_path / ".downloads").rglob("*.incomplete"))


def test_a_dropped_connection_resumes_within_the_same_fetch(fake, tmp_path):
    fake.add("someone/big-GGUF", {"big.gguf": BIG})
    p = hub.plan("someone/big-GGUF", "big.gguf", endpoint=fake.url)
    fake.cut_after = 15_000_000  # huggingface_hub's http_get retries with a Range after a second
    seen: list[int] = []
    path = hub.fetch(p, tmp_path, lambda done, total, what: seen.append(done), max_bytes=MAX)
    assert path.read_bytes() == BIG and max(seen) == len(BIG)
    ranges = [h.get("Range") for m, q, h in fake.requests if m == "GET" and q.startswith("/cdn/")]
    assert ranges[0] is None and ranges[1].startswith("bytes=") and len(ranges) == 2


def test_raising_from_the_progress_callback_stops_and_the_next_fetch_resumes(fake, tmp_path):
    """How a page cancels: its callback raises; the bytes written so far stay for the next fetch."""
    fake.add("someone/big-GGUF", {"big.gguf": BIG})
    p = hub.plan("someone/big-GGUF", "big.gguf", endpoint=fake.url)

    class Stop(Exception):
        pass

    def stop_past_20_mb(done: int, total: int, what: str) -> None:
        if done > 20_000_000:
            raise Stop

    with pytest.raises(Stop):
        hub.fetch(p, tmp_path, stop_past_20_mb, max_bytes=MAX)
    assert hub.bytes_kept(p, tmp_path) > 0 and not (tmp_path / "big.gguf").exists()
    assert hub.fetch(p, tmp_path, max_bytes=MAX).read_bytes() == BIG


def test_a_file_whose_hash_differs_from_the_hubs_is_deleted_not_installed(fake, tmp_path):
    fake.add("someone/bad-GGUF", {"bad.gguf": Q4})
    p = hub.plan("someone/bad-GGUF", "bad.gguf", endpoint=fake.url)
    fake.blobs[p.files[0].sha256] = bytes(len(Q4))  # the CDN serves other bytes of the same size
    with pytest.raises(DownloadError, match=r"^bad\.gguf arrived damaged \(its hash differs from the Hub's\)"):
        hub.fetch(p, tmp_path, max_bytes=MAX)
    assert not (tmp_path / "bad.gguf").exists() and hub.bytes_kept(p, tmp_path) == 0


def test_offline_is_said_at_once(fake, monkeypatch):
    import huggingface_hub.constants as hf

    monkeypatch.setattr(hf, "HF_HUB_OFFLINE", True)
    t0 = time.perf_counter()
    with pytest.raises(DownloadError) as e:
        hub.plan(GGUF_REPO, "tiny-Q4_K_M.gguf", endpoint=fake.url)
    assert str(e.value) == hub.OFFLINE and time.perf_counter() - t0 < 1 and fake.requests == []


def test_an_unreachable_or_silent_hub_is_said_in_seconds():
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        closed = free.getsockname()[1]  # nothing listens there once closed
    t0 = time.perf_counter()
    with pytest.raises(DownloadError, match=rf"^The Hugging Face Hub at http://127.0.0.1:{closed} cannot be reached"):
        hub.plan(GGUF_REPO, "x.gguf", endpoint=f"http://127.0.0.1:{closed}")
    assert time.perf_counter() - t0 < 2
    with socket.socket() as silent:  # accepts the connection, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        t0 = time.perf_counter()
        with pytest.raises(DownloadError, match=r"cannot be reached \(ReadTimeout\)"):
            hub.plan(GGUF_REPO, "x.gguf", endpoint=f"http://127.0.0.1:{silent.getsockname()[1]}", timeout_s=0.5)
        assert time.perf_counter() - t0 < 2


def test_a_server_that_is_not_a_hub_is_said(fake):
    fake.not_a_hub = True
    with pytest.raises(DownloadError, match=rf"^The server at {fake.url} does not answer as the Hugging Face Hub"):
        hub.plan(GGUF_REPO, "tiny-Q4_K_M.gguf", endpoint=fake.url)


@pytest.mark.parametrize(
    "repo, filename, revision",
    [
        ("../etc", None, None),
        ("someone/tiny-GGUF/extra", None, None),
        ("/abs/path", None, None),
        ("someone\\tiny", None, None),
        ("someone/..", None, None),
        ("some one/tiny", None, None),
        ("https://huggingface.co/someone/tiny", None, None),
        ("someone/tiny-GGUF", "../x.gguf", None),
        ("someone/tiny-GGUF", "/etc/x.gguf", None),
        ("someone/tiny-GGUF", "sub\\x.gguf", None),
        ("someone/tiny-GGUF", "sub/../../x.gguf", None),
        ("someone/tiny-GGUF", "x.gguf\n", None),
        ("someone/tiny-GGUF", "model.bin", None),
        ("someone/tiny-GGUF", "tiny-Q4_K_M.gguf", "../main"),
        ("someone/tiny-GGUF", "tiny-Q4_K_M.gguf", "main branch"),
    ],
)
def test_hostile_names_are_refused_before_any_request(fake, repo, filename, revision):
    with pytest.raises(InputError):
        hub.plan(repo, filename, revision, endpoint=fake.url)
    assert fake.requests == []


def test_a_hostile_name_in_the_hubs_listing_is_refused(fake):
    fake.add("evil/repo", {"config.json": b"{}", "..\\evil.safetensors": b"x"})
    with pytest.raises(DownloadError, match=r"The Hub listed an unsafe file name in evil/repo"):
        hub.plan("evil/repo", endpoint=fake.url)


def test_the_size_cap_and_the_free_disk_refuse_before_downloading(fake, tmp_path, monkeypatch):
    p = hub.plan(GGUF_REPO, "tiny-Q4_K_M.gguf", endpoint=fake.url)
    with pytest.raises(DownloadError) as e:
        hub.fetch(p, tmp_path / "models", max_bytes=100_000)
    assert str(e.value) == f"{GGUF_REPO} needs 200 kB, more than the 100 kB llmweb fetches (LLMWEB_MAX_DOWNLOAD_GB)."
    monkeypatch.setattr(hub, "_free_bytes", lambda folder: hub.DISK_HEADROOM + 1000)
    with pytest.raises(DownloadError, match=r"needs 200 kB more on the disk of .*, which has 256 MB free"):
        hub.fetch(p, tmp_path / "models", max_bytes=MAX)
    assert downloads(fake) == [] and not (tmp_path / "models").exists()


def test_another_file_at_the_models_name_is_not_overwritten(fake, tmp_path):
    (tmp_path / "tiny-Q4_K_M.gguf").write_bytes(b"mine")
    p = hub.plan(GGUF_REPO, "tiny-Q4_K_M.gguf", endpoint=fake.url)
    with pytest.raises(DownloadError, match=r"tiny-Q4_K_M\.gguf already exists and is not this model"):
        hub.fetch(p, tmp_path, max_bytes=MAX)
    assert (tmp_path / "tiny-Q4_K_M.gguf").read_bytes() == b"mine"


def test_a_gated_repo_needs_a_token_and_the_token_stays_on_the_hub(fake, tmp_path):
    fake.add("corp/gated-GGUF", {"g.gguf": Q4}, gated_token="hf_right")
    with pytest.raises(DownloadError) as e:
        hub.plan("corp/gated-GGUF", "g.gguf", endpoint=fake.url, token=False)
    assert str(e.value) == (
        "corp/gated-GGUF is gated and needs a token: set HF_TOKEN (after accepting its terms on its Hub page)."
    )
    with pytest.raises(DownloadError, match=r"the token set \(HF_TOKEN\) has no access to it yet"):
        hub.plan("corp/gated-GGUF", "g.gguf", endpoint=fake.url, token="hf_wrong")
    p = hub.plan("corp/gated-GGUF", "g.gguf", endpoint=fake.url, token="hf_right")
    assert hub.fetch(p, tmp_path, max_bytes=MAX).read_bytes() == Q4
    sent = {(m, q.split("/")[1]): h.get("authorization") for m, q, h in fake.requests}
    assert sent[("HEAD", "corp")] == "Bearer hf_right" and sent[("GET", "cdn")] is None


def test_missing_repo_revision_and_file(fake):
    with pytest.raises(DownloadError, match=r"^There is no model nobody/nothing on the Hub that this machine may see"):
        hub.plan("nobody/nothing", endpoint=fake.url, token=False)
    with pytest.raises(DownloadError, match=r"^There is no model nobody/nothing on the Hub\.$"):
        hub.plan("nobody/nothing", endpoint=fake.url, token="hf_any")
    with pytest.raises(DownloadError, match=rf"^{GGUF_REPO} has no revision 'v9' on the Hub\.$"):
        hub.plan(GGUF_REPO, "tiny-Q4_K_M.gguf", "v9", endpoint=fake.url)


def test_sizes_read_as_the_hub_shows_them():
    assert [hub.human_bytes(n) for n in (512, 3_100, 812_000_000, 4_920_000_000, 105_000_000)] == [
        "512 B",
        "3.1 kB",
        "812 MB",
        "4.92 GB",
        "105 MB",
    ]
