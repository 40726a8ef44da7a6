"""One real NeMo-Gym rollout of a rendered ``env.nemo_gym`` section. Runs in the Gym 0.4.0 venv.

Called by tests/test_nemo_gym_contract.py as ``python nemo_gym_rollout.py rendered.yaml rows.jsonl
replies.json``; imports nothing from alignpipe. It starts the config's real Gym servers as
subprocesses with Gym's own ``RunHelper`` and posts the rows with ``RolloutCollectionHelper``,
as NeMo-RL v0.7.0's ``NemoGym`` environment does (nemo_rl/environments/nemo_gym.py). The one
stand-in is vLLM: a loopback OpenAI-compatible server answering ``/v1/chat/completions``
(with the per-token logprobs NeMo-RL asks for) and ``/tokenize``, replying to each user
prompt with the text in ``replies.json``. Prints one JSON object: each row's reward.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import yaml
from nemo_gym_probe import initial_global_config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def token_ids(text: str) -> list[int]:
    return [ord(c) for c in text]  # a character "tokenizer": ids only need to be consistent


def stand_in_vllm(replies: dict[str, str]) -> ThreadingHTTPServer:
    """vLLM's OpenAI server, reduced to what Gym's vllm_model server calls."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            prompt = "".join(str(m.get("content", "")) for m in body["messages"] if m["role"] == "user")
            if self.path.endswith("/tokenize"):
                self._send({"tokens": token_ids(prompt), "count": len(prompt)})
                return
            reply = next((text for key, text in replies.items() if key in prompt), "I do not know.")
            logprobs = [{"token": f"token_id:{t}", "logprob": -0.1, "bytes": None, "top_logprobs": []}
                        for t in token_ids(reply)]  # fmt: skip
            self._send({
                "id": "chatcmpl-stand-in", "object": "chat.completion", "created": int(time.time()),
                "model": body.get("model", "policy"),
                "choices": [{"index": 0, "finish_reason": "stop", "logprobs": {"content": logprobs},
                             "message": {"role": "assistant", "content": reply, "tool_calls": []}}],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(reply),
                          "total_tokens": len(prompt) + len(reply)},
            })  # fmt: skip

        def _send(self, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def server_venvs(root: Path, parsed_paths: list[tuple[str, str]]) -> None:
    """Gym makes a uv venv per server; with ``skip_venv_if_present`` it reuses one that exists.
    Every server here runs in this (Gym 0.4.0) venv, which has what they need, offline."""
    for server_type, name in parsed_paths:
        venv = root / server_type / name / ".venv"
        venv.parent.mkdir(parents=True, exist_ok=True)
        venv.symlink_to(sys.prefix, target_is_directory=True)


async def collect(rows: list[dict], head) -> list[dict]:
    from nemo_gym.rollout_collection import RolloutCollectionHelper

    results: list[dict] = [{}] * len(rows)
    for task in RolloutCollectionHelper().run_examples(examples=rows, head_server_config=head):
        row, result = await task
        results[row["_rowidx"]] = result
    return results


def main() -> None:
    from nemo_gym.cli import GlobalConfigDictParserConfig, RunHelper
    from nemo_gym.server_utils import BaseServerConfig
    from omegaconf import DictConfig

    rendered = yaml.safe_load(Path(sys.argv[1]).read_text())
    rows = [json.loads(line) for line in Path(sys.argv[2]).read_text().splitlines() if line.strip()]
    replies = json.loads(Path(sys.argv[3]).read_text())
    vllm = stand_in_vllm(replies)
    head_port = free_port()

    initial = initial_global_config(
        rendered["env"]["nemo_gym"],
        rendered["policy"]["model_name"],
        f"http://127.0.0.1:{vllm.server_port}/v1",
    )
    initial.pop("ray_head_node_address")  # Gym starts a local Ray, as `ng_run` does
    initial["head_server"] = {"host": "127.0.0.1", "port": head_port}
    with tempfile.TemporaryDirectory() as tmp:
        venvs = Path(tmp) / "venvs"
        servers = [("responses_api_models", "vllm_model"), ("resources_servers", "math_with_judge"),
                   ("responses_api_agents", "simple_agent")]  # fmt: skip
        server_venvs(venvs, servers)
        initial.update(uv_venv_dir=str(venvs), skip_venv_if_present=True)
        os.chdir(tmp)  # Gym resolves server dirs cwd-first; nothing of the test's cwd may shadow them
        helper = RunHelper()
        helper.start(
            GlobalConfigDictParserConfig(
                dotenv_path=Path(tmp) / "nemo_gym_env.yaml",
                initial_global_config_dict=DictConfig(initial),
                skip_load_from_cli=True,
            )
        )
        try:
            for i, row in enumerate(rows):
                row["_rowidx"] = i
            head = BaseServerConfig(host="127.0.0.1", port=head_port)
            results = asyncio.run(collect(rows, head))
        finally:
            helper.shutdown()
            vllm.shutdown()
    print(json.dumps({"rewards": [r.get("reward") for r in results],
                      "answers": [r["response"]["output"][-1]["content"][0]["text"] for r in results]}))  # fmt: skip


if __name__ == "__main__":
    main()
