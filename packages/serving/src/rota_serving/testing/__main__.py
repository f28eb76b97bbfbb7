"""``python -m rota_serving.testing vllm|sglang --port N [--version V]``: run a fake engine until killed."""

from __future__ import annotations

import argparse

from rota_serving.testing import FakeSglangServer, FakeVllmServer

FAKES = {"vllm": FakeVllmServer, "sglang": FakeSglangServer}

parser = argparse.ArgumentParser(prog="python -m rota_serving.testing",
                                 description="Run a fake vLLM or SGLang engine on 127.0.0.1 until killed.")
parser.add_argument("app", choices=sorted(FAKES))
parser.add_argument("--port", type=int, required=True)
parser.add_argument("--version", help="the version the fake reports (default: one the adapter supports)")
args = parser.parse_args()
fake = FAKES[args.app]
(fake(args.port, args.version) if args.version else fake(args.port)).serve_forever()
