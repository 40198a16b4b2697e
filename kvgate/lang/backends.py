"""Where a program's steps run. Every backend answers three questions the same way: the model's chat
role markers, a generation after a prompt, and the mean token log-probability of each choice after a
prompt (select). `Endpoint` asks a kvgate gateway (every call under the API key's limits and usage);
`Local` (local.py) runs the in-process engine."""
from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable
from dataclasses import dataclass

import httpx


@dataclass
class Generated:
    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int


class BackendError(Exception):
    """The server (or engine) refused or failed a call: its message, HTTP status and error code."""

    def __init__(self, message: str, status: int | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.code = message, status, code


class Backend:
    def markers(self) -> dict | None:
        raise NotImplementedError

    def generate(self, prompt: str, params: dict, on_text: Callable[[str], None] | None = None) -> Generated:
        raise NotImplementedError

    def score(self, prompt: str, choices: list[str]) -> list[float]:
        """Mean log-probability of each choice's tokens after `prompt`."""
        raise NotImplementedError

    def prefill(self, prompt: str) -> None:
        """Puts `prompt`'s blocks in the prefix cache before a fork's branches are sent (SGLang
        commits a state before forking it too): branches sent together would otherwise each
        compute the shared prefix from wherever the cache ended when they were scheduled, chasing
        the first one chunk by chunk. One token is generated: a request needs one."""
        self.generate(prompt, {"max_tokens": 1, "temperature": 0})


BATCH_PROMPTS = 16  # the prompts of one batched completion the gateway takes (with n = 1)


def mean_logprob(entries: list, first: int, last: int) -> float:
    """The mean over prompt positions [first, last) of the scored token's logprob (vLLM's shape:
    {token id: {"logprob", "rank", ...}}, the scored token's rank being its own)."""
    first = min(first, last - 1)  # a choice the state's last token swallowed: score that token
    values = [_own(entries[i]) for i in range(first, last)]
    return sum(values) / len(values)


def _own(entry: dict) -> float:
    """The scored token's logprob: with prompt_logprobs 0 the entry holds just that token."""
    if len(entry) == 1:
        return next(iter(entry.values()))["logprob"]
    raise ValueError("a prompt_logprobs entry with top entries: ask for 0")


class Endpoint(Backend):
    """A kvgate gateway's /v1/completions, as `model`, with `api_key`: the program's calls count
    against that key like any others."""

    def __init__(self, url: str, api_key: str, model: str, timeout: float = 300.0, max_connections: int = 64):
        self.model = model
        self.client = httpx.Client(base_url=url.rstrip("/"), timeout=timeout,
                                   headers={"Authorization": f"Bearer {api_key}"},
                                   limits=httpx.Limits(max_connections=max_connections))
        self._pool = ThreadPoolExecutor(max_connections, thread_name_prefix="kvgate-lang-select")
        self._markers: dict | None = None
        self.usage = {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0}  # what the key was charged
        self._lock = threading.Lock()

    def close(self) -> None:
        self.client.close()
        self._pool.shutdown(wait=False)

    def markers(self) -> dict | None:
        if self._markers is None:
            self._markers = self._checked(self.client.get(f"/v1/models/{self.model}")).get("chat_markers") or {}
        return self._markers or None

    def generate(self, prompt: str, params: dict, on_text: Callable[[str], None] | None = None) -> Generated:
        body = {"model": self.model, "prompt": prompt, **params}
        if on_text is None:
            out = self._post(body)
            choice = out["choices"][0]
            return Generated(choice["text"], choice["finish_reason"], out["usage"]["prompt_tokens"],
                             out["usage"]["completion_tokens"])
        return self._stream({**body, "stream": True, "stream_options": {"include_usage": True}}, on_text)

    def score(self, prompt: str, choices: list[str]) -> list[float]:
        """One request for the state alone (its length in tokens, and its blocks in the prefix cache),
        then the choices as one batched completion (BATCH_PROMPTS a request, those at once), each
        scoring only the positions after the state."""
        state_tokens = self._post({"model": self.model, "prompt": prompt, "max_tokens": 1,
                                   "temperature": 0})["usage"]["prompt_tokens"]

        def batch(some: list[str]) -> list[float]:
            out = self._post({"model": self.model, "prompt": [prompt + choice for choice in some], "max_tokens": 1,
                              "temperature": 0, "prompt_logprobs": 0, "prompt_logprobs_start": state_tokens})
            scored = [c["prompt_logprobs"] for c in sorted(out["choices"], key=lambda c: c["index"])]
            return [mean_logprob(entries, state_tokens, len(entries)) for entries in scored]
        parts = [choices[i:i + BATCH_PROMPTS] for i in range(0, len(choices), BATCH_PROMPTS)]
        return [score for part in self._pool.map(batch, parts) for score in part]

    def _post(self, body: dict) -> dict:
        out = self._checked(self.client.post("/v1/completions", json=body))
        self._count(out["usage"])
        return out

    def _count(self, usage: dict) -> None:
        with self._lock:
            self.usage["requests"] += 1
            self.usage["prompt_tokens"] += usage["prompt_tokens"]
            self.usage["completion_tokens"] += usage["completion_tokens"]

    def _stream(self, body: dict, on_text: Callable[[str], None]) -> Generated:
        text, reason, usage = [], None, {"prompt_tokens": 0, "completion_tokens": 0}
        with self.client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code >= 400:
                resp.read()
                self._checked(resp)
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    raise _error(event, resp.status_code)
                usage = event.get("usage") or usage
                for choice in event.get("choices", []):
                    if choice.get("text"):
                        text.append(choice["text"])
                        on_text(choice["text"])
                    reason = choice.get("finish_reason") or reason
        self._count(usage)
        return Generated("".join(text), reason, usage["prompt_tokens"], usage["completion_tokens"])

    @staticmethod
    def _checked(resp: httpx.Response) -> dict:
        try:
            data = resp.json()
        except ValueError:
            data = None
        if resp.status_code >= 400 or not isinstance(data, dict):
            raise _error(data, resp.status_code, resp.text)
        return data


def _error(data, status: int, raw: str = "") -> BackendError:
    err = data.get("error") if isinstance(data, dict) else None
    if isinstance(err, dict):
        return BackendError(str(err.get("message")), status, err.get("code") or err.get("type"))
    return BackendError(f"HTTP {status}: {raw[:200]}", status)
