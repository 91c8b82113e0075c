"""`kvserve serve`: start the engine process, then the HTTP front end on uvicorn.

    kvserve serve [MODEL] --host 127.0.0.1 --port 8000 [engine flags] [--api-key KEY]
                  [--served-model-name NAME] [--max-waiting N] [--max-n N]
                  [--tool-call-parser NAME] [--reasoning-parser NAME] [--chat-template FILE]

The engine process gets the compute cores (--cpu-threads, --cpu-threads-bind); this one, which
only tokenizes and speaks HTTP, keeps one torch thread.

Ctrl-C / SIGTERM, to this process, to the engine process or to both (a process-group signal:
Ctrl-C in a terminal, systemd's default KillMode, `kill -- -PGID`): the engine stops after its
current step, so every open stream ends at once with an error event instead of running on; it
saves the KV tiers (the disk tier survives the restart) and exits; uvicorn closes the
connections and the command exits with no process left behind.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from pathlib import Path
from typing import Any

import uvicorn

from kvserve.config import EngineConfig
from kvserve.engine_args import EXIT_BAD_INPUT, add_engine_args
from kvserve.server.limits import add_http_limit_args, check_http_limit_args, h11_with_header_timeout

DEFAULT_MAX_WAITING = 1024
DEFAULT_MAX_N = 16  # serving.DEFAULT_MAX_N; not imported, so --help does not load the server


def add_server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_pos", nargs="?", default=None, metavar="MODEL",
                   help="HF directory or GGUF file (same as --model)")
    add_engine_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health, /version, /metrics, "
                        "/kv_events, the /dashboard page and the API description")
    g.add_argument("--served-model-name", default=None, help="the model name clients send (default: file name)")
    g.add_argument("--max-waiting", type=int, default=DEFAULT_MAX_WAITING,
                   help="sequences (a prompt's n samples each count) waiting for their first token beyond "
                        f"which new requests get 503 with Retry-After (default {DEFAULT_MAX_WAITING}); a request "
                        "with more sequences than this gets 400")
    g.add_argument("--max-n", type=int, default=DEFAULT_MAX_N,
                   help=f"the largest n (samples per prompt) a request may ask for; more gets 400 "
                        f"(default {DEFAULT_MAX_N})")
    add_http_limit_args(g, "max-model-len tokens")
    _add_chat_args(p.add_argument_group("chat: tools, reasoning, template (README: Tools, structured outputs "
                                        "and reasoning)"))


def _add_chat_args(g: Any) -> None:
    from kvserve.server.reasoning_parsers import REASONING_PARSERS
    from kvserve.server.tool_parsers import TOOL_PARSERS

    g.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help='how tool calls are read from the output under tool_choice "auto" (hermes: <tool_call> '
                        'tags, as Qwen2.5/Qwen3/SmolLM2 and kvserve\'s default tool prompt write them); without '
                        'it "auto" is refused with a 400, "required" and a named function still work')
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='accepted as in vLLM; tool_choice "auto" needs only --tool-call-parser')
    g.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="split <think>...</think> into message.reasoning_content / delta.reasoning_content")
    g.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template used instead of the model's (a file, or the template's text)")


def load_chat_template(value: str | None) -> str | None:
    """--chat-template's text: the file's, or the value itself when it is a template and not a path."""
    if value is None:
        return None
    if "{{" in value or "{%" in value:
        text = value
    else:
        try:
            text = Path(value).read_text()
        except OSError as e:
            raise ValueError(f"--chat-template: no such file: {value} ({e.strerror})") from None
    import jinja2

    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template: not a valid Jinja template: {e}") from None
    return text


def _check_args(args: argparse.Namespace) -> None:
    if args.model_pos is not None:
        if args.model is not None and args.model != args.model_pos:
            raise ValueError(f"MODEL ({args.model_pos!r}) and --model ({args.model!r}) disagree; give one")
        args.model = args.model_pos
    if args.max_waiting < 1:
        raise ValueError(f"--max-waiting must be at least 1, got {args.max_waiting}")
    if args.max_n < 1:
        raise ValueError(f"--max-n must be at least 1, got {args.max_n}")
    check_http_limit_args(args)
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    args.chat_template_text = load_chat_template(args.chat_template)
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")


def _leave_cores_to_engine() -> None:
    """One torch thread in this process: the engine runs in a process of its own (AsyncEngine) with
    the compute cores, and an HTTP process that only tokenizes must not compete for them. The
    engine process is spawned, so it starts with torch's own count, not this one."""
    import torch

    torch.set_num_threads(1)


async def serve(args: argparse.Namespace, config: EngineConfig) -> None:
    from kvserve.engine.async_engine import AsyncEngine, load_tokenizer
    from kvserve.server.openai_api import build_app
    from kvserve.server.serving import ChatSettings

    # The engine process is spawned first, so its imports and model load run beside this
    # process's own (BENCHMARKS.md, "Start and stop": a test model's server 14.1 -> 11.5 s).
    starting = asyncio.get_running_loop().create_task(AsyncEngine.start(config))
    try:
        await asyncio.sleep(0)  # the task spawns the process before its first await
        _leave_cores_to_engine()  # on this thread: torch's thread count is per thread under OpenMP
        tokenizer = await asyncio.to_thread(load_tokenizer, config.model.model)
    except BaseException:
        starting.cancel()  # a start still waiting for READY stops its process (AsyncEngine.start)
        with contextlib.suppress(BaseException):
            await (await starting).shutdown()
        raise
    engine = await starting
    try:
        info = engine.model_info
        model = config.model.model
        name = args.served_model_name or Path(model.rstrip("/") if model else info.model_path).stem
        app = build_app(engine, tokenizer, name, api_key=args.api_key, max_waiting=args.max_waiting,
                        max_request_bytes=args.max_request_bytes, max_n=args.max_n,
                        chat_settings=ChatSettings(args.tool_call_parser, args.reasoning_parser,
                                                   getattr(args, "chat_template_text", None)))
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                timeout_graceful_shutdown=5,
                                http=h11_with_header_timeout(args.header_timeout, args.body_timeout))
        server = _Server(config, engine)
        print(f"kvserve: serving {name!r} ({info.model_path}) at http://{args.host}:{args.port}/v1\n"
              f"kvserve: try  curl http://{args.host}:{args.port}/v1/chat/completions -H "
              f"'content-type: application/json' -d '{{\"messages\": [{{\"role\": \"user\", "
              f"\"content\": \"Hello!\"}}], \"max_tokens\": 32}}'", flush=True)
        await server.serve()
    finally:
        await engine.shutdown()


class _Server(uvicorn.Server):
    """uvicorn.Server whose exit signal first stops the engine, so open streams end now
    (with an error event) instead of holding the graceful shutdown until they finish."""

    def __init__(self, config: uvicorn.Config, engine: Any) -> None:
        super().__init__(config)
        self._engine = engine
        self._loop = asyncio.get_running_loop()

    async def on_tick(self, counter: int) -> bool:
        if self._engine.stop_signal is not None and not self.should_exit:  # the engine alone got it
            print(f"kvserve: the engine process was stopped by {signal.Signals(self._engine.stop_signal).name}; "
                  "stopping the server", file=sys.stderr, flush=True)
            self.should_exit = True
        return await super().on_tick(counter)

    def handle_exit(self, sig: int, frame: Any) -> None:
        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._engine.shutdown()))
        super().handle_exit(sig, frame)


def _raise_exit(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def cmd_serve(args: argparse.Namespace) -> int:
    _check_args(args)  # ValueError -> exit code 2 in cli.main
    config = EngineConfig.from_cli_args(args)  # bad engine flags too, before anything loads
    # uvicorn re-raises a captured SIGTERM after its graceful stop; make that an
    # exception so the engine process is shut down in `serve`'s finally.
    signal.signal(signal.SIGTERM, _raise_exit)
    try:
        asyncio.run(serve(args, config))
    except (KeyboardInterrupt, SystemExit):
        return 0
    except RuntimeError as e:  # the engine failed to start; its message says why
        print(f"kvserve: error: {e}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvserve serve", description="OpenAI-compatible server")
    add_server_args(p)
    args = p.parse_args(argv)
    try:
        return cmd_serve(args)
    except ValueError as e:
        print(f"kvserve: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":  # python -m kvserve.server.launch: same as `kvserve serve`
    sys.exit(main())
