"""Chat messages -> prompt text in the tokenizer's template family (as `Tokenizer.chat_prompt`, any number of
turns): ChatML (SmolLM2; its default system prompt when none is given) or Llama-3 headers."""

from __future__ import annotations

from futx.tokenizer import SMOLLM_SYSTEM

ROLES = ("system", "user", "assistant")


def render_chat(tokenizer, messages: list[dict]) -> str:
    """`messages`: [{"role", "content": str}] (validated by the caller). Ends with the assistant's turn opened."""
    if tokenizer.token_id("<|im_start|>") is not None:
        if messages[0]["role"] != "system":
            messages = [{"role": "system", "content": SMOLLM_SYSTEM}] + list(messages)
        return ("".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
                + "<|im_start|>assistant\n")
    if tokenizer.token_id("<|start_header_id|>") is not None:
        return ("".join(f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content']}<|eot_id|>"
                        for m in messages) + "<|start_header_id|>assistant<|end_header_id|>\n\n")
    raise ValueError(f"no known chat template for the tokenizer from {tokenizer.source}")
