"""The end of `make demo`: ask the running `inf2-pipeline serve` a few things with the
official OpenAI client. Usage: serve_demo.py SERVER_LOG (the server was started with
--port 0; its log names the port)."""

from __future__ import annotations

import re
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from openai import OpenAI


def wait_url(log: Path, timeout: float = 300) -> str:
    deadline = time.monotonic() + timeout
    url = ""
    while time.monotonic() < deadline:
        if not url:
            m = re.search(r"listening on (http://[\d.]+:\d+)", log.read_text())
            url = m.group(1) if m else ""
        if url:
            try:
                with urllib.request.urlopen(url + "/ready", timeout=5):
                    return url
            except (urllib.error.URLError, ConnectionError):
                pass
        time.sleep(0.2)
    sys.exit(f"error: the server was not ready in {timeout:.0f} s:\n{log.read_text()[-2000:]}")


def main() -> None:
    url = wait_url(Path(sys.argv[1]))
    client = OpenAI(base_url=url + "/v1", api_key="not-needed")
    model = client.models.list().data[0].id
    print(f"{url}: serving {model}")
    r = client.completions.create(model=model, prompt="The server batches", max_tokens=12)
    print(f"text prompt  -> {r.choices[0].text!r} ({r.usage.completion_tokens} tokens)")
    r = client.completions.create(model=model, prompt=[1, 17, 42, 99, 5], max_tokens=12)
    print(f"token ids    -> {r.choices[0].model_extra['token_ids']}")
    print("streamed     -> ", end="", flush=True)
    for chunk in client.completions.create(
        model=model, prompt="Greedy decoding", max_tokens=12, stream=True
    ):
        print(chunk.choices[0].text, end="|", flush=True)
    print()
    # What most clients call: chat, with the release's chat template (tiny-model writes one).
    messages = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "How are requests batched?"},
    ]
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=12)
    print(
        f"chat         -> {r.choices[0].message.content!r} "
        f"({r.usage.prompt_tokens} prompt tokens, finish_reason {r.choices[0].finish_reason})"
    )


if __name__ == "__main__":
    main()
