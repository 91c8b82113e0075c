"""`qwen3`: Qwen3's reasoning, only where the output opens it with <think>: text before <think> and
after </think> is the answer, between them the reasoning (all of the rest when </think> never
comes). An output without <think> is all answer, so a request with
chat_template_kwargs={"enable_thinking": false} (whose prompt closes the thinking) has none.
"""

from __future__ import annotations

from kvserve.server.reasoning_parsers.base import ReasoningParser, register
from kvserve.server.tool_parsers.base import held_back


@register
class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"

    def split(self, text: str, final: bool) -> tuple[str | None, str]:
        i = text.find(self.START)
        if i < 0:
            return None, text if final else text[:len(text) - held_back(text, self.START)]
        reasoning, after = self.until_end(text[i + len(self.START):], final)
        return reasoning, text[:i] + (after or "")
