"""Fetch a model from the Hugging Face Hub into the models folder: a plan first, then a resumable download.

`plan()` asks the Hub which files a fetch takes and their sizes, before a byte of weights moves;
`fetch()` downloads them into the models folder: a GGUF repo's one file as `<file>.gguf`, a
transformers repo as the folder `<owner>--<name>/` (config, tokenizer, safetensors; never a pickle,
which can run code when loaded). Why not `hf_hub_download(local_dir=...)`: in huggingface_hub 2.4.0
it writes to a temporary file unique to the process and deletes it when the download fails, so a
cut download starts again from zero. Here each file grows under `.downloads/` with its content hash
in its name, huggingface_hub's `http_get` resumes it with a Range request, it is checked against
that hash, and the model's own name appears only once every file is complete.

Owns: the Hub's metadata calls, the choice of files, the checks (names, size cap, disk, offline)
and the download. Must not: load a model, print, or read the environment itself (huggingface_hub
reads HF_ENDPOINT, HF_TOKEN and HF_HUB_OFFLINE).
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, cast
from urllib.parse import urlsplit

from llmweb.errors import DownloadError, InputError

Progress = Callable[[int, int, str], None]  # (bytes done, bytes in all, the file it is at)

LIBRARY = "llmweb"  # in the user agent the Hub sees
METADATA_TIMEOUT_S = 10.0  # the Hub's metadata calls, never retried: an unreachable Hub is said in seconds
DOWNLOADS = ".downloads"  # under the models folder: files still growing (a dot name: never a model)
DISK_HEADROOM = 256 * 10**6  # bytes left free on the disk after a download
MAX_LISTED = 30  # .gguf files named in an error
TRANSFORMERS_FILES = frozenset(
    {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "tokenizer.model",  # sentencepiece (protobuf, not a pickle)
        "vocab.json",
        "merges.txt",
        "vocab.txt",
        "chat_template.jinja",
        "chat_template.json",
        "model.safetensors.index.json",
    }
)
PICKLES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
REPO_PART = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9_])?")  # the Hub's rule for owner and name
REVISION = re.compile(r"[A-Za-z0-9._-]+(?:/[A-Za-z0-9._-]+)*")  # main, v1.0, a commit, refs/pr/3
SPLIT_GGUF = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)
OFFLINE = "The Hugging Face Hub is off for this process (HF_HUB_OFFLINE is set): nothing can be fetched."


@dataclass(frozen=True, slots=True)
class HubFile:
    name: str  # its path in the repo
    size: int
    sha256: str = ""  # LFS files (weights): the content's sha256, checked at the end
    blob_id: str = ""  # small files kept in git: the git blob id, checked at the end

    @property
    def local_name(self) -> str:
        return PurePosixPath(self.name).name


@dataclass(frozen=True, slots=True)
class FetchPlan:
    repo_id: str
    revision: str  # as asked ("main" when not said)
    commit: str  # the commit every file is fetched from (a branch may move meanwhile)
    kind: str  # "gguf" | "transformers"
    files: tuple[HubFile, ...]
    target: str  # the name in the models folder: "<file>.gguf" or "<owner>--<name>"
    endpoint: str
    token: str | bool | None = field(default=None, repr=False, compare=False)  # None: huggingface_hub's own

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def summary(self) -> str:
        n = len(self.files)
        return (
            f"{self.repo_id} at {self.revision} (commit {self.commit[:10]}): "
            f"{n} file{'s' if n != 1 else ''}, {human_bytes(self.total_bytes)}"
        )


def human_bytes(n: float) -> str:
    """Decimal units, as the Hub shows file sizes: 4.92 GB, 812 MB, 3.1 kB."""
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= scale:
            value = n / scale
            return f"{value:.3g} {unit}" if value < 100 else f"{value:.0f} {unit}"
    return f"{int(n)} B"


# -- names: checked where they enter ---------------------------------------------------------------


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_repo_id(repo_id: str) -> tuple[str, str]:
    """(owner, name) of an `owner/name` model id; InputError for anything else (a path, a URL, `..`)."""
    parts = repo_id.split("/") if isinstance(repo_id, str) else []
    if len(parts) != 2 or not all(REPO_PART.fullmatch(p) and "--" not in p and ".." not in p for p in parts):
        raise InputError(
            f"{_shown(repo_id)} is not a Hub model id: write owner/name (letters, digits, . _ -), "
            "like HuggingFaceTB/SmolLM2-360M-Instruct."
        )
    return parts[0], parts[1]


def check_repo_path(name: str, what: str = "file name") -> str:
    """A file's path inside a repo: relative, `/`-separated, no `..`, `.`, backslash or control character."""
    ok = isinstance(name, str) and 0 < len(name) <= 500 and "\\" not in name and not name.startswith("/")
    ok = ok and not any(ord(c) < 32 or ord(c) == 127 for c in name)
    ok = ok and all(part not in ("", ".", "..") and len(part) <= 255 for part in name.split("/"))
    if not ok:
        raise InputError(
            f"{_shown(name)} is not a {what} in a repo: give its path as the Hub lists it "
            "(no .., no leading /, no backslashes)."
        )
    return name


def _safe(name: str) -> bool:
    try:
        check_repo_path(name)
    except InputError:
        return False
    return True


def check_filename(filename: str) -> str:
    check_repo_path(filename)
    if not filename.lower().endswith(".gguf"):
        raise InputError(
            f"{_shown(filename)} is not a .gguf file: FILE names one GGUF file of a GGUF repo "
            "(a transformers repo is fetched whole, without FILE)."
        )
    return filename


def check_revision(revision: str) -> str:
    if not isinstance(revision, str) or len(revision) > 200 or not REVISION.fullmatch(revision) or ".." in revision:
        raise InputError(f"{_shown(revision)} is not a revision: give a branch, a tag or a commit id.")
    return revision


# -- errors: huggingface_hub's exceptions as one sentence each --------------------------------------


def _has_token(token: str | bool | None) -> bool:
    if token is not None:
        return bool(token)
    from huggingface_hub import get_token

    return get_token() is not None


@contextmanager
def _hub_errors(repo_id: str, revision: str, endpoint: str, token: str | bool | None) -> Iterator[None]:
    """The metadata calls' failures as DownloadError sentences."""
    import httpx2
    from huggingface_hub import errors as hf

    try:
        yield
    except hf.OfflineModeIsEnabled:
        raise DownloadError(OFFLINE) from None
    except hf.GatedRepoError:
        if _has_token(token):
            raise DownloadError(
                f"{repo_id} is gated and the token set (HF_TOKEN) has no access to it yet: "
                "accept its terms on its Hub page, or set another token."
            ) from None
        raise DownloadError(
            f"{repo_id} is gated and needs a token: set HF_TOKEN (after accepting its terms on its Hub page)."
        ) from None
    except hf.RevisionNotFoundError:
        raise DownloadError(f"{repo_id} has no revision {revision!r} on the Hub.") from None
    except hf.RemoteEntryNotFoundError:
        raise DownloadError(f"{repo_id} at {revision} lacks a file its listing names; try again later.") from None
    except hf.HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else 0
        if status in (401, 403):
            needs = "set HF_TOKEN" if not _has_token(token) else "the token set (HF_TOKEN) has no access"
            raise DownloadError(
                f"There is no model {repo_id} on the Hub that this machine may see "
                f"(a private or gated one needs a token: {needs})."
            ) from None
        if status == 404:
            raise DownloadError(f"There is no model {repo_id} on the Hub.") from None
        raise DownloadError(f"The Hub answered HTTP {status} for {repo_id}; try again later.") from None
    except httpx2.TransportError as e:
        raise DownloadError(
            f"The Hugging Face Hub at {endpoint} cannot be reached ({type(e).__name__}): "
            "check the connection (or HF_ENDPOINT)."
        ) from None


# -- the plan ------------------------------------------------------------------------------------------


def plan(
    repo_id: str,
    filename: str | None = None,
    revision: str | None = None,
    *,
    endpoint: str | None = None,
    token: str | bool | None = None,
    timeout_s: float = METADATA_TIMEOUT_S,
) -> FetchPlan:
    """What fetching `repo_id` takes: its files, their sizes and the commit, asked from the Hub before
    anything downloads. A GGUF repo needs `filename` (one of its .gguf files: the error lists them,
    with sizes, in `choices`); a transformers repo is its config, tokenizer and safetensors files.
    `endpoint`, `token`: None = what huggingface_hub reads (HF_ENDPOINT, HF_TOKEN or its login).
    Raises InputError (a malformed id, file or revision) or DownloadError (offline, unreachable,
    missing, gated, no weights llmweb takes), each with one sentence for the user."""
    owner, name = check_repo_id(repo_id)
    if filename is not None:
        check_filename(filename)
    if revision is not None:
        check_revision(revision)
    from huggingface_hub import constants

    if constants.is_offline_mode():
        raise DownloadError(OFFLINE)
    endpoint = (endpoint or constants.ENDPOINT).rstrip("/")
    asked = revision or constants.DEFAULT_REVISION
    with _hub_errors(repo_id, asked, endpoint, token):
        info = _model_info(repo_id, revision, endpoint, token, timeout_s)
    listing = {s.rfilename: _hub_file(s) for s in info.siblings or []}
    kind, target, files = _choose(repo_id, f"{owner}--{name}", listing, filename)
    chosen = FetchPlan(repo_id, asked, info.sha, kind, files, target, endpoint, token)
    with _hub_errors(repo_id, asked, endpoint, token):  # a gated repo's files say so now, not at download
        _file_metadata(chosen, max(files, key=lambda f: f.size), timeout_s)
    return chosen


def _model_info(repo_id: str, revision: str | None, endpoint: str, token: str | bool | None, timeout_s: float) -> Any:
    """huggingface_hub's `model_info` with the files' sizes; a server that answers, but not as the Hub, is said."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    not_a_hub = f"The server at {endpoint} does not answer as the Hugging Face Hub does: check HF_ENDPOINT."
    try:
        info = HfApi(endpoint=endpoint, token=token, library_name=LIBRARY).model_info(
            repo_id, revision=revision, files_metadata=True, timeout=timeout_s
        )
    except HfHubHTTPError:
        raise  # _hub_errors says which
    except (ValueError, KeyError, TypeError):  # not JSON, or not the Hub's JSON
        raise DownloadError(not_a_hub) from None
    if not info.sha:
        raise DownloadError(not_a_hub)
    return info


def _hub_file(sibling: Any) -> HubFile | None:
    """A listed file, or None when the Hub did not give its size."""
    size = sibling.lfs.size if sibling.lfs else sibling.size
    if size is None:
        return None
    return HubFile(sibling.rfilename, int(size), sibling.lfs.sha256 if sibling.lfs else "", sibling.blob_id or "")


def _choose(
    repo_id: str, folder: str, listing: dict[str, HubFile | None], filename: str | None
) -> tuple[str, str, tuple[HubFile, ...]]:
    """(kind, target, files) of a fetch; DownloadError when the repo has nothing llmweb takes."""
    ggufs = sorted((f for n, f in listing.items() if n.lower().endswith(".gguf") and f is not None), key=_by_name)
    if filename is not None:
        return "gguf", PurePosixPath(filename).name, (_gguf_file(repo_id, listing, ggufs, filename),)
    root = {n: f for n, f in listing.items() if "/" not in n}
    weights = sorted(n for n in root if n.endswith(".safetensors"))
    if weights and "config.json" in root:
        # a repo with the sharded model*.safetensors and an original copy (consolidated.safetensors): the first
        if any(n.startswith("model") for n in weights):
            weights = [n for n in weights if n.startswith("model")]
        names = sorted(n for n in root if n in TRANSFORMERS_FILES or n in weights)
        files = []
        for n in names:
            if not _safe(n):  # the Hub's listing is input too
                raise DownloadError(
                    f"The Hub listed an unsafe file name in {repo_id} ({_shown(n)}): nothing was fetched."
                )
            if root[n] is None:
                raise DownloadError(f"The Hub did not give the size of {n} in {repo_id}; try again later.")
            files.append(cast(HubFile, root[n]))
        return "transformers", folder, tuple(files)
    if ggufs:
        raise DownloadError(
            f"{repo_id} is a GGUF repo: name one of its .gguf files after the id: {_listed(ggufs)}.",
            choices=tuple((f.name, f.size) for f in ggufs),
        )
    pickles = sorted(n for n in root if n.lower().endswith(PICKLES))
    if pickles and not weights:
        raise DownloadError(
            f"{repo_id} publishes its weights only as pickle files ({', '.join(pickles[:3])}), which can run "
            "code when loaded: llmweb fetches safetensors or GGUF weights only."
        )
    if weights:
        raise DownloadError(f"{repo_id} has safetensors weights but no config.json: transformers cannot load it.")
    raise DownloadError(f"{repo_id} has no weights llmweb takes (a .gguf file, or config.json with .safetensors).")


def _by_name(f: HubFile) -> str:
    return f.name


def _listed(files: list[HubFile]) -> str:
    shown = ", ".join(f"{f.name} ({human_bytes(f.size)})" for f in files[:MAX_LISTED])
    return shown + (f" and {len(files) - MAX_LISTED} more" if len(files) > MAX_LISTED else "")


def _gguf_file(repo_id: str, listing: dict[str, HubFile | None], ggufs: list[HubFile], filename: str) -> HubFile:
    found = listing.get(filename)
    if found is None:
        choices = tuple((f.name, f.size) for f in ggufs)
        if filename in listing:
            raise DownloadError(f"The Hub did not give the size of {filename} in {repo_id}; try again later.")
        if not ggufs:
            raise DownloadError(f"{repo_id} has no .gguf file (fetch a transformers repo without FILE).")
        raise DownloadError(f"{repo_id} has no file {filename}; its .gguf files: {_listed(ggufs)}.", choices=choices)
    if SPLIT_GGUF.search(filename):
        raise DownloadError(
            f"{filename} is one part of a split GGUF model, which llmweb does not fetch yet: pick a single-file one."
        )
    return found


def _file_metadata(plan: FetchPlan, f: HubFile, timeout_s: float) -> Any:
    """HEAD of the file at the plan's commit (huggingface_hub's call): where to GET it, and its size."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    url = hf_hub_url(plan.repo_id, f.name, revision=plan.commit, endpoint=plan.endpoint)
    meta = get_hf_file_metadata(url, token=plan.token, timeout=timeout_s, endpoint=plan.endpoint)
    if meta.commit_hash is None or meta.size is None:
        raise DownloadError(f"The Hub at {plan.endpoint} did not give the commit and size of {f.name}: is it a Hub?")
    if meta.size != f.size:
        raise DownloadError(f"{f.name} changed on the Hub while fetching ({meta.size} bytes, listed {f.size}).")
    return meta


# -- the download ------------------------------------------------------------------------------------


def destination(plan: FetchPlan, models_dir: Path) -> Path:
    return Path(models_dir) / plan.target


def staging_dir(plan: FetchPlan, models_dir: Path) -> Path:
    return Path(models_dir) / DOWNLOADS / f"{plan.target}.partial"


def _is_complete(plan: FetchPlan, final: Path) -> bool:
    if plan.kind == "gguf":
        return final.is_file() and final.stat().st_size == plan.files[0].size
    return final.is_dir() and all(
        (final / f.local_name).is_file() and (final / f.local_name).stat().st_size == f.size for f in plan.files
    )


def bytes_kept(plan: FetchPlan, models_dir: Path) -> int:
    """Bytes of the plan already in the staging folder (complete files and partial ones)."""
    staging = staging_dir(plan, models_dir)
    kept = 0
    for f in plan.files:
        done = staging / f.local_name
        partial = _partial_path(staging, f)
        if done.is_file():
            kept += min(done.stat().st_size, f.size)
        elif partial.is_file():
            kept += min(partial.stat().st_size, f.size)
    return kept


def check(plan: FetchPlan, models_dir: Path, max_bytes: int) -> None:
    """Refuse before anything downloads: over the size cap, not enough free disk, or another file
    already at the target's name."""
    if plan.total_bytes > max_bytes:
        raise DownloadError(
            f"{plan.repo_id} needs {human_bytes(plan.total_bytes)}, more than the {human_bytes(max_bytes)} "
            "llmweb fetches (LLMWEB_MAX_DOWNLOAD_GB)."
        )
    final = destination(plan, models_dir)
    if final.exists() and not _is_complete(plan, final):
        raise DownloadError(f"{final} already exists and is not this model: move it away first.")
    need = plan.total_bytes - bytes_kept(plan, models_dir)
    free = _free_bytes(Path(models_dir))
    if need + DISK_HEADROOM > free:
        raise DownloadError(
            f"{plan.repo_id} needs {human_bytes(need)} more on the disk of {models_dir}, "
            f"which has {human_bytes(free)} free (keeping {human_bytes(DISK_HEADROOM)} spare)."
        )


def _free_bytes(folder: Path) -> int:
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return shutil.disk_usage(folder).free


def fetch(plan: FetchPlan, models_dir: Path, progress: Progress | None = None, *, max_bytes: int) -> Path:
    """Download the plan into `models_dir` and return the model's path (the .gguf file or the folder).

    `progress(done_bytes, total_bytes, what)` is called as bytes arrive (every 10 MB or so, from this
    thread; `what` is the file, or "checking <file>" while its hash is checked); raising from it stops
    the download. A cut download keeps its bytes under `models_dir/.downloads/` and the next fetch of
    the same plan resumes there; the model's own name appears only when every file is complete and
    matches the Hub's hash. A model already there is returned at once. Raises DownloadError."""
    models_dir = Path(models_dir)
    report = progress or _quiet
    final = destination(plan, models_dir)
    if _is_complete(plan, final):
        report(plan.total_bytes, plan.total_bytes, plan.target)
        return final
    check(plan, models_dir, max_bytes)
    staging = staging_dir(plan, models_dir)
    staging.mkdir(parents=True, exist_ok=True)
    with _only_fetch(plan, models_dir):
        done = 0
        for f in plan.files:
            _fetch_file(plan, f, staging, done, report)
            done += f.size
        # 1) every file is complete and checked: now the model's name appears, in one rename
        if plan.kind == "gguf":
            os.replace(staging / plan.files[0].local_name, final)
            shutil.rmtree(staging)
        else:
            os.replace(staging, final)
    return final


def _quiet(done: int, total: int, what: str) -> None:
    pass


@contextmanager
def _only_fetch(plan: FetchPlan, models_dir: Path) -> Iterator[None]:
    """One fetch of a target at a time (a second would append to the same partial files)."""
    from filelock import FileLock, Timeout

    lock = FileLock(str(Path(models_dir) / DOWNLOADS / f"{plan.target}.lock"), timeout=0)
    try:
        lock.acquire()
    except Timeout:
        raise DownloadError(f"{plan.target} is being fetched already (another fetch is running).") from None
    try:
        yield
    finally:
        lock.release()


def _partial_path(staging: Path, f: HubFile) -> Path:
    """The growing file: its content hash in the name, so a partial of another version is never resumed."""
    return staging / f"{f.local_name}.{(f.sha256 or f.blob_id or str(f.size))[:16]}.incomplete"


def _fetch_file(plan: FetchPlan, f: HubFile, staging: Path, before: int, report: Progress) -> None:
    """Download one file into the staging folder, resuming its partial file; checked, then renamed."""
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    total = plan.total_bytes
    done_file = staging / f.local_name
    if done_file.is_file() and done_file.stat().st_size == f.size:  # complete and checked by an earlier fetch
        report(before + f.size, total, f.name)
        return
    partial = _partial_path(staging, f)
    for stale in staging.glob("*.incomplete"):  # a partial of another version of this file
        if stale != partial and stale.name.startswith(f"{f.local_name}."):
            stale.unlink()
    with _hub_errors(plan.repo_id, plan.revision, plan.endpoint, plan.token):
        meta = _file_metadata(plan, f, METADATA_TIMEOUT_S)
    have = partial.stat().st_size if partial.is_file() else 0
    if have > f.size:
        partial.unlink()
        have = 0
    headers = build_hf_headers(token=plan.token, library_name=LIBRARY)
    if _origin(meta.location) != _origin(plan.endpoint):  # a signed CDN address: the token stays on the Hub
        headers.pop("authorization", None)
    meter = functools.partial(_Meter, lambda n: report(before + n, total, f.name))
    with open(partial, "ab") as out, _download_errors(plan, f, partial):
        http_get(
            meta.location,
            out,
            resume_size=have,
            headers=headers,
            expected_size=f.size,
            displayed_filename=f.name,
            tqdm_class=cast(Any, meter),
        )
    report(before + f.size, total, f"checking {f.name}")
    _verify(partial, f)
    os.replace(partial, done_file)


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    return parts.scheme, (parts.hostname or "").lower(), parts.port


class _Meter:
    """What huggingface_hub's `http_get` takes as its tqdm class: counts the file's bytes into `on_bytes`."""

    def __init__(self, on_bytes: Callable[[int], None], *, initial: int = 0, **_bar: Any):
        self.on_bytes = on_bytes
        self.n = initial
        on_bytes(self.n)

    def __enter__(self) -> _Meter:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def update(self, n: int = 1) -> None:
        self.n += n
        self.on_bytes(self.n)


@contextmanager
def _download_errors(plan: FetchPlan, f: HubFile, partial: Path) -> Iterator[None]:
    """A download that stops midway: its bytes stay, and the sentence says the same fetch resumes."""
    import httpx2
    from huggingface_hub import errors as hf

    try:
        yield
    except hf.OfflineModeIsEnabled:
        raise DownloadError(OFFLINE) from None
    except (hf.HfHubHTTPError, httpx2.TransportError, OSError) as e:
        why = f"HTTP {e.response.status_code}" if isinstance(e, hf.HfHubHTTPError) else type(e).__name__
        kept = partial.stat().st_size if partial.is_file() else 0
        raise DownloadError(
            f"The download of {f.name} stopped at {human_bytes(kept)} of {human_bytes(f.size)} ({why}); "
            f"fetch {plan.repo_id} again to resume from there."
        ) from None


def _verify(path: Path, f: HubFile) -> None:
    """The file's size and hash against the Hub's listing; a damaged file is deleted."""
    size = path.stat().st_size
    digest = expected = ""
    if size == f.size and (f.sha256 or f.blob_id):
        with open(path, "rb") as fp:
            if f.sha256:
                digest, expected = hashlib.file_digest(fp, "sha256").hexdigest(), f.sha256
            else:  # git's blob id: sha1 of "blob <size>\0" + the content
                git = hashlib.sha1(b"blob %d\0" % size, usedforsecurity=False)
                digest, expected = hashlib.file_digest(fp, lambda: git).hexdigest(), f.blob_id
    if size != f.size or digest != expected:
        path.unlink()
        why = "its hash differs from the Hub's" if size == f.size else f"{size} bytes, not {f.size}"
        raise DownloadError(f"{f.name} arrived damaged ({why}) and was deleted: fetch it again.")
