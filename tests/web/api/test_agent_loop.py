"""An agent's session through the stateless API never overflows: 200 steps, each a tool call and a
3,000-character result, with the whole history sent every call (a scripted engine, real planner):
every step is answered, every prompt fits the context, a result too long is cut with a note, and
every result in a prompt restates the call it answers."""

from __future__ import annotations

import json
import re

import pytest

from llmweb.chat.context import Budget
from tests.web.api import conftest
from tests.web.api.conftest import body, say

STEPS = 200
TOOL = {
    "type": "function",
    "function": {
        "name": "read_page",
        "parameters": {"type": "object", "properties": {"page": {"type": "integer"}}, "required": ["page"]},
    },
}


@pytest.fixture
def agent_api(tmp_path, monkeypatch):
    budget = Budget(context_limit=1500, max_new_tokens=40, summary_tokens=60, retrieved_tokens=0, user_tokens=200)
    monkeypatch.setattr(conftest, "BUDGET", budget)
    r = conftest.rig(tmp_path)
    r.runner.background = lambda request: r.fmt._words("The agent read pages so far.") + [r.fmt.END]
    yield r, budget
    r.engine.close()
    r.store.close()


def test_two_hundred_steps_with_long_tool_results_stay_inside_the_context(agent_api):
    api, budget = agent_api
    messages: list[dict] = [{"role": "user", "content": "Read the pages one by one."}]
    for step in range(STEPS):
        say(api, json.dumps({"tool_calls": [{"name": "read_page", "arguments": {"page": step}}]}))
        r = api.client.post("/v1/chat/completions", json=body(messages=messages, tools=[TOOL], tool_choice="required"))
        assert r.status_code == 200, (step, r.text)
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", step
        (call,) = choice["message"]["tool_calls"]
        assert json.loads(call["function"]["arguments"]) == {"page": step}

        request = api.runner.requests[-1]
        assert len(request.prompt_ids) + request.max_new_tokens <= budget.context_limit, step
        prompt = api.fmt.decode(request.prompt_ids)
        if step:  # the newest result is in the prompt, restating the call it answers
            assert f'"page": {step - 1}}}}} ({messages[-1]["tool_call_id"]})' in prompt, step
        for page in re.findall(r"tool call \{[^}]*\"page\": (\d+)\}\}", prompt):
            assert f"page{page}-" in prompt, "a result kept is shown with its call"

        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        words = " ".join(f"page{step}-w{i}" for i in range(300))  # ~3,000 characters
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": words[:3000]})

    final = api.runner.requests[-1]
    assert "cut: this tool result is" in api.fmt.decode(final.prompt_ids), "the long result was cut, and says so"
    assert "The agent read pages so far." in api.fmt.decode(final.prompt_ids), "older steps folded into the summary"
