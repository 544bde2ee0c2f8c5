"""A model's chat format for multi-turn rollouts: how a conversation with tools is written, and the
token ids of one new turn on their own.

Two encodings: the tokenizer's own chat template (Qwen3's: tools listed in the system turn,
``<tool_call>{json}</tool_call>`` in the assistant turn, results in a user turn of
``<tool_response>`` blocks), or vLLM's DeepSeek-V4 encoder (``vllm/tokenizers/deepseek_v4_encoding.py``,
chat mode: DeepSeek ships no Jinja template), as the model family names it
(``Family.chat_encoding``).

A rollout never re-tokenises text it has already turned into ids: the policy's ids are kept as
sampled, and only a new turn's text is rendered and tokenised on its own. That text is what the
template writes after the assistant turn's end token, so the boundary is that special token, which
no BPE merge crosses.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Sequence

ENCODINGS = ("", "deepseek_v4")  # "" = the tokenizer's chat template


def _special(tokenizer, token_id: int) -> bool:
    added = getattr(tokenizer, "added_tokens_decoder", {}).get(token_id)
    return token_id in tokenizer.all_special_ids or bool(added is not None and added.special)


@dataclass
class ChatFormat:
    """``render(messages)``: the conversation as the model reads it, with ``tools`` (OpenAI function
    specs, ``Tool.spec()``) offered; ``end_id``: the special token that ends an assistant turn (found
    by rendering one). A ValueError names what the tokenizer or its template lacks."""

    tokenizer: Any
    tools: list[dict] = field(default_factory=list)
    encoding: str = ""

    def __post_init__(self) -> None:
        if self.encoding not in ENCODINGS:
            raise ValueError(f"chat encoding {self.encoding!r} is not one of {', '.join(map(repr, ENCODINGS))}")
        if not self.encoding and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template to write the conversation with")
        probe = [{"role": "user", "content": "1"}]
        if self.tools and self.tools[0]["function"]["name"] not in self.render(probe):
            raise ValueError("the tokenizer's chat template ignores tools: it cannot offer them to the model")
        head = self.render(probe)
        # An assistant turn with a user turn after it: a template may write the last assistant turn
        # otherwise (Qwen3's opens it with an empty think block), never one the conversation goes on from.
        tail = self.render(probe + [{"role": "assistant", "content": "2"}, {"role": "user", "content": "3"}],
                           add_generation_prompt=False)
        if not tail.startswith(head + "2"):
            raise ValueError("the chat template does not write an assistant turn after its generation prompt")
        ids = self._encode(tail[len(head) + 1:])
        if not ids or not _special(self.tokenizer, ids[0]):
            raise ValueError("the chat template ends an assistant turn without a special token")
        self.end_id = ids[0]
        self.end_text = self.tokenizer.convert_ids_to_tokens(self.end_id)

    # ------------------------------------------------------------ rendering

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        """The conversation's text; after a user or tool turn, with the next assistant turn opened."""
        if self.encoding == "deepseek_v4":
            return _deepseek_v4(list(messages), self.tools)
        return self.tokenizer.apply_chat_template(list(messages), tools=self.tools or None, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, messages: Sequence[dict]) -> tuple[str, list[int]]:
        """(text, ids) of a prompt: the conversation with the assistant's turn opened."""
        text = self.render(messages)
        return text, self._encode(text)

    def _after(self, head: str, full: str) -> int:
        """Where ``full`` goes on past the assistant turn that starts at the end of ``head``."""
        if not full.startswith(head):
            raise ValueError("the chat template rewrites earlier turns when a turn is added")
        end = full.find(self.end_text, len(head))
        if end < 0:
            raise ValueError(f"the chat template wrote no {self.end_text} after an assistant turn")
        return end

    def assistant_ids(self, history: Sequence[dict], message: dict) -> list[int]:
        """The ids the policy writes for ``message`` after ``history`` (a demonstration), its end token
        included: the text the template writes for it, tokenised on its own."""
        head = self.render(history)
        full = self.render([*history, message], add_generation_prompt=False)
        return self._encode(full[len(head):self._after(head, full)]) + [self.end_id]

    def tool_turn_ids(self, history: Sequence[dict], calls: Sequence[dict], results: Sequence[str]) -> list[int]:
        """The ids that follow an assistant turn's end token when its ``calls`` (OpenAI tool_calls;
        those that parsed) returned ``results``: the tool messages and the next assistant opener,
        rendered after ``history`` and tokenised on their own."""
        head = self.render(history)
        assistant = {"role": "assistant", "content": "", **({"tool_calls": list(calls)} if calls else {})}
        tools = [{"role": "tool", "content": r} for r in results]
        full = self.render([*history, assistant, *tools])
        return self._encode(full[self._after(head, full) + len(self.end_text):])


def _deepseek_v4(messages: list[dict], tools: list[dict]) -> str:
    """vLLM's DeepSeek-V4 encoding in chat mode; the tools attach to the first system message, or a
    system message of their own opens the conversation (as vLLM's own DeepSeek-V4 tokenizer does)."""
    from vllm.tokenizers.deepseek_v4_encoding import encode_messages

    if tools:
        i = next((i for i, m in enumerate(messages) if m.get("role") == "system"), None)
        if i is None:
            messages.insert(0, {"role": "system", "content": ""})
            i = 0
        messages[i] = {**copy.copy(messages[i]), "tools": tools}
    return encode_messages(messages, thinking_mode="chat")


def tool_call(name: str, arguments: Any) -> dict:
    """One call in OpenAI's tool_calls format (what a chat template renders)."""
    return {"type": "function", "function": {"name": name, "arguments": arguments}}
