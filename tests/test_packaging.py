"""The install steps of `make run`, the Dockerfile and the README cannot drift apart."""

from __future__ import annotations

import importlib
import re
import shlex
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def install_block(path: Path, strip: str) -> list[str]:
    text = path.read_text(encoding="utf-8")
    block = text.split("# INSTALL (begin)", 1)[1].split("# INSTALL (end)", 1)[0]
    lines = [re.sub(r"\s+", " ", ln.strip()) for ln in block.splitlines() if ln.strip()]
    return [re.sub(strip, "", ln) for ln in lines]


def test_dockerfile_installs_exactly_what_make_run_installs():
    make = install_block(REPO / "Makefile", r"^\$\(BIN\)/")
    docker = install_block(REPO / "Dockerfile", r"^RUN ")
    assert make and make == docker


PIN = r"[A-Za-z0-9_.\-\[\]]+==[0-9][0-9A-Za-z.+\-]*"


def _pins(name: str) -> list[str]:
    lines = [line.split("#", 1)[0].strip() for line in (REPO / name).read_text().splitlines()]
    return [line for line in lines if line]


def test_requirements_pin_every_dependency():
    for name in ("requirements.txt", "requirements-dev.txt"):
        for line in _pins(name):
            assert re.fullmatch(PIN, line), f"{name}: {line} is not pinned"


def test_pre_requirements_build_the_pinned_llama_cpp_without_openmp_and_portable_on_x86():
    """pre-requirements.txt (installed first, by make, the Dockerfile and a Space) builds the same
    pinned llama-cpp-python as requirements.txt names, with only build settings added: no OpenMP
    and no multimodal library anywhere, and on x86-64 a portable build (GGML_NATIVE=OFF: AVX2, no
    AVX-512 or AMX, which die with SIGILL in VMs that list them)."""
    lines = _pins("pre-requirements.txt")
    assert len(lines) == 2
    for line in lines:
        spec, marker = (part.strip() for part in line.rsplit(";", 1))
        pin, *options = shlex.split(spec)
        assert re.fullmatch(PIN, pin) and pin in _pins("requirements.txt")
        x86 = marker == 'platform_machine == "x86_64"'
        assert x86 or marker == 'platform_machine != "x86_64"', marker
        settings = {w.removeprefix("--config-settings=cmake.define.") for w in options}
        want = {"GGML_OPENMP=OFF", "LLAVA_BUILD=OFF"} | ({"GGML_NATIVE=OFF"} if x86 else set())
        assert settings == want, line


def test_ci_builds_the_llama_tools_as_portably_as_the_wheel():
    """The reference llama-server and llama-bench of the benchmarks are compiled for the same
    instructions as the wheel, or they would compare different kernels (and could die of SIGILL)."""
    text = (REPO / ".ci" / "run").read_text()
    assert '[ "$(uname -m)" = x86_64 ] && portable="-DGGML_NATIVE=OFF"' in text
    assert re.search(r"cmake -S .*\$portable", text)


def test_space_front_matter_matches_requirements():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    front = readme.split("---", 2)[1]
    assert "sdk: gradio" in front and "app_file: app.py" in front
    sdk = re.search(r"sdk_version: (\S+)", front).group(1)
    assert f"gradio=={sdk}" in (REPO / "requirements.txt").read_text()


def test_space_front_matter_names_a_python_the_code_runs_on():
    """A Space without `python_version` gets the platform's default Python (3.10), and the code needs
    3.11 (`typing.Self`, `datetime.UTC`): the front matter names one at least pyproject's minimum."""
    from tests.test_space_build import space_python_version

    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    required = re.search(r">=\s*(\d+)\.(\d+)", project["requires-python"])
    assert space_python_version() >= (int(required.group(1)), int(required.group(2)))


def test_dockerfile_is_non_root_with_healthcheck_volume_and_port():
    text = (REPO / "Dockerfile").read_text()
    assert re.search(r"^USER (?!root)\w+", text, re.M)
    assert "HEALTHCHECK" in text and "/gradio_api/info" in text
    assert re.search(r"^VOLUME /data", text, re.M) and re.search(r"^EXPOSE 7860", text, re.M)


def test_readme_shows_the_same_install_lines():
    make = install_block(REPO / "Makefile", r"^\$\(BIN\)/")
    readme = install_block(REPO / "README.md", r"^\.venv/bin/")
    assert readme == make


def test_pyproject_describes_this_package():
    meta = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    project, setuptools = meta["project"], meta["tool"]["setuptools"]
    assert project["version"] == importlib.import_module("llmweb").__version__
    assert setuptools["dynamic"]["dependencies"] == {"file": ["requirements.txt"]}
    on_disk = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "llmweb").rglob("__init__.py")}
    assert set(setuptools["packages"]) == on_disk, "every package (folder with __init__.py) ships"
    module, func = project["scripts"]["llmweb"].split(":")
    assert callable(getattr(importlib.import_module(module), func))


def _installed_by_requirements() -> set[str]:
    """Every distribution a clean `make install-dev` brings: the pinned names and, through their
    installed metadata, everything they require (with the extras the pins ask for)."""
    from importlib import metadata

    from packaging.requirements import Requirement

    def norm(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    todo = [
        Requirement(p.split(";")[0].split()[0]) for n in ("requirements.txt", "requirements-dev.txt") for p in _pins(n)
    ]
    seen: set[str] = set()
    while todo:
        req = todo.pop()
        if norm(req.name) in seen:
            continue
        seen.add(norm(req.name))
        for line in metadata.requires(req.name) or []:
            dep = Requirement(line)
            extras = req.extras or {""}
            if dep.marker is None or any(dep.marker.evaluate({"extra": e}) for e in extras):
                todo.append(dep)
    return seen


def test_every_package_the_tests_import_comes_from_the_requirements():
    """A test module that imports a package no requirement brings fails CI at collection, though it
    passes on a machine where someone once installed the package by hand."""
    import ast
    import sys
    from importlib import metadata

    modules: set[str] = set()
    for path in (REPO / "tests").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                modules |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules.add(node.module.split(".")[0])
    local = {"llmweb", "tests", "app", "conftest"}
    provides = metadata.packages_distributions()
    installed = _installed_by_requirements()
    missing = {
        module
        for module in modules - set(sys.stdlib_module_names) - local
        if not any(re.sub(r"[-_.]+", "-", d).lower() in installed for d in provides.get(module, []))
    }
    assert not missing, f"imported by tests, brought by no requirement: {sorted(missing)}"
