"""The docs' screenshot of the live page: SmolLM2 behind `minivllm serve` (in this
process, on a free port), one warm-up request, then six chat requests sent 0.4 s apart,
then headless Chromium.

    python benchmarks/live_page_screenshot.py [OUT.png]   # default: docs/assets/serving/
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from minivllm import EngineConfig, LLMEngine
from minivllm.entrypoints.openai.api_server import BackgroundServer

QUESTIONS = [
    "What is continuous batching?",
    "Write a haiku about paging.",
    "Name three prime numbers.",
    "Why is the sky blue?",
    "What does a KV cache store?",
    "Say hello in French.",
]


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/assets/serving/live-page.png")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    engine = LLMEngine(EngineConfig(max_num_seqs=8, max_num_batched_tokens=256))
    with BackgroundServer(engine) as server:
        url = server.url + "/v1/chat/completions"
        warm_up = {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 2}
        httpx.post(url, json=warm_up, timeout=300)  # first-step costs (kernel compile)
        threads = []
        for i, question in enumerate(QUESTIONS):
            body = {
                "messages": [{"role": "user", "content": question}],
                "max_completion_tokens": 24 + 8 * i,
                "temperature": 0,
                "ignore_eos": True,
            }
            thread = threading.Thread(
                target=httpx.post, args=(url,), kwargs={"json": body, "timeout": 300}
            )
            thread.start()
            threads.append(thread)
            time.sleep(0.4)
        for thread in threads:
            thread.join()
        with tempfile.TemporaryDirectory() as profile:
            subprocess.run(
                [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                 f"--user-data-dir={profile}", "--window-size=1280,640",
                 "--virtual-time-budget=3000", f"--screenshot={out}", server.url + "/"],
                check=True, capture_output=True, timeout=120,
            )  # fmt: skip
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
