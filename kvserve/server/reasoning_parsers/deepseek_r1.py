"""`deepseek_r1`: DeepSeek-R1's reasoning. Its template opens <think> in the prompt, so the output
may start without it: everything before </think> is reasoning (a leading <think> is dropped), what
follows is the answer. An output that never closes the reasoning is all reasoning, as in vLLM.
"""

from __future__ import annotations

from kvserve.server.reasoning_parsers.base import ReasoningParser, register


@register
class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"

    def split(self, text: str, final: bool) -> tuple[str | None, str]:
        head = text.lstrip()
        if head.startswith(self.START):
            text = head[len(self.START):]
        elif not final and self.START.startswith(head):
            return "", ""  # nothing yet, or a part of <think>
        reasoning, after = self.until_end(text, final)
        return reasoning, after or ""
