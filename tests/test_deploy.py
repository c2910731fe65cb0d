"""The recipes in deploy/: every compose file parses and is the one docs/scaling.md names; in the
router recipes, vLLM's router command is read by the router's own argument parser (the wheel
requirements-dev.txt pins) and points at the replicas the file starts, and llmweb's settings
match them: LLMWEB_ENGINE_ROUTER=1, the URL at the router, the context of one replica's slot
(llama.cpp: -c / -np; vLLM: --max-model-len), the requests all replicas take at once. The
processes themselves (llama-server replicas behind vllm-router with these flags) run in
tests/engine/test_router_replicas.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
ROUTER_FILES = ("compose.router-llamacpp.yml", "compose.router-vllm.yml")


def compose(name: str) -> dict:
    return yaml.safe_load((DEPLOY / name).read_text())


def test_every_file_in_deploy_parses_and_the_scaling_doc_names_exactly_these():
    files = {p.name for p in DEPLOY.iterdir() if p.is_file()}
    for name in files:
        assert "services" in compose(name), name
    named = set(re.findall(r"`deploy/([\w.-]+)`|`([\w.-]+\.(?:yml|conf))`", (ROOT / "docs" / "scaling.md").read_text()))
    named_files = {a or b for a, b in named}
    assert named_files == files, f"docs/scaling.md names {sorted(named_files)}, deploy/ holds {sorted(files)}"


def _flag(command: list[str], name: str) -> str:
    """The value of `name` in an argument list, as `--name=v` or `--name v`."""
    for i, arg in enumerate(command):
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
        if arg == name:
            return command[i + 1]
    raise AssertionError(f"{name} is not in {command}")


@pytest.mark.parametrize("name", ROUTER_FILES)
def test_the_router_recipe_fronts_its_replicas_and_llmweb_is_set_for_a_router(name):
    launch = pytest.importorskip("vllm_router.launch_router", reason="vllm-router (requirements-dev.txt)")
    services = compose(name)["services"]
    args = launch.parse_router_args([str(a) for a in services["router"]["command"]])
    replicas = [s for s in services if s not in ("router", "llmweb")]
    assert len(replicas) >= 2 and args.policy == "consistent_hash"
    ports = {s: _flag([str(a) for a in services[s]["command"]], "--port") for s in replicas}
    assert args.worker_urls == [f"http://{s}:{ports[s]}" for s in replicas], "the router fronts these replicas"
    env = services["llmweb"]["environment"]
    assert env["LLMWEB_ENGINE_URL"] == f"http://router:{args.port}" and env["LLMWEB_ENGINE_ROUTER"] == "1"
    command = [str(a) for a in services[replicas[0]]["command"]]
    if "vllm" in name:
        assert "--enable-prompt-tokens-details" in command, "vLLM reports cached tokens only with it"
        assert int(env["LLMWEB_CONTEXT_LIMIT"]) == int(_flag(command, "--max-model-len"))
    else:
        slots, ctx = int(_flag(command, "-np")), int(_flag(command, "-c"))
        assert int(env["LLMWEB_CONTEXT_LIMIT"]) == ctx // slots, "one slot's context"
        assert int(env["LLMWEB_ENGINE_CONCURRENCY"]) == slots * len(replicas), "every replica's slots"
